"""Every command README.md shows, run as written (at smaller sizes) or pointed at the test that runs it.

The README is the spec a newcomer copies from, so the commands are read out of README.md itself — the lines
of its ```bash blocks and its inline `txsentinel ...` spans — and a rename of a flag or a subcommand there
without the code (or the reverse) fails here. SHRINK lists the only edits made before running them: sizes,
placeholders a reader fills in (RUN_ID), and the test broker's address.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import polars as pl
import pytest

from consumers.runtime.metrics import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# Commands a test elsewhere runs; each entry names that test, which must exist and mention the command.
COVERED_ELSEWHERE = {
    "make demo": ("tests/test_demo.py", "run_demo"),
    "make test": (".ci/run", "make test"),
    "txsentinel demo": ("tests/test_demo.py", "run_demo"),
    "txsentinel terminal-writer": ("tests/integration/test_service_labels.py", '"terminal-writer"'),
}

# (pattern, replacement) applied in order to each command before it runs: smaller sizes, filled placeholders.
SHRINK = [
    (r"--accounts 5000 --days 180", "--accounts 150 --days 45"),
    (r"--events 1000000", "--events 20000"),
    (r"--events 50000", "--events 3000"),
    (r"max_epochs=10", "max_epochs=1"),
    (r"--folds 4", "--folds 2"),
    (r"fail\|quarantine", "quarantine"),
    (r"\[([^\]]*)\]", r"\1"),  # optional parts: run them too
]


def readme_commands() -> list[str]:
    """The runnable commands: lines of README.md's ```bash blocks (continuations joined, comments cut)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(re.sub(r"\s+", " ", line))
    return commands


def readme_mentions() -> list[str]:
    """Inline `txsentinel ...` spans of the prose (e.g. `txsentinel serve --config FILE`): forms, not runs."""
    prose = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)
    return [span for span in re.findall(r"`([^`\n]+)`", prose) if span.startswith("txsentinel ")]


def subcommand(command: str) -> str:
    """'txsentinel bench stream --events 3' -> 'txsentinel bench stream'; 'scripts/kafka.sh start' -> the
    script; 'make demo', 'mlflow ui': two words."""
    words = re.sub(r"^\.venv/bin/", "", command).split()
    if words[0].startswith("scripts/"):
        return words[0]
    return " ".join(words[: 3 if words[:2] == ["txsentinel", "bench"] else 2])


# -- the fast check: nothing in the README goes untested --------------------------------------------------
# What test_readme_commands_run_as_written runs, by subcommand; kept in step with it.
RUN_HERE = {
    "txsentinel generate", "txsentinel ingest", "txsentinel features", "txsentinel train",
    "txsentinel promote", "mlflow ui", "scripts/gpu_check.sh", "scripts/kafka.sh", "txsentinel serve",
    "txsentinel backtest", "txsentinel compare", "txsentinel bench features", "txsentinel bench models",
    "txsentinel bench replay", "txsentinel bench stream",
}  # fmt: skip


def test_every_readme_command_is_run_by_a_test():
    commands = readme_commands()
    assert len(commands) >= 15, f"found only {commands}: has the README's layout changed?"
    for command in commands + readme_mentions():
        if subcommand(command) in RUN_HERE:
            continue
        covered = COVERED_ELSEWHERE.get(subcommand(command))
        assert covered, f"README command {command!r} is run by no test: add it to test_readme_commands.py"
        path, mention = covered
        assert mention in (ROOT / path).read_text(), f"{path} no longer runs {command!r}"


# -- the slow check: run them ----------------------------------------------------------------------------
def shrink(command: str, fill: dict[str, str]) -> list[str]:
    for pattern, replacement in [*SHRINK, *fill.items()]:
        command = re.sub(pattern, replacement, command)
    words = shlex.split(command)
    if words[0].startswith(".venv/bin/"):
        words[0] = str(Path(sys.executable).parent / words[0].removeprefix(".venv/bin/"))
    elif words[0].startswith("scripts/"):
        words[0] = str(ROOT / words[0])
    return words


