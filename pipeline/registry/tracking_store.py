"""Where runs and registered models go: the tracking store, and the model registry where MLFLOW_REGISTRY_URI keeps
it apart, each opened once a process when a command first needs it, so that one it cannot use fails the command
at its start in one line (TrackingStoreError), not in a traceback, minutes of retries, or after the training.

Default tracking store: SQLite `mlflow.db` in the working directory (browse it with
`mlflow ui --backend-store-uri sqlite:///mlflow.db`); MLFLOW_TRACKING_URI points anywhere else. The registry is
the tracking store's unless MLFLOW_REGISTRY_URI names another.
"""

import fcntl
import functools
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import mlflow
import requests
from mlflow import environment_variables
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.credentials import get_default_host_creds
from mlflow.utils.databricks_utils import get_databricks_host_creds
from mlflow.utils.rest_utils import MlflowHostCreds, http_request, verify_rest_response
from mlflow.utils.uri import (
    is_databricks_unity_catalog_uri,
    is_databricks_uri,
    is_file_uri,
    is_http_uri,
    is_local_uri,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from pipeline.data.error_text import first_line
from pipeline.data.output_paths import unwritable_file

TRACKING = "MLFLOW_TRACKING_URI"
REGISTRY = "MLFLOW_REGISTRY_URI"
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
# How long a tracking server has to answer the first request, unless MLFLOW_HTTP_REQUEST_TIMEOUT says. MLflow's
# own client retries an unanswered request for minutes (MLFLOW_HTTP_REQUEST_MAX_RETRIES), right for a server that
# falls over during a run, not for one that was never there. A healthy server answers in milliseconds.
SERVER_ANSWER_SECONDS = 10
# A server that answers busy (rate limited, restarting behind its proxy) is asked again after each of these waits,
# unless MLFLOW_HTTP_REQUEST_MAX_RETRIES sets MLflow's own retries.
BUSY_RETRY_WAITS_SECONDS = (1, 2)
BUSY_STATUS = frozenset({429, 500, 502, 503, 504})
# A database server's port where its URI names none. MLflow hands a database store to SQLAlchemy, which it retries
# for about 100 s when the server does not take the connection: a server that is not there is found out first by
# connecting to this port, given SERVER_ANSWER_SECONDS.
DATABASE_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}
SEARCH_ONE_EXPERIMENT = "/api/2.0/mlflow/experiments/search"
HTTP_CREDENTIALS = "MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD,"
DATABRICKS_CREDENTIALS = "DATABRICKS_TOKEN (or the profile's token)"
SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file

T = TypeVar("T")


class TrackingStoreError(Exception):
    """MLFLOW_TRACKING_URI (or MLFLOW_REGISTRY_URI) names a store this process cannot use; the message says why and
    what to do. `unavailable`: a server refused or did not answer (the setting may be right); else the setting is
    wrong."""

    def __init__(self, message: str, unavailable: bool = False):
        super().__init__(message)
        self.unavailable = unavailable


def configure_tracking(writes: bool = True) -> str:
    """Point MLflow at MLFLOW_TRACKING_URI's store, opened once a process; its URI. `writes`: the caller writes
    to the store (a run, an alias), so one this user can only read is refused too; else it only reads (loading
    a model)."""
    # Usage telemetry would try to reach the internet from training machines and CI; keep it off.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # One progress bar per downloaded artifact drowns the tables the commands print.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = os.environ.get(TRACKING, DEFAULT_TRACKING_URI)
    if not uri.strip():  # MLflow would take "" for a file store in the working directory
        raise TrackingStoreError(
            f"{TRACKING} is set but empty: unset it for the default store {DEFAULT_TRACKING_URI}, or set it to a "
            "store's URI"
        )
    mlflow.set_tracking_uri(uri)
    _refuse_read_only(TRACKING, uri, writes)
    return uri


def configure_registry(writes: bool = True) -> str:
    """Open the model registry as configure_tracking opens the tracking store, once a process: MLFLOW_REGISTRY_URI's
    store where it names one apart, else the tracking store itself; its URI. `writes`: the caller registers a
    model or moves an alias; else it only resolves one. The tracking store is opened too, to be read: a model's
    files are found through it."""
    uri = _separate_registry_uri()
    if uri is None:
        return configure_tracking(writes)
    configure_tracking(writes=False)
    _refuse_read_only(REGISTRY, uri, writes)
    return uri


