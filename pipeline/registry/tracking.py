"""MLflow: where runs go, loading a registered model for the service, aliases and promotion (the logged
model itself: pyfunc_model.py).

Default tracking store: SQLite `mlflow.db` in the working directory (browse it with
`mlflow ui --backend-store-uri sqlite:///mlflow.db`); MLFLOW_TRACKING_URI points anywhere else. The store is
opened once a process, when a command first needs it, so that one it cannot use fails the command at its start
in one line (TrackingStoreError), not in a traceback, minutes of retries, or after the training.
"""

import fcntl
import functools
import importlib.metadata
import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

import mlflow
from mlflow import environment_variables
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.credentials import get_default_host_creds
from mlflow.utils.rest_utils import http_request_safe
from mlflow.utils.validation import _validate_experiment_name, _validate_model_name
from sqlalchemy.exc import SQLAlchemyError

from pipeline.registry.artifact import LoadedModel, load_model_dir

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
# How long a tracking server has to answer the first request. MLflow's own client retries an unanswered request
# for minutes (MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT), right for a server that falls over
# during a run, not for one that was never there. A healthy server answers in milliseconds.
SERVER_ANSWER_SECONDS = 10
SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


class TrackingStoreError(Exception):
    """MLFLOW_TRACKING_URI names a store this process cannot use; the message says why and what to do.
    `unavailable`: a server refused or did not answer (the setting may be right); else the setting is wrong."""

    def __init__(self, message: str, unavailable: bool = False):
        super().__init__(message)
        self.unavailable = unavailable


def configure_tracking() -> str:
    # Usage telemetry would try to reach the internet from training machines and CI; keep it off.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # One progress bar per downloaded artifact drowns the tables the commands print.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI)
    if not uri.strip():  # MLflow would take "" for a file store in the working directory
        raise TrackingStoreError(
            "MLFLOW_TRACKING_URI is set but empty: unset it for the default store "
            f"{DEFAULT_TRACKING_URI}, or set it to a store's URI"
        )
    mlflow.set_tracking_uri(uri)
    _open_store_once(uri)
    return uri


@functools.cache  # once a process: configure_tracking runs before every registry call
def _open_store_once(uri: str) -> None:
    scheme = urllib.parse.urlparse(uri).scheme.lower()
    if uri.startswith("sqlite:///"):
        _open_sqlite_store(uri)
    elif scheme in ("http", "https"):
        _check_server_answers(uri)
    elif scheme in ("", "file"):
        _open_file_store(uri)
    else:  # another database, Databricks, a plugin's scheme, or one MLflow does not know
        _open_with_mlflow(uri, list_one=False)


def _named(uri: str) -> str:
    if "MLFLOW_TRACKING_URI" in os.environ:
        return f"MLFLOW_TRACKING_URI={uri}"
    return f"the default tracking store {uri} (MLFLOW_TRACKING_URI is unset)"


def _first_line(error: BaseException) -> str:
    text = error.message if isinstance(error, MlflowException) else str(error)
    return next(
        (line.strip().rstrip(".") for line in text.splitlines() if line.strip()), type(error).__name__
    )


def _open_sqlite_store(uri: str) -> None:
    """Open a SQLite store under a lock file beside it (`mlflow.db.lock`). MLflow creates and migrates a new
    store's tables on first use, unguarded: two jobs opening a new store at once (two `train` runs started
    together) both migrate it, fail with "table ... already exists", and leave it unusable. Under the lock the
    first opener creates the tables and the others find them; a store that exists costs one query a process."""
    path = uri.removeprefix("sqlite:///").split("?", 1)[0]  # sqlite:////abs -> /abs, sqlite:///rel -> rel
    if not path or path == ":memory:":
        return
    database = Path(path)
    if problem := _sqlite_path_problem(database):
        raise TrackingStoreError(f"{_named(uri)}: {problem}")
    lock_file = Path(f"{path}.lock")
    try:
        # A missing directory is made, as MLflow itself does for a SQLite store (`mlflow server`, `mlflow ui`):
        # the path names where the store is to be, and the lock file needs the directory before MLflow does.
        database.parent.mkdir(parents=True, exist_ok=True)
        lock_file.touch()
    except OSError as error:
        raise TrackingStoreError(
            f"{_named(uri)}: cannot create {error.filename or lock_file} ({error.strerror}); point it at a "
            "directory this user can write"
        ) from error
    with lock_file.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        _open_with_mlflow(uri, list_one=True)


