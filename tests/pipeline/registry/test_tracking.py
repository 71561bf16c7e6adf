"""The tracking store as several jobs meet it: opened by processes that start together; names and servers it
refuses."""

import http.server
import subprocess
import sys
import threading
import time

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from models.registry import build_detector
from pipeline.cli.main import main
from pipeline.features import FEATURE_NAMES
from pipeline.features.spec import FeatureSpec
from pipeline.registry.artifact import save_model_dir
from pipeline.registry.names import registered_name_problem
from pipeline.registry.tracking import load_model
from pipeline.registry.tracking_store import TrackingStoreError, configure_tracking

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


def test_promoting_what_the_store_does_not_hold_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    # A real SQLite store holding one registered version, promoted by the CLI as an operator would.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    configure_tracking()
    client = MlflowClient()
    with mlflow.start_run() as run:
        mlflow.log_metric("test/ap", 0.5)
    client.create_registered_model("held")
    client.create_model_version("held", f"runs:/{run.info.run_id}/model", run.info.run_id)

    def refusal(*argv: str) -> str:
        assert main(["promote", "--alias", "champion", *argv]) == 2
        return capsys.readouterr().err

    assert "model 'held' has no version 7; its versions: [1]" in refusal(
        "--model-name", "held", "--version", "7"
    )
    assert "run 'f00' registered no version of model 'held'" in refusal(
        "--model-name", "held", "--run", "f00"
    )
    assert "no registered model 'other' in sqlite:///" in refusal("--model-name", "other", "--version", "1")
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

    assert main(["promote", "--alias", "champion", "--model-name", "held", "--run", run.info.run_id]) == 0
    assert int(client.get_model_version_by_alias("held", "champion").version) == 1


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


@pytest.mark.parametrize(
    "name", ["bad/name", "a:b", "..", ".", "./x", "x/../y", "ok", "with space", "v2-champion", "ünïcode"]
)
def test_the_names_refused_up_front_are_those_the_registry_refuses(name, tmp_path):
    # The check is MLflow's own (a private function): held here to what a real store does with the name.
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        client.create_registered_model(name)
        registry_refuses = False
    except mlflow.exceptions.MlflowException:
        registry_refuses = True
    assert (registered_name_problem(name) is not None) == registry_refuses


class Answers(http.server.BaseHTTPRequestHandler):
    """A tracking server's stand-in: answers the search for experiments with `status`."""

    status = 200

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"experiments": []}' if self.status == 200 else b'{"error_code": "PERMISSION_DENIED"}'
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
        httpd.shutdown()


def test_a_tracking_server_that_answers_is_used_and_one_that_refuses_is_named(server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    started = time.monotonic()
    assert configure_tracking() == server
    assert time.monotonic() - started < 5  # one request, answered at once
    monkeypatch.setattr(Answers, "status", 403)
    refused = f"{server}/"  # another URI for the same server: the first answer was kept for the first
    monkeypatch.setenv("MLFLOW_TRACKING_URI", refused)
    with pytest.raises(TrackingStoreError) as error:
        configure_tracking()
    assert str(error.value).startswith(
        f"the MLflow tracking server at {refused} (MLFLOW_TRACKING_URI) refused"
    )
    assert "PERMISSION_DENIED" in str(error.value) and error.value.unavailable
