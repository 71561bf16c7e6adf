"""An operator's mistake ends in one line that says what is wrong and what to do, and a non-zero exit code;
--debug adds the traceback. The broker and tracking server cases use a port nothing listens on; the model and
tracking store cases real MLflow stores in tmp."""

import errno
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from kafka.errors import InvalidReplicationFactorError, TopicAuthorizationFailedError

from consumers.runtime.settings import load_serve_config
from models.registry import build_detector
from pipeline.cli.errors import OperatorError, kafka_errors
from pipeline.cli.main import main
from pipeline.data.dataset import write_dataset
from pipeline.data.generate import generate
from pipeline.data.world import GenerateConfig
from pipeline.features import FEATURE_NAMES
from pipeline.features.spec import FeatureSpec
from pipeline.registry.artifact import save_model_dir

FAST = [
    "--set",
    "bootstrap_timeout_ms=1000",
]  # a refused connection fails after this, not kafka-python's 30 s


@pytest.fixture(autouse=True)
def no_txs_environment(monkeypatch):
    """The settings read TXS_* variables: the machine's own must not change what these tests see."""
    for name in [name for name in os.environ if name.startswith("TXS_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed on return: nothing listens there


@pytest.fixture
def tiny_model(tmp_path) -> str:
    spec = FeatureSpec(mean=(0.0,) * len(FEATURE_NAMES), std=(1.0,) * len(FEATURE_NAMES))
    detector = build_detector(
        "lstm", {"num_features": len(FEATURE_NAMES), "d_model": 8, "num_layers": 1, "dropout": 0.0}
    )
    return str(save_model_dir(tmp_path / "model", detector, spec, {"model_version": "tiny"}))


def refused(capsys, argv: list[str], exit_code: int) -> str:
    """Runs the command line; returns its last line on stderr, after checking it was the end of the story."""
    assert main(argv) == exit_code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"txsentinel {argv[0]}: ")
    return last


def test_a_model_uri_that_does_not_resolve_names_it_the_store_and_what_to_check(
    tmp_path, monkeypatch, capsys
):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    line = refused(capsys, ["serve", "--model", "models:/nope/1"], 1)
    assert f"model 'models:/nope/1' did not resolve in the MLflow tracking store {store}" in line
    assert "Registered Model with name=nope not found" in line and "MLFLOW_TRACKING_URI" in line
    assert main(["serve", "--model", "models:/nope/1", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "MlflowException" in err  # the cause, for whoever debugs it
    assert err.strip().splitlines()[-1] == line


@pytest.mark.parametrize(
    "command", [["backtest"], ["bench", "trees"], ["bench", "reasons"], ["bench", "stream"]], ids=" ".join
)
@pytest.mark.parametrize("uri", ["models:/nope@champion", "runs:/0123abc/model"])
def test_every_command_that_reads_a_model_names_one_that_does_not_resolve(command, uri, tmp_path):
    # In a process of its own: the benches pin themselves to a core before polars loads. A real dataset, so
    # that whichever a command reads first, the model is what it refuses (the stream bench makes its own
    # events, and resolves its models before it starts a broker).
    data = tmp_path / "data"
    write_dataset(generate(GenerateConfig(accounts=20, days=3, seed=0)), data, source={"generator": "test"})
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    reads = [] if command == ["bench", "stream"] else ["--data", str(data)]
    argv = [*command, *reads, "--model", uri]
    env = {**os.environ, "MLFLOW_TRACKING_URI": store}
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"txsentinel {command[0]}: model {uri!r} did not resolve in the MLflow tracking store {store}"
    )


def test_no_model_at_all_says_where_to_give_one(capsys):
    line = refused(capsys, ["serve"], 2)
    assert "no model to serve: pass --model URI, or set TXS_MODEL_URI" in line


@pytest.fixture
def two_runs(tmp_path, tiny_model) -> Path:
    """A directory of training runs, as mlruns/ is: two models under it, neither at its top."""
    runs = tmp_path / "runs"
    for run in ("run-a", "run-b"):
        shutil.copytree(tiny_model, runs / run / "artifacts" / "model")
    return runs


@pytest.mark.parametrize("command", [["serve", *FAST], ["backtest", "--data", "unread"]], ids=lambda c: c[0])
def test_an_empty_model_uri_or_a_directory_of_several_models_is_refused_not_one_picked(
    command, two_runs, monkeypatch, capsys
):
    # Path("") is the working directory: an unset $MODEL used to load the first model found under it.
    monkeypatch.chdir(two_runs)
    line = refused(capsys, [*command, "--model", ""], 2)
    assert "model '': an empty model URI" in line
    line = refused(capsys, [*command, "--model", "."], 2)
    assert "holds 2 txsentinel models" in line
    assert "run-a/artifacts/model" in line and "run-b/artifacts/model" in line


@pytest.mark.parametrize(
    "command", [["bench", "trees"], ["bench", "reasons"], ["bench", "stream"]], ids=" ".join
)
def test_every_bench_that_reads_a_model_refuses_an_empty_uri(command, two_runs):
    # In a process of its own, as above, with a real dataset; in a directory of models, so that picking one
    # would succeed.
    data = two_runs.parent / "data"
    write_dataset(generate(GenerateConfig(accounts=20, days=3, seed=0)), data, source={"generator": "test"})
    reads = [] if command == ["bench", "stream"] else ["--data", str(data)]
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", *command, *reads, "--model", ""],
        cwd=two_runs,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"txsentinel {command[0]}: model '': an empty model URI")
    )


