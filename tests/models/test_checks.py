"""The one rule for integers and numbers that every config, setting and message check applies."""

import math

import pytest

from models.checks import is_finite_number, is_integer, is_number


@pytest.mark.parametrize(
    ("value", "integer", "number", "finite"),
    [
        (3, True, True, True),
        (0, True, True, True),
        (-2, True, True, True),
        (10**400, True, True, True),  # beyond the float range: an integer, never converted
        (2.5, False, True, True),
        (3.0, False, True, True),  # a float, even a whole one, is not an integer
        (math.inf, False, True, False),
        (math.nan, False, True, False),
        (True, False, False, False),  # bool is an int subclass in Python; a switch is not a count
        (False, False, False, False),
        ("3", False, False, False),
        (None, False, False, False),
    ],
)
def test_a_bool_is_neither_an_integer_nor_a_number(value, integer, number, finite):
    assert (is_integer(value), is_number(value), is_finite_number(value)) == (integer, number, finite)
