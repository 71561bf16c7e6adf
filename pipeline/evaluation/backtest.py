"""`txsentinel backtest`: replay history through the live scorer and report with the Handbook protocol.

The replay runs `consumers.scoring.scorer.Scorer.replay` — the same micro-batched step path the Kafka service runs —
over every event up to the end of the latest test period, so the history before a test period warms the
account states, and fraud labels reach the terminal-risk features at their label_ts, as they would live.

Per test period (fold): event AUC and AP, CP@k (pipeline.evaluation.protocol.detection_metrics), per-scenario AP and
recall, alerts per day at the model's threshold, and an alert-budget curve. The budget is counted in
ACCOUNTS per day — an investigator reviews a card, not an event — so the curve's precision at budget N is
CP@N with the same exclusions (accounts with a known fraud, accounts already caught): the curve extends
CP@k to every k.

Each alert carries its reasons (consumers/scoring/explain.py), as the service's alert records do: the
scored frame holds them, `alert_reasons` lays them out one alert a row, and the report writes the latest
test period's to alert_reasons.csv.

Prequential folds: fold f tests the period shifted back by f test lengths. Scores are causal, so the one
replay up to the latest test end serves all folds. Earlier folds may overlap the period the model was
trained on; that is reported as a warning, not refused (a backtest of a deployed model is still useful).
"""

import json
import logging
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import polars as pl
from tqdm.auto import tqdm

from consumers.scoring.scorer import Scorer
from models.checks import is_integer
from pipeline.data.dataset import read_dataset, require_labels
from pipeline.data.splits import DAY, Period, dataset_days, prequential_test_periods
from pipeline.evaluation.protocol import (
    BUDGETS,
    MAX_K,
    DetectionMetrics,
    budget_curve,
    detection_metrics,
    no_fraud_to_test,
    scenario_metrics,
)
from pipeline.evaluation.report_plots import bar_plot, line_plot
from pipeline.evaluation.timelines import alert_reasons
from pipeline.registry.artifact import LoadedModel
from pipeline.registry.tracking import configure_tracking, load_model

log = logging.getLogger(__name__)

DEFAULT_TEST_DAYS = 14
METRIC_PREFIX = "backtest/"  # never test/: the training run's own test metrics stay as training logged them


