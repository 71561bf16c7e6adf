"""`txsentinel compare`: every trained model of an experiment in one table and a few plots.

One row per training run (runs tagged `model_family`; backtest and comparison runs are not models): detection
quality (AUC, AP, CP@100), the parallel-vs-recurrent error, state bytes per account, step cost per event and
training time. When a run also holds a prequential backtest (backtest/<metric>_mean and _std, written by
pipeline.evaluation.backtest with folds > 1), the quality columns show that mean and its std instead of the single
training test period, and `evaluated` says so: several folds are the better estimate.

The plots (PR curves overlaid, CP@100 per test day, AP against state size) are written to `out` and logged to
a new run named "comparison" in the same experiment, so the MLflow UI shows them beside the runs. A store this
user can only read (a read-only copy of a team's store) is compared all the same: the table is printed, the
plots written to `out`, and a line says why nothing was logged.
"""

import logging
import math
import tempfile
from pathlib import Path
from typing import Any

import mlflow
import polars as pl
from mlflow.tracking import MlflowClient
from sklearn.metrics import precision_recall_curve

from pipeline.data.dataset import read_dataset, require_labels
from pipeline.data.splits import Period, dataset_days
from pipeline.evaluation.plots import SCORES_ARTIFACT
from pipeline.evaluation.protocol import budget_curve, card_precision_at_k
from pipeline.evaluation.report_plots import line_plot, scatter_plot
from pipeline.registry.tracking_store import described_tracking, unwritable_tracking

log = logging.getLogger(__name__)

CP_K = 100
# Quality columns: table column -> metric key (after "test/" or "backtest/").
QUALITY = {"auc": "auc", "ap": "ap", "cp_at_100": f"cp_at_{CP_K}"}
COSTS = {
    "parallel_vs_recurrent_max_abs": "test/parallel_vs_recurrent_max_abs",
    "state_bytes_per_account": "model/state_bytes_per_account",
    "step_us_per_event": "model/step_us_per_event",
    "train_seconds": "train/seconds",
}
# Metrics where smaller is better: sorting by one of them puts the smallest first.
LOWER_IS_BETTER = {*COSTS.values(), "train/epochs"}


def _model_runs(client: MlflowClient, experiment: str) -> list:
    found = mlflow.get_experiment_by_name(experiment)
    if found is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ValueError(
            f"no MLflow experiment {experiment!r} in the {described_tracking()[0]} (it has {names}); "
            "train a model first (`txsentinel train`) or set MLFLOW_TRACKING_URI to the store that has it"
        )
    runs, token = [], None
    while True:  # paged: an experiment may hold more runs than one page
        page = client.search_runs([found.experiment_id], max_results=500, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            break
    return [r for r in runs if "model_family" in r.data.tags]


def _row(run) -> dict[str, Any]:
    metrics, tags = run.data.metrics, run.data.tags
    folds = int(metrics.get("backtest/folds", 0))
    row: dict[str, Any] = {
        "run_id": run.info.run_id,
        "model": tags.get("detector", run.info.run_name),
        "family": tags.get("model_family"),
        "evaluated": f"backtest, {folds} folds" if folds > 1 else "training test period",
    }
    for column, key in QUALITY.items():
        if folds > 1 and f"backtest/{key}_mean" in metrics:
            row[column] = metrics[f"backtest/{key}_mean"]
            row[f"{column}_std"] = metrics.get(f"backtest/{key}_std")
        else:
            row[column] = metrics.get(f"test/{key}")
            row[f"{column}_std"] = None
    for column, key in COSTS.items():
        row[column] = metrics.get(key)
    row["test_period"] = run.data.params.get("split.test")
    return row


def compare(
    experiment: str = "txsentinel",
    metric: str = "test/ap",
    out: Path | None = None,
    data: Path | None = None,
    log_to_mlflow: bool = True,
) -> pl.DataFrame:
    """The comparison table, best first by the run metric `metric` (smallest first for costs).

    data: the dataset the runs were tested on; with it, CP@100 per day leaves out accounts whose fraud was
    already known (the Handbook protocol). Without it the per-day plot drops only already-caught accounts.
    log_to_mlflow: log the table and plots as a run, unless the store is one this user can only read.
    """
    if data is not None:  # before the store is read and the table printed: the plots come last
        require_labels(data, "compare --data reads which frauds were known when")
    read_only = unwritable_tracking()  # opens the store, which the runs are read from
    logs = log_to_mlflow and read_only is None
    client = MlflowClient()
    runs = _model_runs(client, experiment)
    if not runs:
        raise ValueError(
            f"experiment {experiment!r} has no training runs (none tagged model_family) to compare"
        )
    if not any(metric in r.data.metrics for r in runs):
        known = sorted({k for r in runs for k in r.data.metrics})
        raise ValueError(f"no run of {experiment!r} has metric {metric!r}; metrics present: {known}")
    descending = metric not in LOWER_IS_BETTER
    runs.sort(key=lambda r: _sort_key(r.data.metrics.get(metric), descending))
    table = pl.DataFrame([_row(r) for r in runs], infer_schema_length=None)
    table = table.with_columns(pl.Series(metric, [r.data.metrics.get(metric) for r in runs], pl.Float64))

    print(f"{len(runs)} model run(s) in {experiment!r}, sorted by {metric}")
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=220, fmt_str_lengths=40):
        print(display_table(table))

    if log_to_mlflow and read_only:
        print(f"the comparison was not logged to MLflow: {read_only}")
    if out is None and not logs:
        return table
    with tempfile.TemporaryDirectory() as tmp:
        where = out if out is not None else Path(tmp)
        files = write_plots(table, client, where, data)
        table.write_csv(where / "comparison.csv")
        files.append(where / "comparison.csv")
        if not logs:
            return table
        with mlflow.start_run(
            experiment_id=mlflow.get_experiment_by_name(experiment).experiment_id,
            run_name="comparison",
            tags={"run_type": "comparison", "sorted_by": metric},
        ):
            mlflow.log_param("runs", ",".join(table["run_id"].to_list())[:500])
            for path in files:
                mlflow.log_artifact(str(path), artifact_path="comparison")
    return table


