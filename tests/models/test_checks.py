"""The one rule for integers and numbers that every config, setting and message check applies."""

import math

import pytest

from models.checks import is_finite_number, is_integer, is_number, read_yaml_file


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


@pytest.mark.parametrize(
    ("text", "line", "complaint"),
    [
        (
            "accounts: 3\nstart_date: 2026-13-01\n",
            2,
            "'2026-13-01' does not read as a timestamp (month must be",
        ),
        ("when: {day: 2026-02-30}\n", 1, "'2026-02-30' does not read as a timestamp (day is out of range"),
        (
            "model: lstm\nmodel: logreg\n",
            2,
            "key 'model' given twice (first at line 1)",
        ),  # not: the last wins
        ("a: {x: 1,\n    x: 2}\n", 2, "key 'x' given twice (first at line 1)"),
    ],
)
def test_a_yaml_value_that_cannot_be_built_is_refused_naming_the_file_and_the_line(
    tmp_path, text, line, complaint
):
    # PyYAML reads 2026-13-01 as a date and raises a bare ValueError building it: the message named no file.
    path = tmp_path / "settings.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as refused:
        read_yaml_file(path, "settings")
    message = str(refused.value)
    assert message.startswith(f"{path}: not valid YAML: {complaint}")
    assert f'in "{path}", line {line}' in message and "\n" not in message
