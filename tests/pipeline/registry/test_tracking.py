"""The tracking store and the model registry as several jobs meet them: opened by processes that start together;
a registry kept apart from the runs; names and servers they refuse."""

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from typing import ClassVar

import mlflow
import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from models.registry import build_detector
from pipeline.cli.errors import OperatorError, model_errors
from pipeline.cli.main import main
from pipeline.features import FEATURE_NAMES
from pipeline.features.spec import FeatureSpec
from pipeline.registry import tracking_store
from pipeline.registry.artifact import save_model_dir
from pipeline.registry.names import experiment_name_problem, registered_name_problem
from pipeline.registry.tracking import load_model
from pipeline.registry.tracking_store import (
    REGISTRY,
    TRACKING,
    TrackingStoreError,
    configure_registry,
    configure_tracking,
)
from tests.pipeline.workspaces import run_read_only

OPEN_STORE = """
from pipeline.registry.tracking import configure_tracking
configure_tracking()
import mlflow
mlflow.set_experiment("opened-together")
"""


def test_jobs_that_open_a_new_sqlite_store_together_all_succeed_and_leave_it_usable(tmp_path):
    # Unguarded, MLflow's first-use migration races: every process failed and the store stayed broken.
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PATH": "/usr/bin:/bin"}
    jobs = [
        subprocess.Popen([sys.executable, "-c", OPEN_STORE], env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    failures = [err for job in jobs if (err := job.communicate(timeout=300)[1]) and job.returncode != 0]
    assert not failures, failures[0][-2000:]
    names = [e.name for e in MlflowClient(env["MLFLOW_TRACKING_URI"]).search_experiments()]
    assert sorted(names) == ["Default", "opened-together"]  # the store opens afterwards, each created once


def store_holding_one_version(directory, monkeypatch) -> tuple[MlflowClient, str]:
    """A real SQLite store in `directory`, made the tracking store, holding version 1 of model "held" (in the
    registry MLFLOW_REGISTRY_URI names, where set): its client, and the run the version came from."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{directory / 'mlflow.db'}")
    configure_registry()  # and the tracking store
    client = MlflowClient()
    with mlflow.start_run() as run:
        mlflow.log_metric("test/ap", 0.5)
    client.create_registered_model("held")
    client.create_model_version("held", f"runs:/{run.info.run_id}/model", run.info.run_id)
    return client, run.info.run_id


def test_promoting_what_the_store_does_not_hold_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    # A real SQLite store holding one registered version, promoted by the CLI as an operator would.
    client, run_id = store_holding_one_version(tmp_path, monkeypatch)

    def refusal(*argv: str) -> str:
        assert main(["promote", "--alias", "champion", *argv]) == 2
        return capsys.readouterr().err

    assert "model 'held' has no version 7; its versions: [1]" in refusal(
        "--model-name", "held", "--version", "7"
    )
    assert "run 'f00' registered no version of model 'held'" in refusal(
        "--model-name", "held", "--run", "f00"
    )
    assert "no registered model 'other' in the MLflow tracking store sqlite:///" in refusal(
        "--model-name", "other", "--version", "1"
    )
    assert "holds no quote" in refusal("--model-name", "x' or name='held", "--version", "1")
    for alias, complaint in (
        ("bad/alias", "letters, digits, '_' or '-'"),
        ("latest", "reserved"),
        ("v3", "reserved"),
    ):
        assert main(["promote", "--alias", alias, "--model-name", "held", "--version", "1"]) == 2
        err = capsys.readouterr().err
        assert f"--alias {alias!r}: " in err and complaint in err and "Traceback" not in err
    with pytest.raises(mlflow.exceptions.MlflowException):  # no alias was set by any refusal
        client.get_model_version_by_alias("held", "champion")

    assert main(["promote", "--alias", "champion", "--model-name", "held", "--run", run_id]) == 0
    assert int(client.get_model_version_by_alias("held", "champion").version) == 1


READ_THEN_WRITE = """
import os
from pipeline.registry.tracking import registered_version
from pipeline.registry.tracking_store import TrackingStoreError, configure_registry
print(registered_version("models:/held@champion"))
setting = "MLFLOW_REGISTRY_URI" if "MLFLOW_REGISTRY_URI" in os.environ else "MLFLOW_TRACKING_URI"
for uri in (os.environ[setting], os.environ[setting].replace("mlflow.db", "new.db")):
    os.environ[setting] = uri
    try:
        configure_registry()  # as promote and train do
    except TrackingStoreError as error:
        print(error)
"""


@pytest.mark.parametrize("setting", [TRACKING, REGISTRY])
def test_a_sqlite_store_this_user_can_only_read_serves_models_but_takes_no_writes(
    setting, tmp_path, monkeypatch
):
    # The lock file beside the store could not be made: the store was refused to commands that only read it.
    # A registry kept apart (MLFLOW_REGISTRY_URI) was not opened up front at all.
    store = tmp_path / "store"
    if setting == REGISTRY:
        monkeypatch.setenv(REGISTRY, f"sqlite:///{store / 'mlflow.db'}")
    client, _ = store_holding_one_version(store if setting == TRACKING else tmp_path / "runs", monkeypatch)
    client.set_registered_model_alias("held", "champion", "1")
    (store / "mlflow.db.lock").unlink()  # the lock file of whoever made the store is not there to reuse
    done = run_read_only(store, READ_THEN_WRITE)
    assert done.returncode == 0, done.stderr[-2000:]
    found, writes, new = done.stdout.strip().splitlines()
    assert found == "('held', '1')"
    assert writes.startswith(f"{setting}=sqlite:///{store}/mlflow.db: cannot create {store}/mlflow.db.lock (")
    assert writes.endswith(
        f"and this command writes to the store; point {setting} at a store this user can write"
    )
    assert f"cannot create {store}/new.db.lock (" in new and new.endswith("directory this user can write")


@pytest.mark.parametrize("apart", [False, True], ids=["registry in the tracking store", "registry apart"])
def test_promote_moves_the_alias_in_the_registry_and_a_model_it_lacks_is_named_in_one_sentence(
    apart, tmp_path, monkeypatch, capsys
):
    # A model that did not resolve was said to be missing from the tracking store, whichever store was asked,
    # and MLflow's closing period was followed by the message's own: "not found.. Check".
    tracking, registry = (f"sqlite:///{tmp_path / kind / 'mlflow.db'}" for kind in ("runs", "models"))
    if apart:
        monkeypatch.setenv(REGISTRY, registry)
    _, run_id = store_holding_one_version(tmp_path / "runs", monkeypatch)
    assert main(["serve", "--model", "models:/held@nope"]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    store, setting = (
        (f"model registry {registry}", REGISTRY) if apart else (f"tracking store {tracking}", TRACKING)
    )
    assert line == (
        f"txsentinel serve: model 'models:/held@nope' did not resolve in the MLflow {store}: Registered model "
        "alias nope not found. Check the name and version or alias (`mlflow ui` lists them), or point "
        f"{setting} at the store the model was registered in"
    )
    assert main(["promote", "--alias", "champion", "--model-name", "held", "--run", run_id]) == 0
    held = MlflowClient(registry_uri=registry if apart else tracking)
    assert int(held.get_model_version_by_alias("held", "champion").version) == 1
    if apart:  # the runs' store holds no registered model
        assert MlflowClient(registry_uri=tracking).search_registered_models() == []


@pytest.mark.parametrize("model", ["models:/held@champion", "runs:/abc/model"])
def test_a_store_that_a_model_did_not_resolve_in_is_named_without_its_password(model, monkeypatch):
    # The URI of the store asked was printed whole, the database's password with it.
    tracking, registry = "postgresql://ann:hunter2@db1/runs", "postgresql://bob:s3cret@db2/reg"
    monkeypatch.setenv(TRACKING, tracking)
    monkeypatch.setenv(REGISTRY, registry)
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracking)  # as configure_tracking leaves it; nothing is opened
    try:
        with pytest.raises(OperatorError) as refused, model_errors(model):
            raise MlflowException("not found")
    finally:
        mlflow.set_tracking_uri(before)
    message = str(refused.value)
    assert "hunter2" not in message and "s3cret" not in message
    named = "model registry postgresql://bob:***@db2/reg" if model.startswith("models:/") else "ann:***@db1"
    assert named in message


# Every command that uses the registry, each refused before it reads any data.
REGISTRY_USERS = {
    "train": ["train", "--data", "{never}", "--model", "lstm"],  # registers the model it trains
    "promote": ["promote", "--alias", "champion", "--model-name", "held", "--version", "1"],
    "serve": ["serve", "--model", "models:/held@champion"],
    "backtest": ["backtest", "--data", "{never}", "--model", "models:/held/1", "--no-mlflow"],
}


@pytest.mark.parametrize("command", REGISTRY_USERS)
def test_a_registry_that_cannot_be_used_is_named_in_one_line_by_every_command_that_uses_it(
    command, unused_port, tmp_path, monkeypatch, capsys
):
    # MLFLOW_REGISTRY_URI was left to MLflow: a traceback, a "File exists", or minutes of retries.
    monkeypatch.setenv(TRACKING, f"sqlite:///{tmp_path / 'mlflow.db'}")  # a tracking store that works
    (tmp_path / "afile").write_text("keep me")
    server = f"http://127.0.0.1:{unused_port}"
    for registry, refusal, exit_code in (
        (
            f"sqlite:///{tmp_path}/afile/mlflow.db",
            f"{REGISTRY}=sqlite:///{tmp_path}/afile/mlflow.db: {tmp_path}/afile is a file, so no store can be under it",
            2,
        ),
        ("nosuch://registry", f"{REGISTRY}=nosuch://registry: MLflow cannot open this store: ", 2),
        (
            server,
            f"the MLflow model registry server at {server} ({REGISTRY}) refused or did not answer within 10 s",
            1,
        ),
    ):
        monkeypatch.setenv(REGISTRY, registry)
        argv = [arg.format(never=tmp_path / "never-read") for arg in REGISTRY_USERS[command]]
        started = time.monotonic()
        assert main(argv) == exit_code
        assert time.monotonic() - started < 30
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith(f"txsentinel {command}: {refusal}")
    assert (tmp_path / "afile").read_text() == "keep me"


def test_a_directory_is_loaded_only_when_it_holds_exactly_one_model(tmp_path):
    spec = FeatureSpec(mean=(0.0,) * len(FEATURE_NAMES), std=(1.0,) * len(FEATURE_NAMES))
    detector = build_detector("lstm", {"num_features": len(FEATURE_NAMES), "d_model": 8, "num_layers": 1})
    save_model_dir(tmp_path / "runs" / "a" / "model", detector, spec, {})
    assert load_model(str(tmp_path / "runs")).detector.name == "lstm"  # one, however deep: that one
    save_model_dir(tmp_path / "runs" / "b" / "model", detector, spec, {})
    with pytest.raises(
        ValueError, match=r"holds 2 txsentinel models \(.*a/model, .*b/model, \.\.\.\), not one"
    ):
        load_model(str(tmp_path / "runs"))  # the first found used to be taken
    assert load_model(str(tmp_path / "runs" / "b" / "model")).detector.name == "lstm"
    with pytest.raises(ValueError, match="an empty model URI"):
        load_model("")  # Path("") is the working directory


NAMES = [
    "bad/name",
    "a:b",
    "..",
    ".",
    "./x",
    "x/../y",
    "x/",
    "ok",
    "with space",
    "v2-champion",
    "ünïcode",
    " ",
]


EXPERIMENT_NAMES = ["", " ", "x" * 500, "x" * 501, "a/b:c", "ünïcode"]
# kind -> (how a store is asked to make one, MLflow's private check of its name, the project's check)
NAME_KINDS = {
    "registered model": (
        MlflowClient.create_registered_model,
        "_validate_model_name",
        registered_name_problem,
    ),
    "experiment": (MlflowClient.create_experiment, "_validate_experiment_name", experiment_name_problem),
}


NAME_CASES = [("registered model", name) for name in NAMES] + [
    ("experiment", name) for name in EXPERIMENT_NAMES
]


@pytest.fixture(scope="module")
def store_refuses(tmp_path_factory) -> dict[tuple[str, str], bool]:
    """{(kind, name): whether a real store refuses to make one so named}, asked of one store once."""
    client = MlflowClient(f"sqlite:///{tmp_path_factory.mktemp('names') / 'mlflow.db'}")
    refuses = {}
    for kind, name in NAME_CASES:
        try:
            NAME_KINDS[kind][0](client, name)
            refuses[kind, name] = False
        except mlflow.exceptions.MlflowException:
            refuses[kind, name] = True
    return refuses


@pytest.mark.parametrize("mlflow_check", [True, False], ids=["mlflow's check", "renamed: the rules"])
@pytest.mark.parametrize(("kind", "name"), NAME_CASES, ids=lambda value: value[:12])
def test_the_names_refused_up_front_are_those_a_real_store_refuses(
    kind, name, mlflow_check, store_refuses, monkeypatch
):
    # The check is MLflow's own (a private function), or where MLflow renamed it, the rules MLflow documents:
    # either is held here to what a real store does with the name.
    _, private_check, problem = NAME_KINDS[kind]
    if not mlflow_check:  # after the store was asked: MLflow's own store imports it
        monkeypatch.delattr(mlflow.utils.validation, private_check)
    assert (problem(name) is not None) == store_refuses[kind, name]


RENAMED_CHECKS = """
import mlflow.utils.validation
del mlflow.utils.validation._validate_model_name, mlflow.utils.validation._validate_experiment_name
import pipeline.registry.tracking  # what the service imports
from pipeline.registry.names import experiment_name_problem, registered_name_problem
print(registered_name_problem("bad/name"))
print(experiment_name_problem("x" * 501))
"""


def test_an_mlflow_that_renamed_its_name_checks_breaks_no_import_and_its_rules_still_apply():
    # MLflow's checks are private: imported at the top, a rename would have broken the service's import.
    done = subprocess.run([sys.executable, "-c", RENAMED_CHECKS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "Invalid model name 'bad/name'. Names cannot contain '/' or ':'",
        "'name' exceeds the maximum length of 500",
    ]


class Answers(http.server.BaseHTTPRequestHandler):
    """A tracking server's stand-in: answers each search for experiments with the next of `statuses` (200 once
    they run out), `delay_seconds` late, and counts the requests in `asked`."""

    statuses: ClassVar[list[int]] = []
    delay_seconds = 0.0
    asked: ClassVar[list[str]] = []

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.asked.append(self.path)
        time.sleep(self.delay_seconds)
        status = self.statuses.pop(0) if self.statuses else 200
        body = b'{"experiments": []}' if status == 200 else b'{"error_code": "PERMISSION_DENIED"}'
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except ConnectionError:
            pass  # a client that stopped waiting

    def do_GET(self):  # what the Databricks SDK asks a workspace for before it sends a request
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(Answers, "statuses", [])
    monkeypatch.setattr(Answers, "asked", [])
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
        httpd.shutdown()


@pytest.fixture
def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed on return: nothing listens there


def open_server_store(monkeypatch, uri: str, *statuses: int) -> TrackingStoreError | None:
    """Opens `uri` (each a store of its own: the store is opened once a process) with the server answering
    `statuses` first; the refusal, or None."""
    monkeypatch.setattr(Answers, "statuses", list(statuses))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    try:
        configure_tracking()
    except TrackingStoreError as error:
        return error
    return None


def test_a_tracking_server_that_answers_is_used_and_one_that_refuses_is_named(server, monkeypatch):
    started = time.monotonic()
    assert open_server_store(monkeypatch, server) is None
    assert time.monotonic() - started < 5  # one request, answered at once
    refused = open_server_store(monkeypatch, f"{server}/refuses", 404)
    assert str(refused).startswith(
        f"the MLflow tracking server at {server}/refuses (MLFLOW_TRACKING_URI) answered"
    )
    assert "HTTP 404: PERMISSION_DENIED" in str(refused) and refused.unavailable


def test_a_busy_tracking_server_is_asked_again_and_refused_credentials_are_a_setting(
    server, monkeypatch, capsys
):
    # One 429 or 503 failed the command; a 401 or 403 was reported as a server that is down (exit 1).
    monkeypatch.setattr(tracking_store, "BUSY_RETRY_WAITS_SECONDS", (0.1, 0.1))
    assert open_server_store(monkeypatch, f"{server}/busy", 503, 429) is None
    assert Answers.asked == ["/busy/api/2.0/mlflow/experiments/search"] * 3
    down = open_server_store(monkeypatch, f"{server}/down", 503, 503, 503)
    assert "answered HTTP 503: " in str(down) and down.unavailable and len(Answers.asked) == 6
    for status in (401, 403):
        uri = f"{server}/{status}"
        monkeypatch.setattr(Answers, "statuses", [status])
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        assert main(["promote", "--version", "1"]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert (
            f"the MLflow tracking server at {uri} (MLFLOW_TRACKING_URI) refused this client (HTTP {status}: "
            in line
        )
        assert (
            "set MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, to " in line
        )


def test_the_users_own_http_timeout_and_retries_are_kept(server, monkeypatch):
    # MLFLOW_HTTP_REQUEST_TIMEOUT and MLFLOW_HTTP_REQUEST_MAX_RETRIES were overridden by a fixed 10 s, no retries.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    assert "answered HTTP 503" in str(open_server_store(monkeypatch, f"{server}/once", 503))
    assert len(Answers.asked) == 1  # the user asked for no retries
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "4")
    assert open_server_store(monkeypatch, f"{server}/four", 503, 503, 503, 503) is None
    assert len(Answers.asked) == 6  # four retries, MLflow's own
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    monkeypatch.setattr(Answers, "delay_seconds", 3)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    started = time.monotonic()
    slow = open_server_store(monkeypatch, f"{server}/slow")
    assert time.monotonic() - started < 2.5 and "did not answer within 1 s: " in str(slow)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "soon")
    bad = open_server_store(monkeypatch, f"{server}/bad")
    assert (
        str(bad) == "MLFLOW_HTTP_REQUEST_TIMEOUT='soon': expected a whole number; set it to one, or unset it"
    )
    assert not bad.unavailable


def test_a_databricks_store_is_asked_at_its_workspace_not_taken_for_a_file_store(
    server, unused_port, tmp_path, monkeypatch, capsys
):
    # urlparse("databricks").scheme is "": the standard value was refused as a file store.
    for name in [name for name in os.environ if name.startswith("DATABRICKS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.databrickscfg
    profiles = tmp_path / "databrickscfg"
    profiles.write_text(
        f"[answers]\nhost = {server}\ntoken = dapi-test\n\n[refuses]\nhost = {server}\ntoken = dapi-old\n\n"
        f"[gone]\nhost = http://127.0.0.1:{unused_port}\ntoken = dapi-test\n"
    )
    monkeypatch.setenv("DATABRICKS_CONFIG_FILE", str(profiles))
    nothing = open_server_store(monkeypatch, "databricks")
    assert str(nothing).startswith("MLFLOW_TRACKING_URI=databricks: MLflow found no Databricks credentials")
    assert "file store" not in str(nothing) and not nothing.unavailable

    assert open_server_store(monkeypatch, "databricks://answers") is None
    assert Answers.asked == ["/api/2.0/mlflow/experiments/search"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "databricks://refuses")
    monkeypatch.setattr(Answers, "statuses", [403])
    assert main(["promote", "--version", "1"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"the Databricks workspace at {server} (MLFLOW_TRACKING_URI=databricks://refuses) refused" in line
    assert "set DATABRICKS_TOKEN (or the profile's token) to credentials it accepts" in line

    # The Databricks SDK retries a host that does not answer for five minutes before MLflow sees credentials.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    started = time.monotonic()
    gone = open_server_store(monkeypatch, "databricks://gone")
    assert time.monotonic() - started < 10
    assert (
        "the Databricks host its credentials name did not answer within 2 s" in str(gone) and gone.unavailable
    )