def _sqlite_path_problem(database: Path) -> str | None:
    """What keeps `database` from being a SQLite store, found before MLflow opens it: given a directory or a
    file of another kind, MLflow retries for over a minute or fails in a SQL traceback."""
    for parent in database.parents:
        if parent.exists() and not parent.is_dir():
            return f"{parent} is a file, so no store can be under it; point it at a path in a directory"
    if database.is_dir():
        return f"{database} is a directory; name the database file in it, e.g. sqlite:///{database}/mlflow.db"
    if not database.is_file():
        return None  # a new store: MLflow creates it
    try:
        with database.open("rb") as file:
            header = file.read(len(SQLITE_HEADER))
    except OSError as error:
        return f"cannot read {database} ({error.strerror}); point it at a store this user can read"
    if header and header != SQLITE_HEADER:  # an empty file is a new database to SQLite
        return (
            f"{database} is not a SQLite database; point it at an MLflow store, or at a new file to start one"
        )
    return None


def _open_file_store(uri: str) -> None:
    # MLflow 3 keeps its file store (./mlruns) in maintenance mode and refuses it unless the user opts in.
    opted_in = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)
    if opted_in is not None and not opted_in.get():
        raise TrackingStoreError(
            f"{_named(uri)}: a file store, which MLflow {mlflow.__version__} refuses unless "
            "MLFLOW_ALLOW_FILE_STORE=true; use a database store instead, e.g. sqlite:///mlflow.db (`mlflow "
            "migrate-filestore` copies an existing file store's runs into one)"
        )
    _open_with_mlflow(uri, list_one=True)


def _open_with_mlflow(uri: str, list_one: bool) -> None:
    """MLflow builds the store (an unknown scheme or a missing database driver fails here) and, with `list_one`,
    reads one experiment from it (a new SQLite store gets its tables)."""
    try:
        client = MlflowClient(uri)
        if list_one:
            client.search_experiments(max_results=1)
    except ImportError as error:
        raise TrackingStoreError(
            f"{_named(uri)}: its database driver is not installed ({_first_line(error)}); install it, or use "
            "another store"
        ) from error
    except (MlflowException, SQLAlchemyError) as error:
        raise TrackingStoreError(
            f"{_named(uri)}: MLflow cannot open this store: {_first_line(error)}. Point MLFLOW_TRACKING_URI at "
            "an MLflow store (a sqlite:/// path, or a tracking server's http(s):// address)"
        ) from error


def _check_server_answers(uri: str) -> None:
    """One request (list one experiment), answered within SERVER_ANSWER_SECONDS, with the credentials and TLS
    settings MLflow's own requests use."""
    try:
        http_request_safe(
            get_default_host_creds(uri),
            "/api/2.0/mlflow/experiments/search",
            "POST",
            json={"max_results": 1},
            max_retries=0,
            timeout=SERVER_ANSWER_SECONDS,
        )
    except MlflowException as error:
        raise TrackingStoreError(
            f"the MLflow tracking server at {uri} (MLFLOW_TRACKING_URI) refused or did not answer within "
            f"{SERVER_ANSWER_SECONDS} s: {_first_line(error)}. Check that it runs there and that "
            "MLFLOW_TRACKING_URI names it, with its credentials (MLFLOW_TRACKING_TOKEN, or "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD) where it needs them",
            unavailable=True,
        ) from error


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
    configure_tracking()
    registered = registered_version(uri)  # an alias is resolved once: what is downloaded is what it named
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
    name, _, version = uri.removeprefix("models:/").partition("/")
    if version:
        return name, version
    name, _, alias = name.partition("@")
    if not alias:
        return None  # models:/NAME names no version
    configure_tracking()
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
    configure_tracking()
    client = MlflowClient()
    # Every registered version of the model, by run (the name was checked to hold no quote).
    runs = {int(v.version): v.run_id for v in client.search_model_versions(f"name='{registered_name}'")}
    if not runs:
        raise ValueError(
            f"no registered model {registered_name!r} in {mlflow.get_tracking_uri()}: train one first "
            "(`txsentinel train`), or set MLFLOW_TRACKING_URI to the store that has it"
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


def registered_name_problem(name: str) -> str | None:
    """What the registry would refuse in a registered model's name, or None: MLflow's own check (the one its
    SQL stores and tracking server apply), and a quote, which promote's search filter cannot hold."""
    if "'" in name:
        return "a registered model's name holds no quote (')"
    return _mlflow_refusal(_validate_model_name, name)


def experiment_name_problem(name: str) -> str | None:
    """What MLflow would refuse in an experiment's name (its own check), or None."""
    return _mlflow_refusal(_validate_experiment_name, name)


def _mlflow_refusal(check: Any, name: str) -> str | None:
    # MLflow's checks are private functions; tests/pipeline/registry/test_tracking.py holds them to their rules.
    try:
        check(name)
    except MlflowException as error:
        return _first_line(error)
    return None


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
