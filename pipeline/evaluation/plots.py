"""Evaluation plots logged as MLflow artifacts: the PR curve and CP@k per test day."""

import tempfile
from pathlib import Path

import mlflow
import polars as pl
from sklearn.metrics import precision_recall_curve

from pipeline.evaluation.protocol import DetectionMetrics
from pipeline.evaluation.report_plots import bar_plot, line_plot

SCORES_ARTIFACT = "evaluation/test_scores.parquet"


def log_evaluation(scored: pl.DataFrame, metrics: DetectionMetrics, title: str) -> None:
    """Plots under `plots/`, and every test event's score (event_id, account_id, ts, score, is_fraud) as
    SCORES_ARTIFACT, so a comparison or a reloaded model can be checked against what training saw."""
    with tempfile.TemporaryDirectory() as tmp:
        for path in write_evaluation_plots(scored, metrics, title, Path(tmp)):
            mlflow.log_artifact(str(path), artifact_path="plots")
        scores = Path(tmp) / Path(SCORES_ARTIFACT).name
        scored.write_parquet(scores)
        mlflow.log_artifact(str(scores), artifact_path=str(Path(SCORES_ARTIFACT).parent))


def write_evaluation_plots(
    scored: pl.DataFrame, metrics: DetectionMetrics, title: str, out: Path
) -> list[Path]:
    pr = {}
    if scored["is_fraud"].any():
        precision, recall, _ = precision_recall_curve(
            scored["is_fraud"].to_numpy(), scored["score"].to_numpy()
        )
        pr[title] = (recall, precision)
    days = len(metrics.cp_per_day)
    return [
        line_plot(
            pr,
            xlabel="recall",
            ylabel="precision",
            title=f"{title}: PR curve (AP {metrics.ap:.3f})",
            path=out / "pr_curve.png",
        ),
        bar_plot(
            [str(d) for d in range(1, days + 1)],
            metrics.cp_per_day,
            xlabel="test day",
            ylabel=f"CP@{metrics.k}",
            title=f"{title}: CP@{metrics.k} per day (mean {metrics.cp_at_k:.3f})",
            path=out / "cp_at_k_per_day.png",
        ),
    ]
