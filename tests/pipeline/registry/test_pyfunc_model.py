"""The MLflow model: raw transactions in, the backtest's scores out, with its code, signature and example.

Tiny untrained detectors on a small generated dataset: the parity of two scoring paths needs no good model.
One model is logged to a real SQLite tracking store and shared by the MLflow tests. `mlflow models serve
--env-manager local` runs uvicorn over MLflow's scoring app; the serving test runs that same app in this
process (starting the command costs a minute of imports on a busy machine; docs/operations.md shows it).
"""

import json
import socket
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta

import mlflow
import numpy as np
import pandas as pd
import polars as pl
import pytest
import torch
import uvicorn
from mlflow.pyfunc import scoring_server

from consumers.scoring.scorer import Scorer
from models.registry import REGISTRY, build_detector
from pipeline.data.splits import Period, dataset_days
from pipeline.evaluation.backtest import BacktestConfig, backtest
from pipeline.features import compute_features, fit_feature_spec
from pipeline.registry.artifact import LoadedModel, save_model_dir
from pipeline.registry.pyfunc_model import (
    INPUT_COLUMNS,
    input_example,
    log_and_register,
    score_transactions,
)
from pipeline.registry.tracking import configure_tracking, load_model
from tests.pipeline.workspaces import busy_dataset, use_fresh_store

REGISTERED = "txsentinel-pyfunc-test"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("pyfunc")
    # Fraud well above the defaults, so labels reach the terminal-risk features within a few weeks.
    rates = {"compromised_accounts_per_day": 20.0, "card_testing_accounts_per_day": 10.0}
    rates |= {"compromised_terminals_per_day": 8.0, "takeover_accounts_per_day": 0.5}  # 0.5: the default
    frame = busy_dataset(root / "data", accounts=50, days=18, seed=5, **rates)
    start = frame["ts"].min()
    spec = fit_feature_spec(compute_features(frame), start, start + timedelta(days=10))
    return root, frame, spec


def tiny_detector(name: str, spec):
    torch.manual_seed(0)
    config = REGISTRY[name][0].tiny(num_features=spec.num_features, terminal_buckets=spec.terminal_buckets)
    return build_detector(name, config).eval()


def naive_utc(frame: pl.DataFrame) -> pd.DataFrame:
    """The frame as a user hands it to MLflow: pandas, UTC times without a zone (MLflow's datetime type)."""
    return frame.with_columns(pl.col("ts", "label_ts").dt.replace_time_zone(None)).to_pandas()


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_scores_equal_the_live_scorers_replay_for_every_detector(dataset, name):
    _, frame, spec = dataset
    model = LoadedModel(tiny_detector(name, spec), spec, {"threshold": 0.55})
    replayed = Scorer(model).replay(frame, batch_events=97)
    # Rows shuffled; chunks shorter than the transformer's window and groups of a few accounts, so states
    # carry across chunk boundaries and accounts of different lengths share a forward call.
    shuffled = frame.sample(fraction=1.0, shuffle=True, seed=1)
    scored = score_transactions(model, shuffled, group_accounts=7, chunk_events=5)
    assert scored["event_id"].to_list() == shuffled["event_id"].to_list()  # the input's row order
    joined = scored.join(replayed, on="event_id", suffix="_replay")
    assert joined.height == frame.height
    np.testing.assert_allclose(joined["logit"].to_numpy(), joined["logit_replay"].to_numpy(), atol=1e-5)
    np.testing.assert_allclose(joined["score"].to_numpy(), joined["score_replay"].to_numpy(), atol=1e-6)
    assert (joined["alert"] == (joined["score"] >= 0.55)).all()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (pl.when(pl.int_range(pl.len()) == 5).then(-3.0).otherwise("amount").alias("amount"),
         "row 5 .*amount = -3.0: negative amount; expected a finite amount in 0..1e\\+15"),
        (pl.when(pl.int_range(pl.len()) == 7).then(2e15).otherwise("amount").alias("amount"),
         "row 7 .*amount = 2000000000000000.0: amount too large; expected a finite amount in 0..1e\\+15"),
        (pl.when(pl.int_range(pl.len()) == 3).then(None).otherwise(pl.col("ts")).alias("ts"), "row 3 .*ts = None"),
        (pl.when(pl.int_range(pl.len()) == 9).then(pl.lit("E000000000")).otherwise("event_id").alias("event_id"),
         "event_id = 'E000000000': repeated"),
        # What the service's decoder refuses is refused here too: a row it would dead-letter scores nothing.
        (pl.when(pl.int_range(pl.len()) == 4).then(pl.datetime(1960, 1, 1, time_zone="UTC")).otherwise("ts").alias("ts"),
         "row 4 .*ts = .*1960.*timestamp out of range"),
        (pl.when(pl.int_range(pl.len()) == 6).then(pl.lit("")).otherwise("account_id").alias("account_id"),
         "row 6 .*account_id = '': empty id"),
        (pl.when(pl.int_range(pl.len()) == 2).then(pl.lit("A\x00")).otherwise("terminal_id").alias("terminal_id"),
         "row 2 .*terminal_id = 'A\\\\x00': id the service refuses"),
    ],
)  # fmt: skip
def test_bad_transactions_name_the_row_the_column_and_the_value(dataset, change, message):
    _, frame, spec = dataset
    model = LoadedModel(tiny_detector("lstm", spec), spec)
    with pytest.raises(ValueError, match=message):
        score_transactions(model, frame.with_columns(change))
    with pytest.raises(ValueError, match=r"lack column\(s\) \['terminal_id'\]"):
        score_transactions(model, frame.drop("terminal_id"))


