"""`txsentinel serve` as an operator runs it, on the real broker and a real MLflow store: /readyz answers
503 while it starts and restores, then 200; /healthz answers 200 throughout; /metrics names the registered
model it serves; --log-format json writes only JSON lines, with the fields of each."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import polars as pl
import pytest

from consumers.runtime.metrics import free_port, scrape
from consumers.scoring.messages import encode_transaction, transactions_from_frame
from pipeline.data.generate import GenerateConfig, generate
from pipeline.features.definitions import FEATURE_VERSION
from pipeline.registry.pyfunc_model import log_and_register
from pipeline.registry.tracking import configure_tracking, promote
from tests.integration.service_helpers import create_topic, prefixed_configs, produce, save_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def get(port: int, path: str) -> tuple[int, str] | None:
    """(status, body), or None while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return None


@pytest.fixture
def registered(tmp_path, monkeypatch) -> str:
    """models:/probes@champion: a tiny LSTM registered as version 1 of `probes` in a SQLite store."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    frame = generate(GenerateConfig(accounts=20, days=12, seed=11)).sort("ts", "event_id")
    frame.write_parquet(tmp_path / "events.parquet")
    model_dir = save_tiny_model(frame, 8, tmp_path / "model", "probes-1")
    configure_tracking()
    with mlflow.start_run():
        _, version = log_and_register(Path(model_dir), "probes")
    promote("champion", "probes", version=version)
    return "models:/probes@champion"


def test_serve_turns_ready_after_its_restore_and_names_its_model(kafka_bootstrap, registered, tmp_path):
    port = free_port()
    events = transactions_from_frame(pl.read_parquet(tmp_path / "events.parquet").head(60))
    with prefixed_configs(kafka_bootstrap, "probes") as make:
        cfg = make()
        create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=2)
        produce(
            kafka_bootstrap,
            cfg.topic("transactions"),
            [(t.account_id, encode_transaction(t)) for t in events],
        )
        command = [
            sys.executable, "-m", "pipeline.cli.main", "serve", "--model", registered,
            "--bootstrap-servers", kafka_bootstrap, "--group-id", cfg.group_id,
            "--set", f"topic_prefix={cfg.topic_prefix}", "--set", "transactions_partitions=2",
            "--set", f"metrics_port={port}", "--log-format", "json",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        log_path = tmp_path / "serve.log"
        with log_path.open("w") as log:
            # stdout too: under JSON logs nothing else may reach either stream
            serve = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            seen: list[tuple[int, str]] = []
            deadline = time.monotonic() + 180
            while not seen or seen[-1][0] != 200:
                assert serve.poll() is None, (
                    f"serve exited {serve.returncode}:\n{log_path.read_text()[-3000:]}"
                )
                assert time.monotonic() < deadline, f"never ready; last answers {seen[-3:]}"
                answer = get(port, "/readyz")
                if answer is not None:
                    seen.append(answer)
                    assert get(port, "/healthz") == (200, "alive\n")
                time.sleep(0.05)
            not_ready = [body for status, body in seen if status == 503]
            assert not_ready, "/readyz was never 503: it answered 200 before the service had started"
            assert all(body.startswith("not ready: ") for body in not_ready)
            assert {status for status, _ in seen} == {503, 200} and seen[-1] == (200, "ready\n")

            _, metrics = get(port, "/metrics")
            info = (
                f'txsentinel_model_info{{detector="lstm",feature_version="{FEATURE_VERSION}",name="probes",'
                f'source="{registered}",version="1"}} 1.0'
            )
            assert info in metrics.splitlines()
            assert "process_resident_memory_bytes " in metrics
            assert scrape(port, "txsentinel_assigned_partitions") == 2
            assert scrape(port, "txsentinel_ready") == 1  # what Prometheus sees of /readyz

            while scrape(port, "txsentinel_events_scored_total") < len(events):
                assert time.monotonic() < deadline, "the produced events were not scored"
                time.sleep(0.5)
        finally:
            serve.send_signal(signal.SIGTERM)
            code = serve.wait(timeout=60)
        assert code == 0, log_path.read_text()[-3000:]

    lines = [json.loads(line) for line in log_path.read_text().splitlines()]  # every line is JSON
    assert all({"timestamp", "level", "logger", "message"} <= line.keys() for line in lines)
    (restored,) = [line for line in lines if line["message"].startswith("restore done")]
    assert restored["logger"] == "consumers.service.restore" and restored["partitions"] == [0, 1]
    stopped = [line for line in lines if line["message"].startswith("serve stopped")]
    assert stopped and stopped[0]["events_scored"] == len(events)


def test_terminal_writer_turns_ready_once_it_has_read_the_table(kafka_bootstrap, tmp_path):
    port = free_port()
    with prefixed_configs(kafka_bootstrap, "probes-writer") as make:
        cfg = make()
        command = [
            sys.executable, "-m", "pipeline.cli.main", "terminal-writer", "--bootstrap-servers", kafka_bootstrap,
            "--group-id", cfg.group_id, "--set", f"topic_prefix={cfg.topic_prefix}",
            "--set", f"metrics_port={port}",
        ]  # fmt: skip
        log_path = tmp_path / "writer.log"
        with log_path.open("w") as log:
            writer = subprocess.Popen(
                command, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=log
            )
        try:
            seen: list[tuple[int, str]] = []
            deadline = time.monotonic() + 120
            while not seen or seen[-1][0] != 200:
                assert writer.poll() is None, f"exited {writer.returncode}:\n{log_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"never ready; last answers {seen[-3:]}"
                if (answer := get(port, "/readyz")) is not None:
                    seen.append(answer)
                time.sleep(0.05)
            assert seen[0][0] == 503 and seen[0][1].startswith("not ready: table: ")
            assert get(port, "/healthz") == (200, "alive\n") and scrape(port, "txsentinel_ready") == 1
        finally:
            writer.send_signal(signal.SIGTERM)
            code = writer.wait(timeout=60)
        assert code == 0, log_path.read_text()[-3000:]