@pytest.mark.parametrize("command", ["serve", "terminal-writer"])
def test_an_unreachable_broker_is_named_with_the_settings_that_point_at_it(
    command, unused_port, tiny_model, capsys
):
    model = ["--model", tiny_model] if command == "serve" else []
    argv = [command, *model, "--bootstrap-servers", f"127.0.0.1:{unused_port}", *FAST]
    line = refused(capsys, argv, 1)
    assert f"no answer from the Kafka cluster at 127.0.0.1:{unused_port}" in line
    assert "TXS_BOOTSTRAP_SERVERS" in line and "TXS_KAFKA_SECURITY_PROTOCOL" in line
    assert main([*argv, "--debug"]) == 1
    assert "KafkaTimeoutError" in capsys.readouterr().err


def test_the_bootstrap_servers_come_from_the_environment_too(unused_port, monkeypatch, capsys):
    monkeypatch.setenv("TXS_BOOTSTRAP_SERVERS", f"127.0.0.1:{unused_port}")
    monkeypatch.setenv("TXS_BOOTSTRAP_TIMEOUT_MS", "1000")
    line = refused(capsys, ["terminal-writer"], 1)
    assert f"no answer from the Kafka cluster at 127.0.0.1:{unused_port}" in line


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--set", "max_poll_records=0"], {}, "max_poll_records = 0, expected an integer >= 1 (from command line)"),
        ([], {"TXS_MAX_POLL_RECORDS": "many"}, "max_poll_records = 'many', expected an integer >= 1 (from TXS_MAX_POLL_RECORDS)"),
        (["--set", "max_poll_record=5"], {}, "unknown serve setting(s) ['max_poll_record'] among the flags"),
        (["--config", "/no/such/serve.yaml"], {}, "--config /no/such/serve.yaml: no such file"),
        ([], {"TXS_KAFKA_SECURITY_PROTOCOL": "TLS"}, "kafka_security_protocol = 'TLS', expected one of PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL"),
        (["--bootstrap-servers", "kafka:ninety"], {}, "bootstrap_servers = 'kafka:ninety', expected host:port"),
        (["--set", "topic_prefix=team a."], {}, "topic_prefix = 'team a.', expected letters, digits"),
        (["--set", "kafka_sasl_password=hunter2"], {}, "secrets come from the environment only: set TXS_KAFKA_SASL_PASSWORD"),
    ],
)  # fmt: skip
def test_a_bad_setting_or_broker_setting_is_refused_before_connecting(
    argv, env, message, monkeypatch, capsys
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    line = refused(capsys, ["terminal-writer", *argv], 2)
    assert message in line


def test_a_topic_the_cluster_refuses_to_create_or_read_says_which_and_what_to_change():
    cfg = load_serve_config(None, {"bootstrap_servers": "kafka-0:9092", "topic_prefix": "p-"}, env={})
    error = InvalidReplicationFactorError("Replication factor: 3 larger than available brokers: 1.")
    error.add_note(
        "creating topic 'p-transactions': 3 partitions, replication factor 3"
    )  # as topics.py adds it
    with pytest.raises(OperatorError) as refusal, kafka_errors(cfg):
        raise error
    line = str(refusal.value)
    assert line.startswith("the Kafka cluster at kafka-0:9092 refused a topic (")
    assert "creating topic 'p-transactions': 3 partitions, replication factor 3" in line
    assert "Set replication_factor (at most the broker count)" in line and "\n" not in line
    assert refusal.value.exit_code == 1 and refusal.value.__cause__ is error
    with (
        pytest.raises(OperatorError, match=r"refused this client .*Grant its principal the ACLs"),
        kafka_errors(cfg),
    ):
        raise TopicAuthorizationFailedError("p-scores")


def test_print_config_needs_no_broker_or_model_and_masks_secrets(tmp_path, monkeypatch, capsys):
    secret = tmp_path / "password"
    secret.write_text("hunter2\n")
    monkeypatch.setenv("TXS_KAFKA_SASL_PASSWORD_FILE", str(secret))
    monkeypatch.setenv("TXS_GROUP_ID", "scorers-eu")
    assert (
        main(["serve", "--print-config", "--model", "models:/txsentinel@champion", "--set", "threshold=1e-1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "hunter2" not in out
    assert 'group_id:                       "scorers-eu"  # TXS_GROUP_ID' in out
    assert "threshold:                      0.1  # command line" in out
    assert 'model_uri:                      "models:/txsentinel@champion"  # command line' in out
    assert '# kafka_sasl_password:          "********"  # TXS_KAFKA_SASL_PASSWORD_FILE' in out


# Every command that writes an output, with it at {out}
WRITING_COMMANDS = [
    ["generate", "--accounts", "5", "--days", "1", "--out", "{out}"],
    ["ingest", "{data}/transactions.parquet", "--mapping", "canonical", "--out", "{out}"],
    ["features", "--data", "{data}", "--out", "{out}/features.parquet"],
    ["train", "--data", "{data}", "--model", "logreg", "--set", "out_dir={out}"],
    ["backtest", "--data", "{data}", "--model", "models:/nope@champion", "--out", "{out}"],
    ["compare", "--out", "{out}"],
    ["schemas", "--out", "{out}"],
]


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory):
    data = tmp_path_factory.mktemp("data") / "data"
    write_dataset(generate(GenerateConfig(accounts=20, days=3, seed=0)), data, source={"generator": "test"})
    return data


@pytest.mark.parametrize("argv", WRITING_COMMANDS, ids=lambda argv: argv[0])
def test_an_output_that_is_a_file_is_refused_before_any_work(argv, small_dataset, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    argv = [arg.format(out=afile, data=small_dataset) for arg in argv]
    line = refused(capsys, argv, 2)
    assert f"{afile} is a file" in line
    assert afile.read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_a_feature_table_path_that_is_a_directory_and_a_dataset_over_other_files_are_refused(
    small_dataset, tmp_path, capsys
):
    line = refused(capsys, ["features", "--data", str(small_dataset), "--out", str(tmp_path)], 2)
    assert f"--out {tmp_path} is a directory; expected the path of a file to write" in line
    (tmp_path / "notes.txt").write_text("keep me")
    line = refused(capsys, ["generate", "--accounts", "5", "--days", "1", "--out", str(tmp_path)], 2)
    assert "holds ['notes.txt'], which are not a dataset's files" in line
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def bad_stores(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Tracking URIs no command can use, each with what its refusal says. Made in tmp_path."""
    (tmp_path / "afile").write_text("keep me")
    (tmp_path / "notes.db").write_text("not a database")
    (tmp_path / "adir").mkdir()
    return {
        "under a file": (f"sqlite:///{tmp_path}/afile/mlflow.db", f"{tmp_path}/afile is a file, so no store"),
        "not a database": (f"sqlite:///{tmp_path}/notes.db", f"{tmp_path}/notes.db is not a SQLite database"),
        # MLflow retried this one for over a minute, then failed in a SQL traceback.
        "a directory": (f"sqlite:///{tmp_path}/adir", f"{tmp_path}/adir is a directory; name the database"),
        "file store": (f"file://{tmp_path}/mlruns", "a file store, which MLflow"),
        "relative file store": ("mlruns", "unless MLFLOW_ALLOW_FILE_STORE=true; use a database store"),
        "unknown scheme": ("nosuch://store", "MLflow cannot open this store: "),
        "empty": ("", "MLFLOW_TRACKING_URI is set but empty"),
    }


@pytest.mark.parametrize(
    "kind",
    [
        "under a file",
        "not a database",
        "a directory",
        "file store",
        "relative file store",
        "unknown scheme",
        "empty",
    ],
)
def test_a_tracking_store_that_cannot_be_used_is_named_in_one_line(kind, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    uri, complaint = bad_stores(tmp_path)[kind]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    line = refused(capsys, ["promote", "--version", "1"], 2)
    assert complaint in line
    if uri:
        assert f"MLFLOW_TRACKING_URI={uri}: " in line
    assert (tmp_path / "afile").read_text() == "keep me" and not (tmp_path / "mlruns").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--data", "{never}", "--model", "lstm"],
        ["train", "--data", "{never}", "--model", "logreg"],
        ["backtest", "--data", "{never}", "--model", "{model}"],
        ["backtest", "--data", "{never}", "--model", "models:/txsentinel@champion", "--no-mlflow"],
        ["compare"],
        ["compare", "--live", "--bootstrap-servers", "127.0.0.1:1"],  # nothing listens: it must not ask
        ["serve", "--model", "models:/txsentinel@champion"],
    ],
    ids=["train", "train baseline", "backtest", "backtest registered", "compare", "compare live", "serve"],
)
def test_every_command_that_uses_the_tracking_store_refuses_a_bad_one_before_reading_data(
    argv, tiny_model, tmp_path, monkeypatch, capsys
):
    # A dataset that is not there: the store is refused first. train used to read the data and train, then fail.
    uri, complaint = bad_stores(tmp_path)["under a file"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    argv = [arg.format(never=tmp_path / "never-read", model=tiny_model) for arg in argv]
    line = refused(capsys, argv, 2)
    assert f"MLFLOW_TRACKING_URI={uri}: {complaint}" in line


def test_a_sqlite_store_in_a_directory_not_yet_made_is_made_there_as_mlflow_does(
    tmp_path, monkeypatch, capsys
):
    uri = f"sqlite:///{tmp_path}/stores/team/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    line = refused(capsys, ["promote", "--version", "1"], 2)
    assert f"no registered model 'txsentinel' in the MLflow tracking store {uri}" in line  # opened, empty
    assert (tmp_path / "stores" / "team" / "mlflow.db").is_file()


def test_a_tracking_server_that_does_not_answer_is_named_within_seconds(
    unused_port, tmp_path, monkeypatch, capsys
):
    # MLflow's client retried for minutes; train read the data and trained before it first asked.
    uri = f"http://127.0.0.1:{unused_port}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    started = time.monotonic()
    line = refused(capsys, ["train", "--data", str(tmp_path / "never-read"), "--model", "logreg"], 1)
    assert time.monotonic() - started < 30
    assert f"the MLflow tracking server at {uri} (MLFLOW_TRACKING_URI) refused or did not answer" in line
    assert "Connection refused" in line and line.endswith(
        "Check that it runs there and that MLFLOW_TRACKING_URI names it"
    )


@pytest.mark.parametrize("setting", ["MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"])
def test_a_database_server_that_does_not_answer_is_named_within_seconds_and_its_password_is_not(
    setting, unused_port, tmp_path, monkeypatch, capsys
):
    # No driver installed, the driver was named instead of the server that is not there; with one, SQLAlchemy
    # retried it for about 100 s. The URI was printed with its password.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    uri = f"postgresql://fraud:s3cret@127.0.0.1:{unused_port}/mlflow"
    monkeypatch.setenv(setting, uri)
    started = time.monotonic()
    line = refused(capsys, ["promote", "--version", "1"], 1)
    assert time.monotonic() - started < 15
    assert line == (
        f"txsentinel promote: the postgresql server at 127.0.0.1:{unused_port} ({setting}="
        f"{uri.replace('s3cret', '***')}) refused or did not answer within 10 s: Connection refused. Check that it "
        f"runs there and that {setting} names it"
    )


@pytest.mark.parametrize(
    ("name", "complaint"),
    [
        ("bad/name", "Invalid model name 'bad/name'. Names cannot contain '/' or ':'"),
        ("a:b", "Names cannot contain '/' or ':'"),
        ("..", "This name would resolve to '..'"),
        ("it's", "a registered model's name holds no quote (')"),
    ],
)
def test_a_registered_model_name_the_registry_refuses_is_named_before_any_data_is_read(
    name, complaint, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    argv = ["train", "--data", str(tmp_path / "never-read"), "--set", f"registered_model={name}"]
    line = refused(capsys, argv, 2)
    assert f"train config: registered_model = {name!r}: " in line and complaint in line
    line = refused(capsys, ["promote", "--version", "1", "--model-name", name], 2)
    assert f"--model-name {name!r}: " in line and complaint in line


UNWRITABLE = Path("/proc/txsentinel-test")  # refused to root as well: permission bits do not tell


@pytest.mark.parametrize("argv", WRITING_COMMANDS, ids=lambda argv: argv[0])
def test_an_output_where_nothing_can_be_created_is_refused_before_any_work(
    argv, small_dataset, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    argv = [arg.format(out=UNWRITABLE / "out", data=small_dataset) for arg in argv]
    line = refused(capsys, argv, 2)
    assert f"{UNWRITABLE}/out" in line and "nothing can be created in /proc (" in line
    assert line.endswith("choose a place this user can write")


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux's /proc")
def test_a_feature_table_file_that_opens_for_writing_is_written_whatever_its_directory(
    small_dataset, tmp_path, capsys
):
    # /proc/self/fd: a directory where no one, root included, creates anything, holding a file that opens (as
    # /dev/stdout for a user, or a file made in advance in a read-only directory). Its directory was asked, and
    # the file refused.
    table = tmp_path / "features.parquet"
    table.touch()
    fd = os.open(table, os.O_RDONLY)
    try:
        assert main(["features", "--data", str(small_dataset), "--out", f"/proc/self/fd/{fd}"]) == 0
    finally:
        os.close(fd)
    assert pl.read_parquet(table).height > 0
    closed = Path("/sys/devices/system/cpu/online")  # a file that does not open for writing, to root either
    if closed.is_file():
        line = refused(capsys, ["features", "--data", str(small_dataset), "--out", str(closed)], 2)
        assert f"--out {closed}: {closed} cannot be opened for writing (" in line


def test_a_dataset_that_fails_to_write_after_all_is_named_by_its_own_path(tmp_path, monkeypatch, capsys):
    def disk_full(frame, path, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(pl.DataFrame, "write_parquet", disk_full)
    out = tmp_path / "data"
    line = refused(capsys, ["generate", "--accounts", "20", "--days", "3", "--out", str(out)], 1)
    assert line.endswith(f"No space left on device; the dataset was not written: '{out}'")
    assert list(tmp_path.iterdir()) == []  # nor its staging directory, which the error used to name
