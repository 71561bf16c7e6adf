"""What counts as an integer and as a number in a config, a setting or a message, everywhere in txsentinel.

Python makes bool a subclass of int (True + 1 == 2), so `isinstance(True, int)` holds: a switch written where a
count belongs (`folds: true` in YAML, `"max_poll_records": true` in JSON) would be read as 1. Here a bool is
neither an integer nor a number, and every check of a value's type goes through these, so no config accepts
what another refuses. Each caller keeps its own message, naming the setting or field and where it came from.
"""

import math


def is_integer(value: object) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float, not a bool; inf and nan included (see is_finite_number)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    """A number (is_number) that is neither infinite nor nan. Any integer is, however large: it is never
    converted to a float, which would overflow past 1.8e308 (a JSON message may hold such a number)."""
    return is_integer(value) or (isinstance(value, float) and math.isfinite(value))
