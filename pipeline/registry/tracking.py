"""Loading a registered model for the service, aliases and promotion (the store itself: tracking_store.py; the
logged model: pyfunc_model.py)."""

import importlib.metadata
import re
from pathlib import Path
from typing import Any

import mlflow
from mlflow.tracking import MlflowClient

from pipeline.registry.artifact import LoadedModel, load_model_dir
from pipeline.registry.names import registered_name_problem
from pipeline.registry.tracking_store import configure_registry, configure_tracking, described_registry


def _find_model_dir(root: Path, uri: str) -> Path:
    """The one model directory (holding detector.json) at or under `root`. More than one is refused rather
    than one picked: `--model .` in a directory of training runs would score with whichever came first."""
    if (root / "detector.json").is_file():
        return root
    candidates = sorted(p.parent for p in root.rglob("detector.json"))
    if not candidates:
        raise FileNotFoundError(f"model {uri!r}: {root} holds no txsentinel model (no detector.json inside)")
    if len(candidates) > 1:
        raise ValueError(
            f"model {uri!r}: {root} holds {len(candidates)} txsentinel models ({candidates[0]}, "
            f"{candidates[1]}, ...), not one; name the directory of the one to use"
        )
    return candidates[0]


def load_model(uri: str) -> LoadedModel:
    """A detector and its feature spec from `models:/NAME@ALIAS`, `models:/NAME/VERSION`, `runs:/RUN/model`
    or a local directory. A registered version's meta names it (model_version `models:/NAME/VERSION`)."""
    if not uri.strip():  # Path("") is the working directory: an unset $MODEL would load whatever lies there
        raise ValueError(
            f"model {uri!r}: an empty model URI; give models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN/model "
            "or a model directory"
        )
    local = Path(uri)
    if local.exists():
        return load_model_dir(_find_model_dir(local, uri), source=uri)
    if not uri.startswith(("models:/", "runs:/")):
        raise FileNotFoundError(f"model {uri!r}: not a local directory, nor a models:/ or runs:/ URI")
    configure_tracking(writes=False)
    # Opens the registry too. An alias is resolved once: what is downloaded is what it named.
    registered = registered_version(uri)
    pinned = uri if registered is None else f"models:/{registered[0]}/{registered[1]}"
    downloaded = Path(mlflow.artifacts.download_artifacts(artifact_uri=pinned))
    model = load_model_dir(_find_model_dir(downloaded, uri), source=uri)
    if registered is not None:
        # what its scores carry as model_version: the version itself, which an alias moved later still names
        model.meta.setdefault("model_version", pinned)
    return model


def registered_version(uri: str) -> tuple[str, str] | None:
    """(name, version) of the registered model version that `models:/NAME/VERSION` or `models:/NAME@ALIAS`
    names now; None for any other URI."""
    if not uri.startswith("models:/"):
        return None
    configure_registry(writes=False)  # where a models:/ URI resolves, however it names the version
    name, _, version = uri.removeprefix("models:/").partition("/")
    if version:
        return name, version
    name, _, alias = name.partition("@")
    if not alias:
        return None  # models:/NAME names no version
    return name, str(MlflowClient().get_model_version_by_alias(name, alias).version)


def pinned_requirements(*packages: str) -> list[str]:
    """This environment's versions of `packages`, so MLflow need not infer them (inference imports the
    model in a subprocess and costs tens of seconds per run)."""
    # A local version label (torch's "+cu132") names a build of one index, not a release: drop it, so a
    # fresh environment installs that release from wherever its packages come from.
    return [f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in packages]


PROMOTION_METRICS = (
    ("val/threshold", "alert threshold"),
    ("val/alerts_per_day", "alerts/day on validation"),
    ("val/precision_at_threshold", "precision at the threshold (validation)"),
    ("test/ap", "test AP"),
    ("test/cp_at_100", "test CP@100"),
    ("test/auc", "test AUC"),
)


def promotion_table(client: MlflowClient, registered_name: str, alias: str, version: int) -> str:
    """What moving `alias` to `version` changes: the candidate's logged figures beside the current holder's."""
    candidate = client.get_model_version(registered_name, str(version))
    try:
        current = client.get_model_version_by_alias(registered_name, alias)
    except mlflow.exceptions.MlflowException:
        current = None
    columns = [("candidate", candidate)] + ([("current " + alias, current)] if current else [])
    runs = {label: client.get_run(v.run_id) for label, v in columns}
    lines = [f"{'':42s}" + "".join(f"{label:>20s}" for label, _ in columns)]
    lines.append(f"{'version':42s}" + "".join(f"{'v' + str(v.version):>20s}" for _, v in columns))
    lines.append(
        f"{'detector':42s}"
        + "".join(f"{runs[label].data.tags.get('detector', '?'):>20s}" for label, _ in columns)
    )
    for key, title in PROMOTION_METRICS:
        cells = []
        for label, _ in columns:
            value = runs[label].data.metrics.get(key)
            cells.append(f"{'-' if value is None else f'{value:.4f}':>20s}")
        lines.append(f"{title:42s}" + "".join(cells))
    if current is None:
        lines.append(f"(no version holds @{alias} yet)")
    return "\n".join(lines)


def promote(alias: str, registered_name: str, run_id: str | None = None, version: int | None = None) -> int:
    """Point `alias` at a model version (given, or the one a run registered), after printing what changes;
    returns the version."""
    if (run_id is None) == (version is None):
        raise ValueError("promote: give exactly one of --run RUN_ID or --version N")
    if alias_problem := _alias_problem(alias):
        raise ValueError(f"--alias {alias!r}: {alias_problem}")
    if name_problem := registered_name_problem(registered_name):
        raise ValueError(f"--model-name {registered_name!r}: {name_problem}")
    configure_registry()  # the alias is written there; the tracking store is only read, for the runs' figures
    client = MlflowClient()
    # Every registered version of the model, by run (the name was checked to hold no quote).
    runs = {int(v.version): v.run_id for v in client.search_model_versions(f"name='{registered_name}'")}
    if not runs:
        registry, setting = described_registry()
        raise ValueError(
            f"no registered model {registered_name!r} in the MLflow {registry}: train one first "
            f"(`txsentinel train`), or set {setting} to the store that has it"
        )
    if run_id is not None:
        registered = [number for number, run in runs.items() if run == run_id]
        if not registered:
            raise ValueError(f"run {run_id!r} registered no version of model {registered_name!r}")
        version = max(registered)
    elif version not in runs:
        raise ValueError(f"model {registered_name!r} has no version {version}; its versions: {sorted(runs)}")
    print(promotion_table(client, registered_name, alias, int(version)))
    client.set_registered_model_alias(registered_name, alias, str(version))
    return int(version)


def _alias_problem(alias: str) -> str | None:
    # MLflow's rules for a registered model alias, checked before anything is read or printed.
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,255}", alias):
        return "an alias is 1 to 255 letters, digits, '_' or '-' (e.g. champion, challenger)"
    if alias.lower() == "latest" or re.fullmatch(r"[vV]\d+", alias):
        return "'latest' and v<number> are reserved for model versions: choose another name"
    return None


def log_params(params: dict[str, Any]) -> None:
    # MLflow caps a param value's length; configs are short, but a long period list must not fail the run.
    mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