def run(words: list[str], cwd: Path, env: dict, timeout_s: float = 600) -> str:
    done = subprocess.run(words, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, (
        f"{shlex.join(words)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout + done.stderr


def write_handbook_csv(data_dir: Path, path: Path) -> None:
    """The generated dataset in the Fraud Detection Handbook's own CSV columns (configs/data/handbook.yaml)."""
    frame = pl.read_parquet(data_dir / "transactions.parquet")
    frame.select(
        pl.col("event_id").alias("TRANSACTION_ID"),
        pl.col("ts").dt.strftime("%Y-%m-%d %H:%M:%S").alias("TX_DATETIME"),
        pl.col("account_id").alias("CUSTOMER_ID"),
        pl.col("terminal_id").alias("TERMINAL_ID"),
        pl.col("amount").alias("TX_AMOUNT"),
        pl.col("is_fraud").cast(pl.Int8).alias("TX_FRAUD"),
    ).write_csv(path)


def wait_for_http(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"{proc.args} exited {proc.returncode} before serving {url}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.read().decode()
        except OSError:
            assert time.monotonic() < deadline, f"{url} did not answer within {timeout_s} s"
            time.sleep(0.5)


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.mark.slow
def test_readme_commands_run_as_written(kafka_bootstrap, tmp_path):
    from kafka import KafkaAdminClient, KafkaProducer

    from consumers.scoring.messages import encode_transaction, transactions_from_frame

    # The README's relative paths (configs/..., scripts/...) resolve in a scratch working directory.
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # README: ./mlflow.db
    prefix = f"readme-{uuid.uuid4().hex[:8]}-"
    fill = {
        r"127\.0\.0\.1:39092": kafka_bootstrap,
        r"metrics_port=9400": f"metrics_port={free_port()}",
        r"--group-id txsentinel-scorer": f"--group-id {prefix}scorer --set topic_prefix={prefix}",
    }
    commands = [c for c in readme_commands() if subcommand(c) in RUN_HERE]
    ran = set()

    def each(name: str) -> list[list[str]]:
        found = [shrink(c, fill) for c in commands if subcommand(c) == name]
        assert found, f"README has no {name!r} command any more"
        ran.add(name)
        return found

    for words in each("txsentinel generate"):
        assert "fraud" in run(words, tmp_path, env)
    write_handbook_csv(tmp_path / "runs" / "data", tmp_path / "transactions.csv")
    for words in each("txsentinel ingest"):
        run(words, tmp_path, env)
    assert (tmp_path / "runs" / "mydata" / "transactions.parquet").exists()
    for words in each("txsentinel features"):
        run(words, tmp_path, env)
    assert pl.read_parquet(tmp_path / "runs" / "features.parquet").height > 1000

    trained = {}
    for words in each("txsentinel train"):
        if "--config" not in words and "logreg" not in words:
            words += ["--config", "configs/train/quick.yaml"]  # the quick profile under the README's --set
        out = run(words, tmp_path, env)
        model = words[words.index("--model") + 1]
        trained[model] = re.search(r"\brun ([0-9a-f]{32})\b", out).group(1)  # "trained lstm: run ID, ..."
    assert {"lstm", "linear_transformer", "logreg"} <= set(trained)
    fill["RUN_ID"] = trained["lstm"]
    for words in each("txsentinel promote"):
        assert "champion" in run(words, tmp_path, env)

    for words in each("mlflow ui"):
        port = free_port()
        ui = subprocess.Popen([*words, "--port", str(port)], cwd=tmp_path, env=env, start_new_session=True)
        try:
            wait_for_http(f"http://127.0.0.1:{port}/health", ui)
        finally:
            os.killpg(ui.pid, signal.SIGTERM)
            ui.wait(timeout=30)

    for words in each("scripts/gpu_check.sh"):
        run([*words, "--device", "cpu", "--quick"], tmp_path, env)  # no GPU here: its CPU smoke mode
    for words in each("scripts/kafka.sh"):
        assert "running" in run(words, tmp_path, env)  # the fixture's broker is up: start finds it

    # serve: stream the last day through the README's serve command, then SIGTERM it.
    (words,) = each("txsentinel serve")
    metrics_port = int(re.search(r"metrics_port=(\d+)", " ".join(words)).group(1))
    last = pl.read_parquet(tmp_path / "runs" / "data" / "transactions.parquet").sort("ts").tail(300)
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics({f"{prefix}transactions": {"num_partitions": 3, "replication_factor": 1}})
    admin.close()
    serve_log = tmp_path / "serve.log"
    with serve_log.open("w") as sink:
        serve = subprocess.Popen(words, cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
        for tx in transactions_from_frame(last):
            producer.send(f"{prefix}transactions", key=tx.account_id.encode(), value=encode_transaction(tx))
        producer.flush()
        producer.close()
        deadline = time.monotonic() + 180
        while True:
            metrics = wait_for_http(f"http://127.0.0.1:{metrics_port}/metrics", serve)
            if f"txsentinel_events_scored_total {last.height}\n" in metrics:
                break
            assert time.monotonic() < deadline, "the README's serve did not score the streamed events"
            time.sleep(1)
    finally:
        code = stop(serve)
    assert code == 0, f"serve exited {code} on SIGTERM:\n{serve_log.read_text()[-3000:]}"

    for words in each("txsentinel backtest"):
        run(words, tmp_path, env)
    assert json.loads((tmp_path / "runs" / "backtest" / "backtest.json").read_text())
    for words in each("txsentinel compare"):
        assert "lstm" in run(words, tmp_path, env)

    tables = {  # a word of each bench's table
        "txsentinel bench features": "events/s",
        "txsentinel bench models": "state B",
        "txsentinel bench replay": "events/s",
    }
    for name, heading in tables.items():
        for words in each(name):
            assert heading in run(words, tmp_path, env)
    for words in each("txsentinel bench stream"):
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

    assert ran == RUN_HERE, f"RUN_HERE names commands this test did not run: {RUN_HERE - ran}"
