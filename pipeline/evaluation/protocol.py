"""Detection quality with the Fraud Detection Handbook's protocol (Le Borgne et al., ch. 4).

Event-level ROC AUC and average precision, and Card Precision@k: on each test day, rank accounts by their
highest event score of the day, leave out accounts whose fraud was already known before the day started
and accounts already caught (a fraudulent account in an earlier day's top k), and take the precision of the
top k. CP@k is the mean over test days.
"""

from dataclasses import dataclass, field

import numpy as np
import polars as pl

from pipeline.data.splits import Period, ranking_exclusions
from pipeline.evaluation.metrics import event_metrics


@dataclass(frozen=True)
class DetectionMetrics:
    auc: float
    ap: float
    cp_at_k: float
    k: int
    events: int
    frauds: int
    cp_per_day: tuple[float, ...] = field(default=())

    def as_dict(self, prefix: str = "test/") -> dict[str, float]:
        return {
            f"{prefix}auc": self.auc,
            f"{prefix}ap": self.ap,
            f"{prefix}cp_at_{self.k}": self.cp_at_k,
            f"{prefix}events": float(self.events),
            f"{prefix}frauds": float(self.frauds),
        }


def card_precision_at_k(
    scored: pl.DataFrame, labels: pl.DataFrame, test: Period, k: int = 100
) -> list[float]:
    """CP@k of each test day.

    scored: account_id, ts, score, is_fraud — the events of the test period with their scores.
    labels: account_id, is_fraud, label_ts — all labels, to know which frauds were known before each day.
    """
    excluded = ranking_exclusions(labels, test)
    daily = (
        scored.filter(test.contains())
        .with_columns(pl.col("ts").dt.truncate("1d").alias("day"))
        .group_by("day", "account_id")
        .agg(pl.col("score").max(), pl.col("is_fraud").any())
    )
    caught: set[str] = set()
    precisions = []
    for day in test.day_starts():
        known = set(excluded.filter(pl.col("day") == day)["account_id"].to_list())
        ranked = (
            daily.filter((pl.col("day") == day) & ~pl.col("account_id").is_in(list(known | caught)))
            .sort(["score", "account_id"], descending=[True, False])
            .head(k)
        )
        hits = ranked.filter(pl.col("is_fraud"))["account_id"].to_list()
        caught.update(hits)
        precisions.append(len(hits) / k)
    return precisions


def detection_metrics(
    scored: pl.DataFrame, labels: pl.DataFrame, test: Period, k: int = 100
) -> DetectionMetrics:
    """All test metrics of one model on one test period (`scored` as in card_precision_at_k)."""
    in_test = scored.filter(test.contains())
    if in_test.height == 0:
        raise ValueError(f"no scored events in the test period {test}")
    auc, ap = event_metrics(in_test["score"].to_numpy(), in_test["is_fraud"].to_numpy())
    per_day = card_precision_at_k(in_test, labels, test, k)
    return DetectionMetrics(
        auc=auc,
        ap=ap,
        cp_at_k=float(np.mean(per_day)),
        k=k,
        events=in_test.height,
        frauds=int(in_test["is_fraud"].sum()),
        cp_per_day=tuple(per_day),
    )


BUDGETS = (10, 25, 50, 100, 200, 500)  # accounts a fraud team reviews per day


def budget_curve(scored: pl.DataFrame, labels: pl.DataFrame, test: Period, budgets=BUDGETS) -> pl.DataFrame:
    """Precision of the top-N accounts per day (CP@N, same exclusions as CP@k), mean over the days."""
    rows = [(n, float(np.mean(card_precision_at_k(scored, labels, test, n)))) for n in budgets]
    return pl.DataFrame(rows, schema=["budget_accounts_per_day", "precision"], orient="row")


def scenario_metrics(scored: pl.DataFrame, frame: pl.DataFrame) -> dict[str, float]:
    """Per fraud scenario (generated data knows them; ingested data usually does not, and gets nothing):
    AP of that scenario's frauds against all legit events (other scenarios' frauds left out), and the
    share of its frauds among the top 1% of scores. For drifting accounts, which are legit by design, the
    share of their events in that top 1% — an alert rate that should stay near the 1% base rate or below."""
    if "scenario" not in frame.columns or scored.height == 0:
        return {}
    threshold = float(np.quantile(scored["score"].to_numpy(), 0.99))
    joined = scored.join(frame.select("event_id", "scenario"), on="event_id", how="left")
    legit = joined.filter(~pl.col("is_fraud"))
    out = {}
    for (scenario,), group in joined.filter(pl.col("is_fraud")).group_by("scenario"):
        both = pl.concat([legit, group])
        out[f"test/ap/{scenario}"] = event_metrics(both["score"].to_numpy(), both["is_fraud"].to_numpy())[1]
        out[f"test/recall_top1pct/{scenario}"] = float((group["score"] >= threshold).mean())
    drift = joined.filter(pl.col("scenario") == "drift")
    if drift.height:
        out["test/alert_rate_top1pct/drift"] = float((drift["score"] >= threshold).mean())
    return out


__all__ = [
    "DetectionMetrics",
    "card_precision_at_k",
    "detection_metrics",
    "event_metrics",
    "scenario_metrics",
]