def unwritable_tracking() -> str | None:
    """Why this user can only read the tracking store, as a line naming it, or None where it may write (a server's
    permissions show only when it refuses a write). Opens the store as configure_tracking(writes=False) does."""
    uri = configure_tracking(writes=False)
    read_only = _open_store_once(TRACKING, uri)
    return f"{_named(TRACKING, uri)}: {read_only}, so this user can only read it" if read_only else None


def described_tracking() -> tuple[str, str]:
    """("tracking store URI", the variable that sets it), for a message about a run that is not there."""
    return f"tracking store {_without_password(mlflow.get_tracking_uri())}", TRACKING


def described_registry() -> tuple[str, str]:
    """("model registry URI", the variable that sets it), for a message about a model that is not there: the
    tracking store's where MLFLOW_REGISTRY_URI names no store apart."""
    uri = _separate_registry_uri()
    return described_tracking() if uri is None else (f"model registry {_without_password(uri)}", REGISTRY)


def _separate_registry_uri() -> str | None:
    """MLFLOW_REGISTRY_URI where it names a store other than the tracking store's. MLflow takes it empty for unset."""
    uri = os.environ.get(REGISTRY, "").strip()
    return uri if uri and uri != os.environ.get(TRACKING, DEFAULT_TRACKING_URI) else None


def _refuse_read_only(setting: str, uri: str, writes: bool) -> None:
    if (read_only := _open_store_once(setting, uri)) and writes:
        raise TrackingStoreError(
            f"{_named(setting, uri)}: {read_only}, and this command writes to the store; point {setting} at a "
            "store this user can write"
        )


@functools.cache  # once a process: configure_tracking runs before every registry call
def _open_store_once(setting: str, uri: str) -> str | None:
    """Opens the store `setting` names; why this user can only read it, or None."""
    # The store's kind as MLflow's own helpers tell it: "databricks" parses as a relative path, not a scheme.
    if is_databricks_uri(uri):
        _check_databricks_answers(setting, uri)
    elif uri.startswith("sqlite:///"):
        return _open_sqlite_store(setting, uri)
    elif is_http_uri(uri):
        kind = "tracking server" if setting == TRACKING else "model registry server"
        server = f"the MLflow {kind} at {_without_password(uri)} ({setting})"
        _check_server_answers(server, setting, get_default_host_creds(uri), HTTP_CREDENTIALS)
    elif _is_file_store(uri):
        _open_file_store(setting, uri)
    else:  # another database, Unity Catalog, a plugin's scheme, or one MLflow does not know: MLflow says
        _check_database_answers(setting, uri)
        _open_with_mlflow(setting, uri, list_one=False)
    return None


def _is_file_store(uri: str) -> bool:
    # MLflow's store lookup takes a bare "databricks-uc" or "uc" for its scheme, though each parses as a path.
    unity_catalog = is_databricks_unity_catalog_uri(uri) or uri == "uc"
    return not unity_catalog and (is_file_uri(uri) or is_local_uri(uri))


def _named(setting: str, uri: str) -> str:
    if setting in os.environ:
        return f"{setting}={_without_password(uri)}"
    return f"the default tracking store {uri} ({TRACKING} is unset)"


def _without_password(uri: str) -> str:
    """`uri` with the password it may hold (a database's, postgresql://user:PASSWORD@host/db) shown as ***: a
    refusal is printed, and kept in job logs."""
    try:
        parts = urlsplit(uri)
        if parts.password is None:
            return uri
    except ValueError:  # a URI urllib cannot read holds no password it can find
        return uri
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user.partition(':')[0]}:***@{host}"))


def _said(error: BaseException) -> str:
    return (
        first_line(error.message if isinstance(error, MlflowException) else str(error))
        or type(error).__name__
    )


def _open_sqlite_store(setting: str, uri: str) -> str | None:
    """Open a SQLite store under a lock file beside it (`mlflow.db.lock`). MLflow creates and migrates a new
    store's tables on first use, unguarded: two jobs opening a new store at once (two `train` runs started
    together) both migrate it, fail with "table ... already exists", and leave it unusable. Under the lock the
    first opener creates the tables and the others find them; a store that exists costs one query a process.
    Returns why this user can only read the store, or None."""
    path = uri.removeprefix("sqlite:///").split("?", 1)[0]  # sqlite:////abs -> /abs, sqlite:///rel -> rel
    if not path or path == ":memory:":
        return None
    database = Path(path)
    if problem := _sqlite_path_problem(database):
        raise TrackingStoreError(f"{_named(setting, uri)}: {problem}")
    lock_file = Path(f"{path}.lock")
    try:
        # A missing directory is made, as MLflow itself does for a SQLite store (`mlflow server`, `mlflow ui`):
        # the path names where the store is to be, and the lock file needs the directory before MLflow does.
        database.parent.mkdir(parents=True, exist_ok=True)
        lock = lock_file.open("a")
    except OSError as error:
        if _holds_sqlite_header(database):
            # The lock only guards creating and migrating a new store's tables. A store that exists, in a
            # directory this user cannot write (a read-only share), is opened without it for the commands that
            # only read (loading a model); configure_tracking refuses it to those that write.
            _open_with_mlflow(setting, uri, list_one=True)
            return f"cannot create {error.filename or lock_file} ({error.strerror})"
        raise TrackingStoreError(
            f"{_named(setting, uri)}: cannot create {error.filename or lock_file} ({error.strerror}); point it at a "
            "directory this user can write"
        ) from error
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        _open_with_mlflow(setting, uri, list_one=True)
    return unwritable_file(database)  # a database file this user may only read, in a directory it may write


