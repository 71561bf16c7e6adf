"""The packaged YAML profiles: training profiles (train/), example ingest mappings (data/) and generator
profiles (generate/).

They ship inside the wheel, so an installed txsentinel finds them without the repository: `--config quick`
names the packaged profile configs/train/quick.yaml, `--mapping handbook` the mapping configs/data/handbook.yaml,
`generate --config handbook` the generator profile configs/generate/handbook.yaml.
"""

from functools import partial
from importlib.resources import files
from pathlib import Path
from typing import Any

KINDS = ("train", "data", "generate")


def packaged(kind: str) -> Path:
    """The folder of the packaged profiles of `kind` (one of KINDS)."""
    if kind not in KINDS:
        raise ValueError(f"packaged profiles: kind {kind!r}, expected one of {', '.join(KINDS)}")
    return Path(str(files(__name__) / kind))


def resolve(kind: str, name_or_path: str | Path) -> Path:
    """A YAML file given as a path, or as the name of a packaged profile ("quick" -> train/quick.yaml).

    A path that exists wins; otherwise a bare name (no folder, .yaml optional) is looked up among the packaged
    ones. Anything else is returned as it was, for the caller to report as a missing file.
    """
    path = Path(name_or_path)
    if path.exists() or len(path.parts) != 1:
        return path
    candidate = packaged(kind) / (path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml")
    return candidate if candidate.is_file() else path


def names(kind: str) -> list[str]:
    """The packaged profiles of `kind`, by name."""
    return sorted(p.stem for p in packaged(kind).glob("*.yaml"))


def option(kind: str, what: str) -> dict[str, Any]:
    """argparse keyword arguments of an option that takes a YAML file, or a packaged profile of `kind` by
    name; `what` opens its help."""
    return {
        "type": partial(resolve, kind),
        "default": None,
        "help": f"{what}, or a packaged profile by name: {', '.join(names(kind))}",
    }
