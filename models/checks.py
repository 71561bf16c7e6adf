"""What counts as an integer and as a number in a config, a setting or a message, everywhere in txsentinel.

Python makes bool a subclass of int (True + 1 == 2), so `isinstance(True, int)` holds: a switch written where a
count belongs (`folds: true` in YAML, `"max_poll_records": true` in JSON) would be read as 1. Here a bool is
neither an integer nor a number, and every check of a value's type goes through these, so no config accepts
what another refuses. Each caller keeps its own message, naming the setting or field and where it came from.
`read_setting` is how a `--set KEY=VALUE` flag of train and generate becomes a value, read alike by both;
`read_yaml_file` how serve's and generate's `--config` files become settings.
"""

import math
from pathlib import Path
from typing import Any

import yaml


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


def read_setting(item: str, example: str) -> tuple[str, Any]:
    """A `--set KEY=VALUE` flag -> (KEY, VALUE read as YAML: `200` an int, `0.5` a float, `null` None,
    `2026-03-01` a date). ValueError naming the flag, with `example` (a KEY=VALUE) to follow, when it is not
    KEY=VALUE or VALUE does not read."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"--set {item!r}: expected key=value, e.g. --set {example}")
    try:
        return key, yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as error:  # ValueError: a date that does not exist, 2026-13-01
        raise ValueError(f"--set {item!r}: the value is not valid YAML ({error})") from None


def read_yaml_file(path: Path, what: str) -> dict[str, Any]:
    """The settings a YAML file holds; refuses a missing file, bad YAML and anything but a mapping."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}): expected a YAML file") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {' '.join(str(error).split())}") from error
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping of {what}, got {type(loaded).__name__}")
    return loaded
