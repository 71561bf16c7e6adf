"""Where each setting of a frozen config dataclass comes from, highest first: a flag, the environment
(TXS_<NAME>), the `--config` YAML file, then the dataclass's own defaults (packaged with the code).

pydantic-settings merges the layers and turns text (environment variables, `--set` values) into each field's
type: `1e-3` is a float, `null` is None for an optional setting, `300` an integer. Values that are typed
already (a YAML file, code) pass as they are. What a value may be is the dataclass's to say
(ServeConfig.__post_init__): a value that does not parse as its type reaches it as the text it was, so every
refusal names the setting and what it expects, whichever layer the value came from.

A secret comes from the environment only: TXS_<NAME>, or the file named by TXS_<NAME>_FILE (a mounted
Kubernetes or Docker secret). A file of settings or a flag that holds one is refused: the one is committed
next to deployments, the other is visible to every user of the host (ps).
"""

import dataclasses
import functools
import json
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import ValidationError, WrapValidator, create_model
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

ENV_PREFIX = "TXS_"
NULL_TEXT = {"null", "none", "~"}  # what the text of an optional setting says for None (YAML's spellings)
MASK = "********"


class _Layers(BaseSettings):
    # extra="forbid" is a backstop: read_layers names unknown settings with their layer first.
    model_config = SettingsConfigDict(extra="forbid", frozen=True)


def env_name(setting: str) -> str:
    return ENV_PREFIX + setting.upper()


def _from_text(hint: Any) -> WrapValidator:
    optional = type(None) in typing.get_args(hint)

    def parse(value: Any, handler) -> Any:
        if not isinstance(value, str):
            return value  # typed already: the config checks it
        if optional and value.strip().lower() in NULL_TEXT:
            return None
        try:
            return handler(value)
        except ValidationError:
            return value  # the config refuses it, naming the setting and what it expects

    return WrapValidator(parse)


@functools.cache
def settings_model(config_cls: type) -> type[BaseSettings]:
    """A pydantic-settings model with the fields, types and defaults of the dataclass `config_cls`."""
    hints = typing.get_type_hints(config_cls)
    fields = {}
    for f in dataclasses.fields(config_cls):
        if f.init:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            fields[f.name] = (Annotated[hints[f.name], _from_text(hints[f.name])], default)
    return create_model(f"{config_cls.__name__}Layers", __base__=_Layers, **fields)


def from_text(config_cls: type, name: str, text: str) -> Any:
    """`text` as setting `name` of `config_cls` takes it (as from the environment); an unknown name keeps it."""
    model = settings_model(config_cls)
    if name not in model.model_fields:
        return text
    return getattr(model(_build_sources=((InitSettingsSource(model, {name: text}),), {})), name)


class EnvironmentSource(PydanticBaseSettingsSource):
    """TXS_<NAME> for every setting; a secret also from the file named by TXS_<NAME>_FILE. An empty variable
    counts as unset."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str], secrets: Collection[str]):
        super().__init__(settings_cls)
        self.env, self.secrets = env, secrets
        self.origins: dict[str, str] = {}  # setting -> the variable it came from

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        variable = env_name(field_name)
        text = self.env.get(variable) or None
        path = self.env.get(variable + "_FILE") if field_name in self.secrets else None
        if path:
            if text is not None:
                raise ValueError(f"both {variable} and {variable}_FILE are set: keep one of them")
            return _read_secret(variable + "_FILE", path), variable + "_FILE", False
        return text, variable, False

    def __call__(self) -> dict[str, Any]:
        values = {}
        for name, field in self.settings_cls.model_fields.items():
            value, variable, _ = self.get_field_value(field, name)
            if value is not None:
                values[name], self.origins[name] = value, variable
        return values


def _read_secret(variable: str, path: str) -> str:
    try:
        secret = Path(path).read_text().rstrip("\r\n")  # a file written with echo ends in a newline
    except OSError as error:
        raise ValueError(f"{variable} = {path!r}: cannot read the secret ({error.strerror})") from error
    if not secret:
        raise ValueError(f"{variable} = {path!r}: the file is empty")
    return secret


def read_layers(
    config_cls: type,
    flags: Mapping[str, Any],
    env: Mapping[str, str],
    from_file: Mapping[str, Any],
    file_name: str,
    secrets: Collection[str],
) -> tuple[dict[str, Any], dict[str, str]]:
    """(the settings the layers set, {setting: where it came from}): `flags` beat `env`, which beats
    `from_file` (the settings read from the file `file_name`). Settings none of them sets are left out: the
    dataclass's defaults. Refuses a secret outside the environment; unknown names are the caller's to refuse."""
    model = settings_model(config_cls)
    # A secret left null (as a printed config or a copied ServeConfig writes it) sets nothing: no refusal,
    # and no null over a secret the environment gives.
    flags, from_file = (
        {k: v for k, v in layer.items() if not (k in secrets and v is None)} for layer in (flags, from_file)
    )
    for where, given in ((file_name, from_file), ("the command line", flags)):
        held = sorted(set(given) & set(secrets))
        if held:
            variables = " or ".join(
                f"{env_name(name)} (or {env_name(name)}_FILE naming a file)" for name in held
            )
            raise ValueError(
                f"{where} holds the secret {', '.join(held)}, but secrets come from the environment only: "
                f"set {variables}"
            )
    environment = EnvironmentSource(model, env, secrets)
    sources = (
        InitSettingsSource(model, dict(flags)),
        environment,
        InitSettingsSource(model, dict(from_file)),
    )
    layered = model(_build_sources=(sources, {}))
    values = {name: getattr(layered, name) for name in layered.model_fields_set}
    origins = {
        name: "command line" if name in flags else environment.origins.get(name, file_name) for name in values
    }
    return values, origins


def unknown(config_cls: type, given: Collection[str]) -> list[str]:
    return sorted(set(given) - set(settings_model(config_cls).model_fields))


def format_settings(cfg: Any, origins: Mapping[str, str], secrets: Collection[str]) -> str:
    """Every setting of `cfg` as a line of YAML with where it came from, secrets masked and commented out:
    the text is itself a valid `--config` file."""
    names = [f.name for f in dataclasses.fields(cfg)]
    width = max(len(name) for name in names) + 2
    lines = [
        "# the effective settings, each from the first of: command line, environment (TXS_<NAME>), --config file, "
        "default"
    ]
    for name in names:
        value = getattr(cfg, name)
        origin = origins.get(name, "default")
        if name in secrets:
            shown = json.dumps(MASK if value is not None else None)
            lines.append(f"# {name + ':':<{width}}{shown}  # {origin}; a secret: from the environment only")
        else:
            lines.append(f"{name + ':':<{width + 2}}{json.dumps(value, default=str)}  # {origin}")
    return "\n".join(lines)