@pytest.fixture(scope="module")
def logged(dataset, tmp_path_factory):
    """The LSTM logged and registered through the training code's call, in a fresh SQLite store."""
    root, frame, spec = dataset
    store = tmp_path_factory.mktemp("store")
    with pytest.MonkeyPatch.context() as env:
        use_fresh_store(env, store)
        save_model_dir(root / "model", tiny_detector("lstm", spec), spec, {"threshold": 0.55})
        with mlflow.start_run():
            uri, version = log_and_register(root / "model", REGISTERED)
        yield root, frame, f"models:/{REGISTERED}/{version}", uri
    configure_tracking()


@pytest.mark.slow
def test_the_mlflow_model_predicts_the_backtests_scores(logged):
    root, frame, registered, _ = logged
    span = dataset_days(frame)
    result = backtest(
        BacktestConfig(
            data=root / "data",
            model_uri=registered,
            test_period=Period(span.end - timedelta(days=5), span.end),
            log_to_mlflow=False,
            progress_bar=False,
        )
    )
    assert result.scored.height == frame.height  # the replay covered every event: all are compared

    pyfunc = mlflow.pyfunc.load_model(registered)
    predicted = pl.from_pandas(pyfunc.predict(naive_utc(frame.reverse())))
    assert predicted.columns == ["event_id", "score", "logit", "alert"]
    assert predicted["event_id"].to_list() == frame.reverse()["event_id"].to_list()
    joined = predicted.join(result.scored, on="event_id", suffix="_backtest")
    np.testing.assert_allclose(joined["score"].to_numpy(), joined["score_backtest"].to_numpy(), atol=1e-6)
    clear = (joined["score"] - 0.55).abs() > 1e-6  # scores within float error of the threshold may differ
    assert (joined["alert"] == joined["alert_backtest"]).filter(clear).all()

    # The service's loader reads the same logged model.
    served = load_model(registered)
    assert served.meta["threshold"] == 0.55 and served.detector.name == "lstm"


