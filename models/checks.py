"""What counts as an integer and as a number in a config, a setting or a message, everywhere in txsentinel.

Python makes bool a subclass of int (True + 1 == 2), so `isinstance(True, int)` holds: a switch written where a
count belongs (`folds: true` in YAML, `"max_poll_records": true` in JSON) would be read as 1. Here a bool is
neither an integer nor a number, and every check of a value's type goes through these, so no config accepts
what another refuses. Each caller keeps its own message, naming the setting or field and where it came from.
`read_setting` is how a `--set KEY=VALUE` flag of train and generate becomes a value, read alike by both;
`read_yaml_file` how serve's, train's and generate's `--config` files become settings, `load_yaml` how any YAML
file is read.
"""

import math
from collections.abc import Hashable
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


def read_number(value: Any) -> Any:
    """The float a text holds, for a setting that takes a number: YAML 1.1 reads 5e-4, 1e9 and 5e0 (an exponent
    with no dot) as strings. Anything else, other text included, is returned as it is, for the caller to
    refuse with its own message."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


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


class _SafeLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, except that a value YAML reads but cannot build (the date 2026-13-01 raises
    ValueError inside PyYAML) is a YAML error at the value's line, as a syntax error is; and so is a key
    given twice in one mapping, which yaml.safe_load reads as its last value, silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} given twice (first at line {seen[key].line + 1})",
                    key_node.start_mark,
                )
            if isinstance(key, Hashable):
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except ValueError as error:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"{node.value!r} does not read as a {node.tag.rpartition(':')[2]} ({error})",
                node.start_mark,
            ) from None


def load_yaml(text: str, name: str) -> Any:
    """`text` read as yaml.safe_load reads it; any error is a yaml.YAMLError whose mark gives `name` (the file)
    and the line."""
    loader = _SafeLoader(text)
    loader.name = name  # what its marks name: "<unicode string>" otherwise
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml_file(path: Path, what: str) -> dict[str, Any]:
    """The settings a YAML file holds; refuses a missing file, bad YAML and anything but a mapping."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    try:
        loaded = load_yaml(Path(path).read_text(encoding="utf-8"), str(path)) or {}
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}): expected a YAML file") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {' '.join(str(error).split())}") from error
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping of {what}, got {type(loaded).__name__}")
    return loaded
