"""The built wheel, installed in a fresh virtual environment from the lock's versions, runs without the
checkout: `txsentinel serve` (the [serve] extra: no Lightning, scikit-learn or matplotlib) scores a few
transactions on the project's broker and what it writes is valid under the schemas it ships; with [train],
`train --help` and a tiny `generate` + `backtest` run.

uv builds and installs, reusing its cache (the one `make` filled), so the install takes seconds; its time is
printed."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import jsonschema
import polars as pl
import pytest

from consumers.runtime.metrics import free_port
from consumers.scoring.messages import encode_transaction, transactions_from_frame
from pipeline.data.generate import GenerateConfig, generate
from tests.integration.service_helpers import produce, read_committed, save_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.kafka]
ROOT = Path(__file__).resolve().parents[1]
LEAN = ("pytorch-lightning", "scikit-learn", "matplotlib", "scipy")  # what [serve] must not bring


def uv(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "uv", *args], cwd=cwd, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, f"uv {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh environment with the wheel and its [serve] extra, at the lock's versions."""
    work = tmp_path_factory.mktemp("wheel")
    started = time.monotonic()
    uv("build", "--quiet", "--out-dir", str(work / "dist"))  # the sdist, then the wheel from it
    (wheel,) = (work / "dist").glob("txsentinel-*.whl")
    built = time.monotonic()
    constraints = work / "constraints.txt"
    uv(
        "export",
        "--quiet",
        "--frozen",
        "--no-emit-project",
        "--all-extras",
        "--no-hashes",
        "-o",
        str(constraints),
    )
    uv("venv", "--quiet", "--python", sys.executable, str(work / "venv"))
    python = work / "venv" / "bin" / "python"
    # Bytecode now, once: where PYTHONDONTWRITEBYTECODE is set every process would compile torch again.
    uv(
        "pip",
        "install",
        "--quiet",
        "--compile-bytecode",
        "--python",
        str(python),
        "-c",
        str(constraints),
        f"{wheel}[serve]",
    )
    print(
        f"\npackaging: wheel built in {built - started:.1f} s, [serve] installed in {time.monotonic() - built:.1f} s"
    )
    return work / "venv"