def _holds_sqlite_header(database: Path) -> bool:
    try:
        with database.open("rb") as file:
            return file.read(len(SQLITE_HEADER)) == SQLITE_HEADER
    except OSError:
        return False


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


def _open_file_store(setting: str, uri: str) -> None:
    # MLflow 3 keeps its file store (./mlruns) in maintenance mode and refuses it unless the user opts in.
    opted_in = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)
    if opted_in is not None and not opted_in.get():
        raise TrackingStoreError(
            f"{_named(setting, uri)}: a file store, which MLflow {mlflow.__version__} refuses unless "
            "MLFLOW_ALLOW_FILE_STORE=true; use a database store instead, e.g. sqlite:///mlflow.db (`mlflow "
            "migrate-filestore` copies an existing file store's runs into one)"
        )
    _open_with_mlflow(setting, uri, list_one=True)


def _open_with_mlflow(setting: str, uri: str, list_one: bool) -> None:
    """MLflow builds the store (an unknown scheme or a missing database driver fails here) and, with `list_one`,
    reads one experiment from it (a new SQLite store gets its tables). MLflow builds a registry store only when
    it is first asked something: it is always asked for one registered model."""
    try:
        if setting == REGISTRY:
            MlflowClient(registry_uri=uri).search_registered_models(max_results=1)
        elif list_one:
            MlflowClient(uri).search_experiments(max_results=1)
        else:
            MlflowClient(uri)
    except ImportError as error:
        raise TrackingStoreError(
            f"{_named(setting, uri)}: its database driver is not installed ({_said(error)}); install it, or "
            "use another store"
        ) from error
    except (MlflowException, SQLAlchemyError) as error:
        raise TrackingStoreError(
            f"{_named(setting, uri)}: MLflow cannot open this store: {_said(error)}. Point {setting} at an "
            "MLflow store (a sqlite:/// path, or a tracking server's http(s):// address)"
        ) from error


def _check_database_answers(setting: str, uri: str) -> None:
    """A database server's URI (postgresql://, mysql://, mssql://): its host takes a connection to its port within
    SERVER_ANSWER_SECONDS. Not there, MLflow would retry for about 100 s; the database itself is left to MLflow.
    A URI SQLAlchemy cannot read, or one with no host (a local socket), is left to MLflow too."""
    try:
        url = make_url(uri)
    except (ArgumentError, ValueError):
        return
    backend = url.get_backend_name()
    if backend not in DATABASE_PORTS or not url.host:
        return
    where = (url.host, url.port or DATABASE_PORTS[backend])
    try:
        _within(SERVER_ANSWER_SECONDS, socket.create_connection, where, SERVER_ANSWER_SECONDS).close()
    except OSError as error:  # refused, no such host, or no answer in time (TimeoutError)
        said = error.strerror or str(error)
        raise TrackingStoreError(
            f"the {backend} server at {where[0]}:{where[1]} ({_named(setting, uri)}) refused or did not answer "
            f"within {SERVER_ANSWER_SECONDS} s: {first_line(said)}. Check that it runs there and that {setting} "
            "names it",
            unavailable=True,
        ) from error


