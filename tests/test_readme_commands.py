"""Every command README.md and docs/*.md show, run as written (at smaller sizes) or pointed at the test that runs it.

The README and the docs are the spec a person copies from, so the commands are read out of them — the lines
of their ```bash blocks and their inline `txsentinel ...` spans — and a rename of a flag or a subcommand there
without the code (or the reverse) fails here. A command shown on several pages runs once. SHRINK lists the
only edits made before running them: sizes, placeholders a reader fills in (RUN_ID), and the test broker's
address.

The run is split by what it needs: the `prepared` fixture generates, ingests and trains (once a module); the
test here runs the commands that need no broker, and tests/test_readme_commands_on_the_broker.py those that
do (the broker script, serve, the stream bench). Two modules, so that `make test` runs them in its two
processes side by side, and `pytest -m "not kafka"` still runs everything that can run without Kafka.
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
from pathlib import Path

import polars as pl
import pytest

from consumers.runtime.metrics import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]

# Commands a test elsewhere runs; each entry names that test, which must exist and mention the command.
COVERED_ELSEWHERE = {
    "make demo": ("tests/test_demo.py", "run_demo"),
    "make test": (".ci/run", "make test"),
    "txsentinel demo": ("tests/test_demo.py", "run_demo"),
    "txsentinel terminal-writer": ("tests/integration/test_service_labels.py", '"terminal-writer"'),
    "txsentinel bench quality": ("tests/pipeline/bench/test_quality.py", '"bench", "quality"'),
    "txsentinel schemas": ("tests/consumers/scoring/test_topic_schemas.py", '"schemas", "--out"'),
    "uv build": ("tests/test_packaging.py", 'uv("build"'),
    "uv export": ("tests/test_packaging.py", '"export",'),
    "uv venv": ("tests/test_packaging.py", 'uv("venv"'),
    "txsentinel bench restore": ("tests/pipeline/bench/test_restore.py", '"bench", "restore"'),
    "txsentinel bench trees": ("tests/pipeline/bench/test_tree_head.py", '"bench", "trees"'),
    "txsentinel monitor": ("tests/integration/test_monitor.py", '"monitor", f"--metrics-url'),
}

# (pattern, replacement) applied in order to each command before it runs: smaller sizes, filled placeholders.
SHRINK = [
    (r"--accounts 5000 --days 180", "--accounts 150 --days 45"),
    (r"--events 1000000", "--events 20000"),
    (r"--terminals 1000000", "--terminals 20000"),
    (r"--events 50000", "--events 3000"),
    (r"max_epochs=10", "max_epochs=1"),
    # The quick profile's 12 epochs: the commands after training need a trained model, not a good one.
    (r"--config configs/train/quick\.yaml", "--config configs/train/quick.yaml --set max_epochs=1"),
    (r"--folds 4", "--folds 2"),
    (r"fail\|quarantine", "quarantine"),
    (r"\[([^\]]*)\]", r"\1"),  # optional parts: run them too
]


def bash_commands(path: Path) -> list[str]:
    """The runnable commands of one page: lines of its ```bash blocks (continuations joined, comments cut)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(re.sub(r"\s+", " ", line))
    return commands


def readme_commands() -> list[str]:
    """The runnable commands of README.md."""
    return bash_commands(README)


def doc_commands() -> list[str]:
    """The runnable commands of README.md and docs/*.md, each once, in page order."""
    return list(dict.fromkeys(command for path in DOCS for command in bash_commands(path)))


def mentions(path: Path) -> list[str]:
    """Inline `txsentinel ...` spans of a page's prose (e.g. `txsentinel serve --config FILE`): forms, not runs."""
    prose = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [span for span in re.findall(r"`([^`\n]+)`", prose) if span.startswith("txsentinel ")]


def readme_mentions() -> list[str]:
    return mentions(README)


def subcommand(command: str) -> str:
    """'txsentinel bench stream --events 3' -> 'txsentinel bench stream'; 'scripts/kafka.sh start' -> the
    script; 'make demo', 'mlflow ui': two words."""
    words = re.sub(r"^\.venv/bin/", "", command).split()
    if words[0].startswith("scripts/"):
        return words[0]
    return " ".join(words[: 3 if words[:2] == ["txsentinel", "bench"] else 2])


# -- the fast checks: nothing in the docs goes untested, no link between them is broken -------------------
# What the tests below run, by subcommand; kept in step with them.
PREPARED = {
    "txsentinel generate", "txsentinel ingest", "txsentinel features", "txsentinel train", "txsentinel promote",
}  # fmt: skip
RUN_WITHOUT_BROKER = {
    "mlflow ui", "mlflow models", "scripts/gpu_check.sh", "txsentinel backtest", "txsentinel compare",
    "txsentinel bench features", "txsentinel bench models", "txsentinel bench replay",
    "txsentinel bench reasons",
}  # fmt: skip
RUN_ON_THE_BROKER = {"scripts/kafka.sh", "txsentinel serve", "txsentinel bench stream"}
RUN_HERE = PREPARED | RUN_WITHOUT_BROKER | RUN_ON_THE_BROKER


def test_every_readme_and_docs_command_is_run_by_a_test():
    commands = doc_commands()
    assert len(commands) >= 15, f"found only {commands}: has the docs' layout changed?"
    assert {"make demo", "make test"} <= set(readme_commands()), "README.md lost its two set-up commands"
    for path in DOCS:
        for command in bash_commands(path) + mentions(path):
            if subcommand(command) in RUN_HERE:
                continue
            covered = COVERED_ELSEWHERE.get(subcommand(command))
            page = path.relative_to(ROOT)
            assert covered, f"{page} command {command!r} is run by no test: add it to test_readme_commands.py"
            test_path, mention = covered
            assert mention in (ROOT / test_path).read_text(), f"{test_path} no longer runs {command!r}"


def anchor(heading: str) -> str:
    """A heading's link anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_docs_resolves():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, mailto: ...: not ours to check
                continue
            file, _, fragment = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)} links to {target!r}"
            assert linked.exists(), f"{where}, which does not exist"
            if fragment:
                text = re.sub(r"```.*?```", "", linked.read_text(), flags=re.S)  # a "# comment" is no heading
                headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
                anchors = [anchor(h) for h in headings]
                assert fragment in anchors, f"{where}: no such heading; its headings: {anchors}"


# -- the slow checks: run them ---------------------------------------------------------------------------
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


class Workdir:
    """A scratch working directory where the docs' relative paths resolve (configs/..., ./mlflow.db), and
    the commands of one stage run there: `each(name)` gives the stage its commands and notes it ran them."""

    def __init__(self, path: Path, env: dict[str, str], fill: dict[str, str]):
        self.path, self.env, self.fill = path, env, fill
        self.ran: set[str] = set()

    def commands(self, name: str) -> list[str]:
        found = [c for c in doc_commands() if subcommand(c) == name]
        assert found, f"README.md and docs/ have no {name!r} command any more"
        self.ran.add(name)
        return found

    def each(self, name: str) -> list[list[str]]:
        return [shrink(c, self.fill) for c in self.commands(name)]

    def stage(self) -> "Workdir":
        """The same directory for the next stage, with nothing run yet."""
        return Workdir(self.path, self.env, dict(self.fill))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Workdir:
    return prepare(tmp_path_factory)


def prepare(tmp_path_factory) -> Workdir:
    """A dataset generated and ingested, its features, three trained models, the LSTM promoted."""
    tmp_path = tmp_path_factory.mktemp("docs-commands")
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the docs: ./mlflow.db
    env["PYTHON"] = sys.executable  # scripts/*.sh: the interpreter the tests run under, like .venv/bin/ above
    work = Workdir(tmp_path, env, {})

    for words in work.each("txsentinel generate"):
        assert "fraud" in run(words, tmp_path, env)
    write_handbook_csv(tmp_path / "runs" / "data", tmp_path / "transactions.csv")
    for words in work.each("txsentinel ingest"):
        run(words, tmp_path, env)
    assert (tmp_path / "runs" / "mydata" / "transactions.parquet").exists()
    for words in work.each("txsentinel features"):
        run(words, tmp_path, env)
    assert pl.read_parquet(tmp_path / "runs" / "features.parquet").height > 1000

    trained = {}
    for words in work.each("txsentinel train"):
        if "--config" not in words and "logreg" not in words:
            words += ["--config", "configs/train/quick.yaml"]  # the quick profile under the docs' --set
        out = run(words, tmp_path, env)
        model = words[words.index("--model") + 1]
        trained[model] = re.search(r"\brun ([0-9a-f]{32})\b", out).group(1)  # "trained lstm: run ID, ..."
    assert {"lstm", "linear_transformer", "logreg"} <= set(trained)
    work.fill["RUN_ID"] = trained["lstm"]
    for words in work.each("txsentinel promote"):
        assert "champion" in run(words, tmp_path, env)

    assert work.ran == PREPARED, f"PREPARED names commands the fixture did not run: {PREPARED - work.ran}"
    return work.stage()


# The module's training (the `prepared` fixture) counts in the time of whichever test runs first.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_doc_commands_run_as_written_without_a_broker(prepared):
    work = prepared.stage()
    tmp_path, env = work.path, work.env

    for words in work.each("mlflow ui"):
        port = free_port()
        ui = subprocess.Popen([*words, "--port", str(port)], cwd=tmp_path, env=env, start_new_session=True)
        try:
            wait_for_http(f"http://127.0.0.1:{port}/health", ui)
        finally:
            os.killpg(ui.pid, signal.SIGTERM)
            ui.wait(timeout=30)

    for words in work.each("mlflow models"):  # serve, as docs/operations.md shows it: a batch over HTTP
        port = free_port()
        words[words.index("--port") + 1] = str(port)
        on_path = {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}
        with (tmp_path / "models-serve.log").open("w") as sink:
            server = subprocess.Popen(
                words,
                cwd=tmp_path,
                env=on_path,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_for_http(f"http://127.0.0.1:{port}/ping", server, timeout_s=300)
            rows = pl.read_parquet(tmp_path / "runs" / "data" / "transactions.parquet").tail(50)
            rows = rows.drop("scenario").with_columns(
                pl.col("ts", "label_ts").dt.strftime("%Y-%m-%dT%H:%M:%S%.6f")
            )
            body = json.dumps({"dataframe_split": {"columns": rows.columns, "data": rows.rows()}}).encode()
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/invocations", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=120) as response:
                predictions = json.loads(response.read())["predictions"]
            assert [p["event_id"] for p in predictions] == rows["event_id"].to_list()
            assert all(0.0 <= p["score"] <= 1.0 for p in predictions)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)

    for words in work.each("scripts/gpu_check.sh"):
        run([*words, "--device", "cpu", "--quick"], tmp_path, env)  # no GPU here: its CPU smoke mode

    for words in work.each("txsentinel backtest"):
        run(words, tmp_path, env)
    assert json.loads((tmp_path / "runs" / "backtest" / "backtest.json").read_text())
    for words in work.each("txsentinel compare"):
        assert "lstm" in run(words, tmp_path, env)

    tables = {  # a word of each bench's table
        "txsentinel bench features": "events/s",
        "txsentinel bench models": "state B",
        "txsentinel bench replay": "events/s",
        "txsentinel bench reasons": "top_is_signal",
    }
    for name, heading in tables.items():
        for words in work.each(name):
            assert heading in run(words, tmp_path, env)

    assert work.ran == RUN_WITHOUT_BROKER, (
        f"RUN_WITHOUT_BROKER names commands this test did not run: {RUN_WITHOUT_BROKER - work.ran}"
    )