def _sort_key(value: float | None, descending: bool) -> tuple[bool, float]:
    missing = value is None or math.isnan(value)
    return (missing, 0.0 if missing else (-value if descending else value))


def display_table(table: pl.DataFrame) -> pl.DataFrame:
    """The table as printed: quality as "mean ± std" when folds exist, costs rounded."""

    def quality(column: str) -> pl.Expr:
        value = pl.col(column).cast(pl.Float64).round(4).cast(pl.String)  # Float64: a column all null is Null
        std = pl.col(f"{column}_std").cast(pl.Float64)
        return (
            pl.when(std.is_not_null())
            .then(pl.concat_str(value, pl.lit(" ± "), std.round(4).cast(pl.String)))
            .otherwise(value)
            .alias(column)
        )

    return table.select(
        "model",
        "family",
        *(quality(c) for c in QUALITY),
        pl.col("parallel_vs_recurrent_max_abs").alias("par_vs_rec"),
        pl.col("state_bytes_per_account").cast(pl.Int64, strict=False).alias("state_B"),
        pl.col("step_us_per_event").cast(pl.Float64).round(2).alias("step_us"),  # null for per-event models
        pl.col("train_seconds").cast(pl.Float64).round(1).alias("train_s"),
        "evaluated",
        pl.col("run_id").str.slice(0, 8),
    )


def _test_scores(client: MlflowClient, run_id: str, tmp: Path) -> pl.DataFrame | None:
    try:
        path = client.download_artifacts(run_id, SCORES_ARTIFACT, str(tmp))
    except Exception as error:  # MLflow raises several types for a missing artifact, by store
        log.warning("run %s has no %s (%s); it is left out of the curves", run_id, SCORES_ARTIFACT, error)
        return None
    return pl.read_parquet(path)


def write_plots(table: pl.DataFrame, client: MlflowClient, out: Path, data: Path | None = None) -> list[Path]:
    """pr_curves.png, cp_at_100_per_day.png, alert_budget.png, ap_vs_state_bytes.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    labels = None
    if data is not None:
        labels = read_dataset(data).select("account_id", "ts", "is_fraud", "label_ts")
    pr, cp, budget = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in table.iter_rows(named=True):
            scores = _test_scores(client, row["run_id"], Path(tmp) / row["run_id"])
            if scores is None or not scores["is_fraud"].any():
                continue
            name = f"{row['model']} ({row['run_id'][:6]})"
            precision, recall, _ = precision_recall_curve(
                scores["is_fraud"].to_numpy(), scores["score"].to_numpy()
            )
            ap = (
                "n/a" if row["ap"] is None else f"{row['ap']:.3f}"
            )  # no AP where the test week has no legit event
            pr[f"{name} AP {ap}"] = (recall, precision)
            test = _test_period(row["test_period"], scores)
            known = labels
            if known is None:  # no label times: no account counts as known before a test day
                known = scores.select("account_id", "is_fraud").with_columns(
                    pl.lit(None, pl.Datetime("us", "UTC")).alias("label_ts")
                )
            per_day = card_precision_at_k(scores, known, test, CP_K)
            cp[name] = (list(range(1, len(per_day) + 1)), per_day)
            curve = budget_curve(scores, known, test)
            budget[name] = (curve["budget_accounts_per_day"].to_list(), curve["precision"].to_list())
    files = [
        line_plot(
            pr,
            xlabel="recall",
            ylabel="precision",
            title="PR curves (test events)",
            path=out / "pr_curves.png",
        ),
        line_plot(
            cp,
            xlabel="test day",
            ylabel=f"CP@{CP_K}",
            title=f"CP@{CP_K} per test day"
            + ("" if labels is not None else " (known-fraud exclusion off: pass the dataset)"),
            path=out / f"cp_at_{CP_K}_per_day.png",
            marker="o",
        ),
        line_plot(
            budget,
            xlabel="alert budget: accounts reviewed per day",
            ylabel="precision (CP@budget)",
            title="alert budget curves (test period)",
            path=out / "alert_budget.png",
            marker="o",
        ),
    ]
    # Baselines keep no per-account state: only sequence detectors have a point here.
    points = {
        f"{r['model']} ({r['run_id'][:6]})": (r["state_bytes_per_account"], r["ap"])
        for r in table.iter_rows(named=True)
        if r["state_bytes_per_account"] is not None and r["ap"] is not None
    }
    files.append(
        scatter_plot(
            points,
            xlabel="state bytes per account",
            ylabel="AP",
            title="detection quality vs serving state",
            path=out / "ap_vs_state_bytes.png",
        )
    )
    return files


def _test_period(logged: str | None, scores: pl.DataFrame) -> Period:
    if logged:
        return Period.parse(logged)
    # An older run without the param: the whole days its test scores span.
    return dataset_days(scores)


__all__ = ["compare", "display_table", "write_plots"]
