"""The comparison: two tiny trained models (a sequence detector and a baseline) in one MLflow store."""

from pathlib import Path

import mlflow
import polars as pl
import pytest

from pipeline.cli.main import main
from pipeline.evaluation.backtest import BacktestConfig, backtest
from pipeline.evaluation.compare import compare, display_table
from pipeline.training.config import load_train_config
from pipeline.training.train import train
from tests.pipeline.workspaces import busy_dataset, run_read_only, use_fresh_store

PLOTS = (
    "pr_curves.png",
    "cp_at_100_per_day.png",
    "alert_budget.png",
    "ap_vs_state_bytes.png",
    "comparison.csv",
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    # A month of 120 accounts with frauds to learn and to test on.
    busy_dataset(root / "data", accounts=120, days=30, seed=4)
    with pytest.MonkeyPatch.context() as patch:
        use_fresh_store(patch, root)
        results = {}
        for model in ("lstm", "logreg"):
            cfg = load_train_config(
                root / "data",
                None,
                [
                    "max_epochs=1",
                    "chunk_events=16",
                    "batch_accounts=32",
                    "test_days=5",
                    "delay_days=3",
                    "validation_days=4",
                    "progress_bar=false",
                    "model_config.d_model=8",
                    "model_config.num_layers=1",
                ]
                if model == "lstm"
                else ["test_days=5", "delay_days=3", "progress_bar=false"],
                model=model,
                out_dir=root / "runs",
            )
            results[model] = train(cfg)
        yield root, results, patch


@pytest.mark.slow
def test_compare_tabulates_every_model_run_and_logs_its_plots(trained):
    root, results, _ = trained
    lstm, logreg = results["lstm"], results["logreg"]
    # A two-fold backtest of the LSTM: its quality columns become the fold mean with a std.
    report = backtest(
        BacktestConfig(
            data=root / "data", model_uri=lstm.model_uri, folds=2, k=100, test_period=None, progress_bar=False
        )
    )
    assert report.run_id == lstm.run_id

    table = compare(out=root / "comparison", data=root / "data")
    assert set(table["model"]) == {"lstm", "logreg"}  # the backtest's run is the LSTM's own, not a new row
    assert table["test/ap"].to_list() == sorted(table["test/ap"].to_list(), reverse=True)
    row = {r["model"]: r for r in table.iter_rows(named=True)}
    assert row["logreg"]["ap"] == pytest.approx(logreg.metrics["test/ap"])
    assert row["logreg"]["auc"] == pytest.approx(logreg.metrics["test/auc"])
    assert row["logreg"]["cp_at_100_std"] is None and row["logreg"]["family"] == "baseline"
    assert row["logreg"]["state_bytes_per_account"] is None
    assert row["lstm"]["ap"] == pytest.approx(report.summary["ap"][0])
    assert row["lstm"]["ap_std"] == pytest.approx(report.summary["ap"][1])
    assert row["lstm"]["evaluated"] == "backtest, 2 folds"
    for column, key in (
        ("parallel_vs_recurrent_max_abs", "test/parallel_vs_recurrent_max_abs"),
        ("state_bytes_per_account", "model/state_bytes_per_account"),
        ("step_us_per_event", "model/step_us_per_event"),
    ):
        assert row["lstm"][column] == pytest.approx(lstm.metrics[key])
    assert row["lstm"]["train_seconds"] > 0

    for name in PLOTS:
        assert (root / "comparison" / name).stat().st_size > 0
    runs = mlflow.search_runs(
        experiment_names=["txsentinel"], filter_string="tags.run_type = 'comparison'", output_format="list"
    )
    assert len(runs) == 1
    logged = {a.path for a in mlflow.MlflowClient().list_artifacts(runs[0].info.run_id, "comparison")}
    assert {f"comparison/{name}" for name in PLOTS} <= logged


def test_compare_sorts_costs_smallest_first_and_names_unknown_metrics(trained):
    root, _, _ = trained
    table = compare(metric="train/seconds", out=root / "by_time")
    seconds = table["train/seconds"].to_list()
    assert seconds == sorted(seconds)
    with pytest.raises(ValueError, match="no run of 'txsentinel' has metric 'test/nope'"):
        compare(metric="test/nope")
    with pytest.raises(ValueError, match="no MLflow experiment 'elsewhere'"):
        compare(experiment="elsewhere")
    assert isinstance(table, pl.DataFrame)


def test_the_table_prints_when_no_run_has_a_step_cost_or_a_quality_figure():
    # Per-event baselines log no step cost; a test week without legit events gives no AP: all-null columns,
    # which polars types Null, where rounding raised.
    row = {"model": "logreg", "family": "baseline", "auc": None, "ap": None, "cp_at_100": 0.1}
    row |= {f"{c}_std": None for c in ("auc", "ap", "cp_at_100")}
    row |= {"parallel_vs_recurrent_max_abs": None, "state_bytes_per_account": None, "step_us_per_event": None}
    row |= {"train_seconds": 3.26, "evaluated": "test", "run_id": "0123456789abcdef"}
    shown = display_table(pl.DataFrame([row, row]))
    assert shown["step_us"].to_list() == [None, None] and shown["ap"].to_list() == [None, None]
    assert shown["cp_at_100"].to_list() == ["0.1", "0.1"] and shown["train_s"].to_list() == [3.3, 3.3]


def test_a_dataset_to_plot_with_that_is_not_there_is_refused_before_the_store_is_read(
    tmp_path, monkeypatch, capsys
):
    # A store holding one model run, which compare used to tabulate and print before it looked at --data.
    use_fresh_store(monkeypatch, tmp_path)
    mlflow.set_experiment("txsentinel")
    with mlflow.start_run(tags={"model_family": "baseline", "detector": "logreg"}):
        mlflow.log_metric("test/ap", 0.5)
    capsys.readouterr()
    assert main(["compare", "--data", str(tmp_path / "nodata"), "--out", str(tmp_path / "out")]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and not (tmp_path / "out").exists()
    assert printed.err.startswith(f"txsentinel compare: {tmp_path / 'nodata'} is not a dataset directory")


COMPARE_TWO_WAYS = """
from pipeline.cli.main import main
print("exit", main(["compare", "--out", "{out}"]), flush=True)
print("exit", main(["compare", "--no-mlflow"]), flush=True)
"""


@pytest.fixture
def read_only_store(tmp_path, monkeypatch) -> Path:
    """A real store holding one model run, in `tmp_path`/store, which the test's processes are to only read;
    the test runs from `tmp_path`."""
    store = tmp_path / "store"
    store.mkdir()
    use_fresh_store(monkeypatch, store)
    mlflow.set_experiment("txsentinel")
    with mlflow.start_run(tags={"model_family": "baseline", "detector": "logreg"}):
        mlflow.log_metric("test/ap", 0.5)
    (store / "mlflow.db.lock").unlink()  # the lock file of whoever made the store is not there to reuse
    monkeypatch.chdir(tmp_path)
    return store


def test_a_store_this_user_can_only_read_is_compared_and_a_line_after_the_table_says_why_it_was_not_logged(
    read_only_store, tmp_path
):
    # A read-only copy of a team's store was refused, as a store compare cannot use is, for the run it logs.
    store = read_only_store
    done = run_read_only(store, COMPARE_TWO_WAYS.format(out=tmp_path / "out"))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    printed = done.stdout.split("\n")
    table_end = printed.index(next(line for line in printed if line.startswith("└")))
    why = printed[table_end + 1]
    assert why.startswith(
        f"the comparison was not logged to MLflow: MLFLOW_TRACKING_URI=sqlite:///{store}/mlflow.db: "
        f"cannot create {store}/mlflow.db.lock ("
    )
    assert why.endswith("), so this user can only read it")
    assert {p.name for p in (tmp_path / "out").iterdir()} == set(PLOTS)  # the plots, where --out asked
    # --no-mlflow: nothing to log, so nothing to say
    assert [line for line in printed if line.startswith(("exit", "the comparison"))] == [
        why,
        "exit 0",
        "exit 0",
    ]
    runs = mlflow.search_runs(experiment_names=["txsentinel"], output_format="list")
    assert [run.data.tags.get("run_type") for run in runs] == [None]  # the model run only


COMPARE_LIVE = """
from pipeline.cli.main import main
main(["compare", "--live", "--bootstrap-servers", "127.0.0.1:1"])
"""


@pytest.mark.slow
def test_a_store_this_user_can_only_read_is_no_reason_to_refuse_a_live_comparison(read_only_store):
    # Nothing listens at the broker's address: the live comparison goes on past the store to find that out.
    done = run_read_only(read_only_store, COMPARE_LIVE)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("txsentinel compare: no answer from the Kafka cluster at 127.0.0.1:1"), last
