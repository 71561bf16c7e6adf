"""The commands of README.md and docs/*.md that need the broker (the broker script, serve, the stream bench),
run as written: tests/test_readme_commands.py says how, and runs the others. A module of its own, so that
`make test` runs it in the broker's process while the others run beside it (tests/conftest.py)."""

import re
import subprocess
import time
import uuid

import polars as pl
import pytest

from consumers.runtime.metrics import free_port
from tests.test_readme_commands import RUN_ON_THE_BROKER, Workdir, prepare, run, shrink, stop, wait_for_http


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Workdir:
    return prepare(tmp_path_factory)


def serve_and_stream(words: list[str], prefix: str, work: Workdir, kafka_bootstrap: str) -> None:
    """Stream the last 300 events through the docs' serve command, wait until all are scored, SIGTERM it."""
    from kafka import KafkaAdminClient, KafkaProducer

    from consumers.scoring.messages import encode_transaction, transactions_from_frame

    metrics_port = int(re.search(r"metrics_port=(\d+)", " ".join(words)).group(1))
    last = pl.read_parquet(work.path / "runs" / "data" / "transactions.parquet").sort("ts").tail(300)
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics({f"{prefix}transactions": {"num_partitions": 3, "replication_factor": 1}})
    admin.close()
    serve_log = work.path / f"{prefix}serve.log"
    with serve_log.open("w") as sink:
        serve = subprocess.Popen(words, cwd=work.path, env=work.env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
        for tx in transactions_from_frame(last):
            producer.send(f"{prefix}transactions", key=tx.account_id.encode(), value=encode_transaction(tx))
        producer.flush()
        producer.close()
        deadline = time.monotonic() + 180
        while True:
            metrics = wait_for_http(f"http://127.0.0.1:{metrics_port}/metrics", serve)
            if f"txsentinel_events_scored_total {last.height:.1f}\n" in metrics:  # values are floats
                break
            assert time.monotonic() < deadline, "the docs' serve did not score the streamed events"
            time.sleep(1)
    finally:
        code = stop(serve)
    assert code == 0, f"serve exited {code} on SIGTERM:\n{serve_log.read_text()[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_doc_commands_run_as_written_on_the_broker(prepared, kafka_bootstrap):
    work = prepared.stage()
    tmp_path, env = work.path, work.env
    work.fill[r"127\.0\.0\.1:39092"] = kafka_bootstrap

    for words in work.each("scripts/kafka.sh"):
        assert "running" in run(words, tmp_path, env)  # the fixture's broker is up: start finds it

    # serve: each serve command the docs show, on topics of its own (a prefix) and a free metrics port.
    for command in work.commands("txsentinel serve"):
        prefix = f"readme-{uuid.uuid4().hex[:8]}-"
        words = shrink(command, {
            **work.fill,
            r"metrics_port=9400": f"metrics_port={free_port()}",
            r"--group-id txsentinel-scorer": f"--group-id {prefix}scorer --set topic_prefix={prefix}",
        })  # fmt: skip
        assert f"topic_prefix={prefix}" in words, f"{command!r}: no --group-id txsentinel-scorer to isolate"
        serve_and_stream(words, prefix, work, kafka_bootstrap)

    for words in work.each("txsentinel bench stream"):
        out = run(words, tmp_path, {**env, "TXS_KAFKA_PORT": kafka_bootstrap.rsplit(":", 1)[1]})
        assert "svc/ceiling" in out
        if "--phase-log" in words:  # each service run's per-batch log, a timestamped line a batch
            logs = sorted((tmp_path / words[words.index("--phase-log") + 1]).iterdir())
            names = [log.name for log in logs]
            assert names == [
                f"{m}.{phase}.log" for m in ("linear_transformer", "lstm") for phase in ("full", "half")
            ]
            for log in logs:
                batches = [line for line in log.read_text().splitlines() if " batch events=" in line]
                assert batches and all(
                    float(line.split()[0]) > 1e9 and "commit_s=" in line for line in batches
                )
        if "--model" in words:  # the trained champion's row, by its URI, and no untrained detectors
            uri = words[words.index("--model") + 1]
            lines = out.splitlines()
            rows = [i for i, line in enumerate(lines) if line.startswith(f"lstm {uri} ")]
            # one row, right under the table's rule: no untrained detector ran before it
            assert len(rows) == 1 and set(lines[rows[0] - 1]) == {"-"}, out[-2000:]

    assert work.ran == RUN_ON_THE_BROKER, (
        f"RUN_ON_THE_BROKER names commands this test did not run: {RUN_ON_THE_BROKER - work.ran}"
    )