def test_the_logged_model_declares_its_signature_example_and_requirements(logged):
    _, _, registered, _ = logged
    info = mlflow.models.get_model_info(registered)
    assert [c.name for c in info.signature.inputs.inputs] == list(INPUT_COLUMNS)
    required = {c.name for c in info.signature.inputs.inputs if c.required}
    assert required == {"event_id", "account_id", "ts", "amount", "terminal_id"}
    assert [c.name for c in info.signature.outputs.inputs] == ["event_id", "score", "logit", "alert"]
    example = mlflow.models.Model.load(registered).load_input_example(
        mlflow.artifacts.download_artifacts(registered)
    )
    pd.testing.assert_frame_equal(example, input_example(), check_dtype=False)

    local = mlflow.artifacts.download_artifacts(registered)
    with open(f"{local}/requirements.txt") as lines:
        requirements = lines.read().split()
    names = {r.split("==")[0] for r in requirements}
    assert {"torch", "polars", "numba", "pandas", "mlflow"} <= names
    assert all("==" in r and "+" not in r for r in requirements)  # releases an index serves, no local builds


@pytest.mark.slow
def test_the_model_loads_and_predicts_where_txsentinel_is_not_installed(logged, tmp_path):
    _, frame, registered, _ = logged
    local = mlflow.artifacts.download_artifacts(registered, dst_path=str(tmp_path / "model"))
    rows = naive_utc(frame.head(300))
    rows.to_parquet(tmp_path / "rows.parquet")
    # -S: no site initialisation, so the editable txsentinel install's import hook is not there either;
    # only the third-party packages are put back on the path.
    script = textwrap.dedent(
        f"""
        import importlib.util, json, sys
        sys.path.append({sysconfig.get_paths()["purelib"]!r})
        assert all(importlib.util.find_spec(m) is None for m in ("models", "pipeline", "consumers"))
        import mlflow, pandas as pd
        model = mlflow.pyfunc.load_model({local!r})
        out = model.predict(pd.read_parquet({str(tmp_path / "rows.parquet")!r}))
        print(json.dumps({{"scores": out["score"].tolist(), "code": sys.modules["pipeline"].__file__}}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", script],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "MLFLOW_DISABLE_TELEMETRY": "true", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["code"].startswith(local)  # the model's own copy of the code
    expected = mlflow.pyfunc.load_model(registered).predict(rows)["score"].to_numpy()
    np.testing.assert_allclose(out["scores"], expected, atol=1e-12)


@pytest.fixture
def scoring_app(logged):
    """MLflow's scoring app (what `mlflow models serve` runs) over the logged model, on a free local port."""
    _, _, registered, _ = logged
    app = scoring_server.init(scoring_server.load_model_with_mlflow_config(registered))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the scoring app did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    sock.close()


def invoke(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{url}/invocations", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_scoring_server_scores_a_batch_as_predict_does(logged, scoring_app):
    _, frame, registered, _ = logged
    local = mlflow.artifacts.download_artifacts(registered)
    with open(f"{local}/serving_input_example.json") as example:
        status, body = invoke(scoring_app, json.load(example))
    assert status == 200 and [p["event_id"] for p in body["predictions"]] == ["e-1", "e-2", "e-3", "e-4"]

    # A batch as a client sends it: ISO-8601 UTC times, labels included.
    rows = frame.head(400).select(c for c in INPUT_COLUMNS if c in frame.columns)
    iso = rows.with_columns(pl.col("ts", "label_ts").dt.strftime("%Y-%m-%dT%H:%M:%S%.6f"))
    status, body = invoke(scoring_app, {"dataframe_split": {"columns": iso.columns, "data": iso.rows()}})
    assert status == 200, body
    served = pl.DataFrame(body["predictions"])
    expected = pl.from_pandas(mlflow.pyfunc.load_model(registered).predict(naive_utc(rows)))
    assert served["event_id"].to_list() == expected["event_id"].to_list()
    np.testing.assert_allclose(served["score"].to_numpy(), expected["score"].to_numpy(), atol=1e-12)

    # Bad rows come back as a client error that names the row and the value.
    bad = iso.with_columns(
        pl.when(pl.int_range(pl.len()) == 2).then(-1.0).otherwise("amount").alias("amount")
    )
    status, body = invoke(scoring_app, {"dataframe_split": {"columns": bad.columns, "data": bad.rows()}})
    assert status == 400 and "row 2" in body["stack_trace"] and "amount = -1.0" in body["stack_trace"]