def _check_databricks_answers(setting: str, uri: str) -> None:
    """The Databricks workspace that `uri`'s credentials name (DATABRICKS_HOST and DATABRICKS_TOKEN, or a profile
    of ~/.databrickscfg), asked as a tracking server is. Finding the credentials is bounded too: the Databricks
    SDK asks the host for its settings first and retries a host that does not answer for five minutes."""
    seconds = _user_setting(environment_variables.MLFLOW_HTTP_REQUEST_TIMEOUT, SERVER_ANSWER_SECONDS)
    try:
        creds = _within(seconds, get_databricks_host_creds, uri)
    except MlflowException as error:
        raise TrackingStoreError(
            f"{_named(setting, uri)}: MLflow found no Databricks credentials for it; set DATABRICKS_HOST and "
            "DATABRICKS_TOKEN, or log in with `databricks auth login` and name the profile it makes as "
            "databricks://PROFILE"
        ) from error
    except TimeoutError as error:
        raise TrackingStoreError(
            f"{_named(setting, uri)}: the Databricks host its credentials name did not answer within {seconds} s; check "
            "DATABRICKS_HOST (or the profile's host) and that this machine reaches it",
            unavailable=True,
        ) from error
    workspace = f"the Databricks workspace at {creds.host} ({_named(setting, uri)})"
    _check_server_answers(workspace, setting, creds, DATABRICKS_CREDENTIALS)


def _within(seconds: float, call: Callable[..., T], *args: Any) -> T:
    """`call(*args)`, or TimeoutError once `seconds` have passed. The call runs in a daemon thread, left behind
    when it overruns: the command ends with the error, and nothing waits for the thread."""
    outcome: queue.Queue = queue.Queue(maxsize=1)

    def run() -> None:
        try:
            outcome.put((call(*args), None))
        except Exception as error:  # raised again below, in the caller's thread
            outcome.put((None, error))

    threading.Thread(target=run, name=f"txsentinel-{call.__name__}", daemon=True).start()
    try:
        result, error = outcome.get(timeout=seconds)
    except queue.Empty:
        raise TimeoutError(f"no answer within {seconds} s") from None
    if error is not None:
        raise error
    return result


def _check_server_answers(server: str, setting: str, creds: MlflowHostCreds, credentials: str) -> None:
    """One search for an experiment, with the credentials and TLS settings MLflow's own requests use. `server`
    names it in a refusal, `setting` the variable that points at it, `credentials` the settings that hold what
    it may ask for."""
    timeout = _user_setting(environment_variables.MLFLOW_HTTP_REQUEST_TIMEOUT, SERVER_ANSWER_SECONDS)
    retries = _user_setting(environment_variables.MLFLOW_HTTP_REQUEST_MAX_RETRIES, None)
    try:
        response = _search_one_experiment(creds, timeout, retries)
    except (MlflowException, OSError) as error:  # OSError: a time limit the Databricks SDK keeps itself
        raise TrackingStoreError(
            f"{server} refused or did not answer within {timeout} s: {_said(error)}. Check that it runs there "
            f"and that {setting} names it",
            unavailable=True,
        ) from error
    try:
        verify_rest_response(response, SEARCH_ONE_EXPERIMENT)
    except MlflowException as error:
        said = f"HTTP {response.status_code}: {_said(error)}"
        if response.status_code in (401, 403):  # a setting the operator can fix, not a server that is down
            raise TrackingStoreError(
                f"{server} refused this client ({said}); set {credentials} to credentials it accepts"
            ) from error
        raise TrackingStoreError(
            f"{server} answered {said}. Check that it runs there and that {setting} names it",
            unavailable=True,
        ) from error


def _search_one_experiment(creds: MlflowHostCreds, timeout: int, retries: int | None) -> requests.Response:
    """The server's answer to a search for one experiment. With `retries` (MLFLOW_HTTP_REQUEST_MAX_RETRIES set),
    MLflow retries as it does every request; without, a busy answer is asked again after each of
    BUSY_RETRY_WAITS_SECONDS and a server that does not answer is not."""
    ask = functools.partial(
        http_request,
        creds,
        SEARCH_ONE_EXPERIMENT,
        "POST",
        json={"max_results": 1},
        max_retries=retries or 0,
        timeout=timeout,
        retry_timeout_seconds=timeout if retries is None else None,  # the Databricks SDK's own retries
        raise_on_status=False,  # a busy answer that outlasts MLflow's retries is returned, to be named
    )
    response = ask()
    for wait in BUSY_RETRY_WAITS_SECONDS if retries is None else ():
        if response.status_code not in BUSY_STATUS:
            break
        time.sleep(wait)
        response = ask()
    return response


def _user_setting(variable: Any, default: int | None) -> int | None:
    """The value of MLflow's environment `variable` where the user set it, else `default`."""
    if not variable.is_set():
        return default
    try:
        return variable.get()
    except ValueError:
        raise TrackingStoreError(
            f"{variable.name}={variable.get_raw()!r}: expected a whole number; set it to one, or unset it"
        ) from None