def run(venv: Path, *args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(venv / "bin" / "txsentinel"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, (
        f"txsentinel {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    )
    return done


def installed(venv: Path) -> set[str]:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; print('\\n'.join(d.metadata['Name'].lower() for d in m.distributions()))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return set(out.stdout.split())


def readyz(port: int) -> int | None:
    """The status of /readyz, or None while nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def test_the_wheel_serves_from_a_fresh_environment_without_the_checkout(venv, kafka_bootstrap, tmp_path):
    assert not set(LEAN) & installed(venv), "the [serve] extra brought training packages"
    frame = generate(GenerateConfig(accounts=20, days=10, seed=3))
    model = save_tiny_model(frame, fit_days=10, out=tmp_path / "model", version="7")
    prefix = f"wheel-{uuid.uuid4().hex[:8]}-"
    port = free_port()
    # As a deployment sets it: every setting from TXS_ variables, none on the command line.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        TXS_MODEL_URI=model,
        TXS_BOOTSTRAP_SERVERS=kafka_bootstrap,
        TXS_TOPIC_PREFIX=prefix,
        TXS_GROUP_ID=f"{prefix}group",
        TXS_POLL_TIMEOUT_MS="200",
        TXS_METRICS_PORT=str(port),
    )
    log = tmp_path / "serve.log"
    command = [str(venv / "bin" / "txsentinel"), "serve"]
    with log.open("w") as sink:
        service = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while readyz(port) != 200:  # 503 (or no answer yet) until its partitions are restored
            assert service.poll() is None, f"serve exited {service.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"serve not ready within 300 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        events = transactions_from_frame(frame.sort("ts").tail(30))
        now = time.time_ns() // 1000
        events = [e._replace(ts_us=now - 1_000_000 * (len(events) - i)) for i, e in enumerate(events)]
        messages = [(e.account_id, encode_transaction(e)) for e in events]
        messages.append(("A-bad", b"not json"))
        produce(kafka_bootstrap, f"{prefix}transactions", messages)
        scores = []
        while len(scores) < len(events):
            assert service.poll() is None, f"serve exited {service.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline + 120, f"{len(scores)} of {len(events)} scores"
            time.sleep(0.5)
            scores = [json.loads(r.value) for r in read_committed(kafka_bootstrap, f"{prefix}scores")]
        letters = [json.loads(r.value) for r in read_committed(kafka_bootstrap, f"{prefix}dead-letter")]
    finally:
        service.send_signal(signal.SIGTERM)
        code = service.wait(timeout=120)
    assert code == 0, f"serve exited {code} on SIGTERM:\n{log.read_text()[-3000:]}"
    assert sorted(s["event_id"] for s in scores) == sorted(e.event_id for e in events)
    assert len(letters) == 1 and "not valid UTF-8 JSON" in letters[0]["reason"]
    # What it wrote, against the schemas the installed package ships.
    site = next((venv / "lib").glob("python3*/site-packages"))
    shipped = site / "consumers" / "scoring" / "schemas"
    for topic, records in (("scores", scores), ("dead-letter", letters)):
        validator = jsonschema.Draft202012Validator(
            json.loads((shipped / f"{topic}.schema.json").read_text())
        )
        for record in records:
            validator.validate(record)


def test_the_wheel_trains_and_backtests_from_a_fresh_environment(venv, tmp_path):
    (wheel,) = (venv.parent / "dist").glob("txsentinel-*.whl")
    constraints = venv.parent / "constraints.txt"
    started = time.monotonic()
    uv(
        "pip",
        "install",
        "--quiet",
        "--python",
        str(venv / "bin" / "python"),
        "-c",
        str(constraints),
        f"{wheel}[train]",
    )
    print(f"\npackaging: [train] added in {time.monotonic() - started:.1f} s")
    assert "--config" in run(venv, "train", "--help", cwd=tmp_path).stdout
    run(venv, "generate", "--out", "data", "--accounts", "30", "--days", "30", "--seed", "1", cwd=tmp_path)
    # The packaged generator profiles ship in the wheel too.
    run(
        venv,
        "generate",
        "--out",
        "handbook",
        "--config",
        "handbook",
        "--accounts",
        "30",
        "--days",
        "5",
        cwd=tmp_path,
    )
    handbook = pl.read_parquet(tmp_path / "handbook" / "transactions.parquet")
    assert set(handbook["scenario"]) <= {
        "legit",
        "high_amount",
        "compromised_terminal",
        "compromised_account",
    }
    frame = pl.read_parquet(tmp_path / "data" / "transactions.parquet")
    model = save_tiny_model(frame, fit_days=14, out=tmp_path / "model", version="1")
    done = run(
        venv, "backtest", "--data", "data", "--model", model, "--no-mlflow", "--out", "report", cwd=tmp_path
    )
    assert (tmp_path / "report").is_dir(), done.stdout
    # The MLflow model, logged and loaded with the installed package only: raw transactions in, the scores
    # the backtest's replay gives out.
    script = """
import sys, mlflow, numpy as np, polars as pl
from pathlib import Path
import pipeline
from consumers.scoring.scorer import Scorer
from pipeline.data.dataset import read_dataset
from pipeline.registry.pyfunc_model import log_and_register
from pipeline.registry.tracking import load_model
assert "site-packages" in pipeline.__file__, pipeline.__file__
uri, version = log_and_register(Path(sys.argv[1]), "wheel-model")
frame = read_dataset("data")
naive = frame.with_columns(pl.col("ts", "label_ts").dt.replace_time_zone(None)).to_pandas()
predicted = mlflow.pyfunc.load_model(f"models:/wheel-model/{version}").predict(naive)
replayed = Scorer(load_model(sys.argv[1])).replay(frame)
expected = dict(zip(replayed["event_id"], replayed["score"]))
worst = max(abs(s - expected[e]) for e, s in zip(predicted["event_id"], predicted["score"]))
assert len(predicted) == frame.height and worst < 1e-5, worst
print("pyfunc equals the replay to", worst)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", script, model],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pyfunc equals the replay" in done.stdout