@dataclass(frozen=True)
class BacktestConfig:
    data: Path
    model_uri: str
    test_period: Period | None = None  # None: the last DEFAULT_TEST_DAYS whole days of the data
    folds: int = 1
    k: int = 100
    out: Path | None = None
    batch_events: int = 500
    log_to_mlflow: bool = True
    progress_bar: bool = True
    reasons: int = 3  # top reasons per alert; 0: none

    def __post_init__(self):
        for name in ("folds", "k", "batch_events"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise ValueError(f"backtest config: {name} = {value!r}, expected an integer >= 1")
        if self.k > MAX_K:
            raise ValueError(f"backtest config: k = {self.k}, expected at most {MAX_K} (accounts a day)")
        if not is_integer(self.reasons) or self.reasons < 0:
            raise ValueError(
                f"backtest config: reasons = {self.reasons!r}, expected an integer >= 0 (0: none)"
            )


@dataclass(frozen=True)
class FoldResult:
    test: Period
    metrics: DetectionMetrics
    scenarios: dict[str, float]
    alerts_per_day: pl.DataFrame  # day, events, alert_events, alert_accounts, alert_precision
    budget: pl.DataFrame  # budget_accounts_per_day, precision

    def as_dict(self) -> dict[str, float]:
        """Flat metrics without prefix: auc, ap, cp_at_k, alerts_per_day, budget_precision/N, ap/<scenario>."""
        out = {
            "auc": self.metrics.auc,
            "ap": self.metrics.ap,
            f"cp_at_{self.metrics.k}": self.metrics.cp_at_k,
        }
        out["alerts_per_day"] = float(self.alerts_per_day["alert_events"].mean())
        out["alert_accounts_per_day"] = float(self.alerts_per_day["alert_accounts"].mean())
        for n, precision in self.budget.iter_rows():
            out[f"budget_precision/{n}"] = precision
        out.update({k.removeprefix("test/"): v for k, v in self.scenarios.items()})
        return out


@dataclass
class BacktestResult:
    model_uri: str
    threshold: float
    # every replayed event: event_id, account_id, ts, score, logit, alert, is_fraud (and reasons,
    # history_logit: Scorer.replay's, for the alerts)
    scored: pl.DataFrame
    folds: list[FoldResult]  # most recent first
    summary: dict[str, tuple[float, float]]  # metric -> (mean, std over folds; std 0 with one fold)
    run_id: str | None = None
    files: list[Path] = field(default_factory=list)

    def table(self) -> pl.DataFrame:
        """One row per metric: mean, std, then each fold's value (fold 0 the most recent)."""
        names = list(self.summary)
        columns: dict[str, Any] = {
            "metric": names,
            "mean": [self.summary[n][0] for n in names],
            "std": [self.summary[n][1] for n in names],
        }
        for i, fold in enumerate(self.folds):
            values = fold.as_dict()
            columns[f"fold{i} {fold.test}"] = [values.get(n, math.nan) for n in names]
        return pl.DataFrame(columns)

    def as_json(self) -> dict[str, Any]:
        return {
            "model_uri": self.model_uri,
            "threshold": self.threshold,
            "run_id": self.run_id,
            "summary": {k: {"mean": m, "std": s} for k, (m, s) in self.summary.items()},
            "folds": [
                {
                    "test_period": str(f.test),
                    "metrics": f.as_dict(),
                    "events": f.metrics.events,
                    "frauds": f.metrics.frauds,
                    "cp_per_day": list(f.metrics.cp_per_day),
                    "alerts_per_day": f.alerts_per_day.with_columns(
                        pl.col("day").dt.date().cast(pl.String)
                    ).to_dicts(),
                    "budget": f.budget.to_dicts(),
                }
                for f in self.folds
            ],
        }


def alerts_per_day(scored: pl.DataFrame, test: Period) -> pl.DataFrame:
    """Per test day at the scorer's threshold: events, alerting events and accounts, share of alerts that
    are fraud (null on a day without alerts)."""
    days = pl.DataFrame({"day": test.day_starts()}, schema={"day": pl.Datetime("us", "UTC")})
    daily = (
        scored.filter(test.contains())
        .with_columns(pl.col("ts").dt.truncate("1d").alias("day"))
        .group_by("day")
        .agg(
            pl.len().alias("events"),
            pl.col("alert").sum().alias("alert_events"),
            pl.col("account_id").filter(pl.col("alert")).n_unique().alias("alert_accounts"),
            (pl.col("alert") & pl.col("is_fraud")).sum().alias("_hits"),
        )
    )
    return (
        days.join(daily, on="day", how="left")
        .with_columns(pl.col("events", "alert_events", "alert_accounts", "_hits").fill_null(0))
        .with_columns(
            pl.when(pl.col("alert_events") > 0)
            .then(pl.col("_hits") / pl.col("alert_events"))
            .alias("alert_precision")
        )
        .drop("_hits")
        .sort("day")
    )


def _replay(
    scorer: Scorer, frame: pl.DataFrame, batch_events: int, progress_bar: bool, reasons: bool
) -> pl.DataFrame:
    if not progress_bar:
        return scorer.replay(frame, batch_events, reasons=reasons)
    with tqdm(total=frame.height, unit="ev", desc="replay", mininterval=1.0) as bar:

        def progress(done: int, total: int) -> None:
            bar.update(done - bar.n)

        return scorer.replay(frame, batch_events, progress, reasons=reasons)


def _warn_on_training_overlap(meta: dict[str, Any], periods: list[Period]) -> None:
    trained_test = meta.get("split", {}).get("test")
    if not trained_test:
        return
    try:
        model_test = Period.parse(trained_test)
    except ValueError:
        return
    early = [p for p in periods if p.start < model_test.start]
    if early:
        log.warning(
            "test period(s) %s start before the model's own test period %s: the model may have trained on "
            "them, so their metrics are optimistic",
            ", ".join(map(str, early)),
            model_test,
        )


def backtest(cfg: BacktestConfig, model: LoadedModel | None = None) -> BacktestResult:
    """Replay cfg.data through the live scorer of `model` (loaded from cfg.model_uri when not given)."""
    if cfg.log_to_mlflow:
        configure_tracking()  # the store opens before the replay: one it cannot use fails now, not at the end
    model = load_model(cfg.model_uri) if model is None else model
    require_labels(cfg.data, "a backtest needs known outcomes")
    frame = read_dataset(cfg.data)
    span = dataset_days(frame)
    last = cfg.test_period or Period(span.end - DEFAULT_TEST_DAYS * DAY, span.end)
    periods = prequential_test_periods(last, cfg.folds, span)
    _warn_on_training_overlap(model.meta, periods)
    for test in periods:
        if warning := no_fraud_to_test(frame, test, "--test-period, --folds"):
            log.warning(warning)

    scorer = Scorer(model, reasons=cfg.reasons)
    history = frame.filter(pl.col("ts") < last.end)
    scored = _replay(scorer, history, cfg.batch_events, cfg.progress_bar, cfg.reasons > 0)
    folds = []
    for test in periods:
        in_test = scored.filter(test.contains())
        metrics = detection_metrics(in_test, frame, test, cfg.k)
        folds.append(
            FoldResult(
                test=test,
                metrics=metrics,
                scenarios=scenario_metrics(in_test, frame),
                alerts_per_day=alerts_per_day(in_test, test),
                budget=budget_curve(in_test, frame, test),
            )
        )
    result = BacktestResult(cfg.model_uri, scorer.threshold, scored, folds, _summarize(folds))

    print(
        f"backtest of {cfg.model_uri} ({model.name}), threshold {scorer.threshold:.3f}, {cfg.folds} fold(s)"
    )
    with pl.Config(tbl_rows=-1, tbl_cols=-1, float_precision=4, tbl_width_chars=200):
        print(result.table())
    if cfg.out is not None:
        result.files = write_report(result, cfg.out)
    if cfg.log_to_mlflow:
        result.run_id = _log_to_mlflow(result, model.meta.get("run_id"), model.name)
    return result


def _summarize(folds: list[FoldResult]) -> dict[str, tuple[float, float]]:
    # Keys present in every fold only: a scenario absent from one fold has no comparable mean.
    per_fold = [f.as_dict() for f in folds]
    keys = [k for k in per_fold[0] if all(k in d for d in per_fold)]
    out = {}
    for key in keys:
        values = np.array([d[key] for d in per_fold], dtype=float)
        values = values[~np.isnan(values)]  # e.g. AUC of a fold without fraud: undefined, not zero
        if len(values) == 0:
            out[key] = (math.nan, math.nan)
        else:
            out[key] = (float(values.mean()), float(values.std()) if len(values) > 1 else 0.0)
    return out


def write_report(result: BacktestResult, out: Path) -> list[Path]:
    """backtest.json, the metric table as CSV, the latest test period's alerts with their reasons (when the
    backtest gave reasons) and plots: CP@k per day, alerts per day, budget curve."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "backtest.json", out / "backtest_table.csv"]
    files[0].write_text(json.dumps(result.as_json(), indent=2, default=str) + "\n")
    result.table().write_csv(files[1])
    if "reasons" in result.scored.columns:
        files.append(out / "alert_reasons.csv")
        latest = result.folds[0].test
        alert_reasons(result.scored, latest.start, latest.end).write_csv(files[-1])
    k = result.folds[0].metrics.k
    # Folds in time order on one axis: the most recent fold ends at the right.
    ordered = list(reversed(result.folds))
    days = [f"{d:%m-%d}" for f in ordered for d in f.test.day_starts()]
    cp = [v for f in ordered for v in f.metrics.cp_per_day]
    mean_cp, std_cp = result.summary[f"cp_at_{k}"]
    files.append(
        bar_plot(
            days,
            cp,
            xlabel="test day",
            ylabel=f"CP@{k}",
            title=f"CP@{k} per day (mean {mean_cp:.3f} ± {std_cp:.3f} over {len(result.folds)} fold(s))",
            path=out / "cp_at_k_per_day.png",
        )
    )
    alerts = pl.concat([f.alerts_per_day for f in ordered])
    files.append(
        bar_plot(
            days,
            alerts["alert_events"].to_list(),
            xlabel="test day",
            ylabel="alerting events",
            title=f"alerts per day at threshold {result.threshold:.3f}",
            path=out / "alerts_per_day.png",
        )
    )
    series = {
        f"fold{i} {f.test}": (f.budget["budget_accounts_per_day"].to_list(), f.budget["precision"].to_list())
        for i, f in enumerate(result.folds)
    }
    files.append(
        line_plot(
            series,
            xlabel="alert budget (accounts reviewed per day)",
            ylabel="precision (CP@budget)",
            title="alert-budget curve",
            path=out / "budget_curve.png",
            marker="o",
            log_x=True,
        )
    )
    return files


def _log_to_mlflow(result: BacktestResult, training_run_id: str | None, detector: str) -> str:
    """Log against the model's training run when this tracking store has it, else a new "backtest" run."""
    configure_tracking()
    client = mlflow.MlflowClient()
    run_id = None
    if training_run_id:
        try:
            run_id = client.get_run(training_run_id).info.run_id
        except mlflow.exceptions.MlflowException:
            log.info("training run %s is not in this tracking store; logging a new run", training_run_id)
    if run_id is None:
        experiment = mlflow.set_experiment("txsentinel")
        run_id = client.create_run(
            experiment.experiment_id,
            run_name="backtest",
            tags={"run_type": "backtest", "backtest_of": detector, "model_uri": result.model_uri},
        ).info.run_id

    metrics = {}
    for key, (mean, std) in result.summary.items():
        metrics[f"{METRIC_PREFIX}{key}"] = result.folds[0].as_dict()[key]  # the most recent fold
        if len(result.folds) > 1:
            metrics[f"{METRIC_PREFIX}{key}_mean"] = mean
            metrics[f"{METRIC_PREFIX}{key}_std"] = std
    metrics[f"{METRIC_PREFIX}folds"] = float(len(result.folds))
    metrics = {k: v for k, v in metrics.items() if not math.isnan(v)}
    with mlflow.start_run(run_id=run_id):
        mlflow.log_metrics(metrics)
        mlflow.set_tag("backtest_model_uri", result.model_uri)
        with tempfile.TemporaryDirectory() as tmp:
            for path in write_report(result, Path(tmp)):
                mlflow.log_artifact(str(path), artifact_path="backtest")
    return run_id


__all__ = [
    "BUDGETS",
    "BacktestConfig",
    "BacktestResult",
    "FoldResult",
    "alert_reasons",
    "alerts_per_day",
    "backtest",
    "budget_curve",
    "write_report",
]
