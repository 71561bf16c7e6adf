"""`bench quality --quick`: every model trained and tested on one dataset, one table, every run in JSON."""

import json
import math
from datetime import UTC, datetime

import polars as pl
import pytest

from pipeline.bench.quality import (
    COLUMNS,
    PERFECT,
    QualityConfig,
    Run,
    perfect_ranking,
    prequential_weeks,
    quality_table,
)
from pipeline.cli.main import main
from pipeline.data.dataset import read_dataset
from pipeline.data.splits import Period


def test_test_weeks_are_the_last_full_week_then_each_earlier_one():
    weeks = prequential_weeks(Period.parse("2026-01-01:2026-03-01"), folds=3)
    assert [w.start for w in weeks] == [datetime(2026, 2, d, tzinfo=UTC) for d in (22, 15, 8)]
    assert all(w.days == 7 for w in weeks)


@pytest.mark.slow
def test_quick_bench_trains_each_model_per_fold_and_tabulates_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    out = tmp_path / "quality"
    # In the Handbook's world (its three fraud scenarios, labels 7 days on: configs/generate/handbook.yaml).
    argv = ["bench", "quality", "--quick", "--world", "handbook", "--models", "lstm", "logreg"]
    argv += ["--folds", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = read_dataset(out / "data")
    assert set(data["scenario"]) == {"legit", "high_amount", "compromised_terminal", "compromised_account"}

    saved = json.loads((out / "quality.json").read_text())
    runs = [Run(**run) for run in saved["runs"]]
    # --quick trains one seed; each of the two folds tests its own week.
    assert sorted((r.model, r.seed, r.fold) for r in runs) == [
        ("logreg", 0, 0), ("logreg", 0, 1), ("lstm", 0, 0), ("lstm", 0, 1),
    ]  # fmt: skip
    assert len({r.test_period for r in runs}) == 2
    for run in runs:
        assert 0.0 <= run.metrics["test/ap"] <= 1.0
        assert run.metrics["train/seconds"] > 0
    table = quality_table(runs, ("lstm", "logreg"))
    assert table["runs"].to_list() == [2, 2]
    assert set(table.columns) == {"model", "runs", *(name for name, _ in COLUMNS)}
    lstm_ap = table.row(0, named=True)["ap"]
    assert "+-" in lstm_ap  # several runs: mean +- std
    assert lstm_ap in printed and "published protocol" in printed
    # The labels as scores, once a fold: no model's CP@100 on a week is above that week's ceiling.
    ceilings = {r.fold: r.metrics["test/cp_at_100"] for r in [Run(**run) for run in saved["ceilings"]]}
    assert sorted(ceilings) == [0, 1]
    for run in runs:
        assert run.metrics["test/cp_at_100"] <= ceilings[run.fold]
    assert PERFECT in printed


def test_perfect_ranking_is_cp_at_100_of_the_labels_under_the_published_exclusions():
    week = Period.parse("2026-02-22:2026-03-01")
    at = lambda day: datetime(2026, 2, day, 12, tzinfo=UTC)  # noqa: E731
    frame = pl.DataFrame(
        {
            # a: a fraud on the test week's second day; b: legit; c: a fraud in the training week, so the
            # protocol leaves c out of the test; d: frauds on two test days, caught on the first.
            "account_id": ["a", "b", "c", "c", "d", "d"],
            "ts": [at(23), at(23), at(10), at(24), at(22), at(25)],
            "is_fraud": [True, False, True, True, True, True],
        }
    )
    run = perfect_ranking(frame, week, fold=3)
    assert (run.model, run.fold, run.test_period) == (PERFECT, 3, str(week))
    # Per day: d (02-22), a (02-23), nothing new after; the mean over 7 days of hits / 100.
    assert run.metrics == {"test/cp_at_100": pytest.approx(2 / 100 / 7)}


def test_table_cells_are_means_and_leave_missing_metrics_blank():
    runs = [
        Run("lstm", 0, 0, "p", {"test/ap": 0.5, "train/seconds": 10.0}),
        Run("lstm", 1, 0, "p", {"test/ap": 0.7, "train/seconds": 12.0, "test/auc": math.nan}),
    ]
    row = quality_table(runs, ("lstm",)).row(0, named=True)
    assert row["ap"] == "0.600 +-0.141"
    assert row["train s"] == "11 +-1"
    assert row["auc"] == "-"


def test_unknown_models_and_empty_counts_are_refused():
    with pytest.raises(ValueError, match="unknown model"):
        QualityConfig(models=("gbm",))
    with pytest.raises(ValueError, match="seeds = 0"):
        QualityConfig(seeds=0)
