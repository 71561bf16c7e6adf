"""Detection quality with the Fraud Detection Handbook's protocol (Le Borgne et al., ch. 3 and 4).

The published protocol, exactly: on test day i, the events of every account with a fraud in the training
week (the `TRAINING_WEEK_DAYS` days before the delay period) or in the delay period's first i days are left
out, of event ROC AUC and average precision as well as of Card Precision@k. CP@k ranks the remaining
accounts of each day by their highest event score, drops those already caught (a fraudulent account in an
earlier day's top k), and takes the precision of the top k; its figure is the mean over test days. A model
may train on more history; the exclusions still use the training week, so figures compare with the
published ones.

Beside it, two views a deployment cares about: AUC and AP over every test event (no account left out), and
CP@k whose exclusions are the frauds whose *label* was known (label_ts) before each day, whenever they
happened.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

import numpy as np
import polars as pl

from pipeline.data.splits import DAY, Period, ranking_exclusions
from pipeline.evaluation.metrics import event_metrics

TRAINING_WEEK_DAYS = 7  # the published protocol's training week, whose frauds' accounts leave the test
DELAY_DAYS = 7  # its delay period between training and test
Exclusions = Literal["published", "known_labels"]
# The largest k of CP@k, the accounts investigated a day: past any team's capacity, and a bound, so that an
# absurd k (1e20 overflows polars' top k) is refused by name where it is set.
MAX_K = 1_000_000
_EXCLUSIONS = {"day": pl.Datetime("us", "UTC"), "account_id": pl.String}


@dataclass(frozen=True)
class DetectionMetrics:
    """The published protocol's figures, then the deployment views beside them."""

    auc: float
    ap: float
    cp_at_k: float
    k: int
    events: int  # test events the published protocol keeps
    frauds: int
    cp_per_day: tuple[float, ...] = field(default=())
    all_events_auc: float = float("nan")
    all_events_ap: float = float("nan")
    known_labels_cp_at_k: float = float("nan")

    def as_dict(self, prefix: str = "test/") -> dict[str, float]:
        return {
            f"{prefix}auc": self.auc,
            f"{prefix}ap": self.ap,
            f"{prefix}cp_at_{self.k}": self.cp_at_k,
            f"{prefix}events": float(self.events),
            f"{prefix}frauds": float(self.frauds),
            f"{prefix}all_events/auc": self.all_events_auc,
            f"{prefix}all_events/ap": self.all_events_ap,
            f"{prefix}known_labels/cp_at_{self.k}": self.known_labels_cp_at_k,
        }

    def undefined(self, test: Period) -> str:
        """Why AUC and AP are NaN on `test`, in words, with what becomes of them; "" when they are defined."""
        if not math.isnan(self.ap):
            return ""
        if self.events == 0:
            why = f"the published protocol leaves out every event of the test period {test}"
        elif self.frauds == self.events:
            why = f"every event of the test period {test} that the protocol keeps is fraud"
        elif math.isnan(self.all_events_ap):
            why = f"the test period {test} has no fraud labels (is_fraud) among its scored events"
        else:
            why = (
                f"the test period {test}'s frauds are all of accounts the published protocol leaves out (a fraud "
                "in the training week or the delay before it)"
            )
        return f"{why}: AUC and AP are undefined (NaN), and not logged"


def undefined_note(metrics: DetectionMetrics, test: Period) -> str:
    """Why AUC and AP are undefined, in brackets after a space, for a line that prints them as nan; "" when they
    are defined."""
    reason = metrics.undefined(test)
    return f" ({reason})" if reason else ""


def no_fraud_to_test(frame: pl.DataFrame, test: Period, moved_by: str) -> str:
    """A warning, before any work, that `test` (of the dataset `frame`) has no fraud label, or only fraud, so
    that no AUC or AP can be measured on it; "" when it has both. `moved_by`: the settings that move `test`."""
    in_test = frame.lazy().filter(test.contains())
    frauds, events = in_test.select(pl.col("is_fraud").sum(), pl.len()).collect().row(0)
    if 0 < frauds < events:
        return ""
    held = "no fraud labels (is_fraud)" if frauds == 0 else "only fraud labels"
    return (
        f"the test period {test} has {held} among its {events} events: its AUC and AP will be undefined (NaN) "
        f"and not logged. To test on fraud, move the test period ({moved_by})"
    )


def published_exclusions(frame: pl.DataFrame, test: Period, delay_days: int = DELAY_DAYS) -> pl.DataFrame:
    """(day, account_id) pairs the published protocol leaves out: on test day i, every account with a
    fraudulent event in the training week or in the i days after it (the frauds known `delay_days` before
    the day; with a test longer than the delay, that reaches into the test's own first days).

    frame: account_id, ts, is_fraud — the dataset (true labels; label times play no part here).
    """
    if not {"ts", "is_fraud"} <= set(frame.columns):
        return pl.DataFrame(schema=_EXCLUSIONS)
    delay_start = test.start - timedelta(days=delay_days)
    week_start = delay_start - TRAINING_WEEK_DAYS * DAY
    first_fraud = (
        frame.filter(pl.col("is_fraud") & (pl.col("ts") >= week_start) & (pl.col("ts") < test.end))
        .group_by("account_id")
        .agg(pl.col("ts").min().alias("first_fraud"))
    )
    days = pl.DataFrame({"day": test.day_starts()}, schema={"day": _EXCLUSIONS["day"]})
    return (
        days.join(first_fraud, how="cross")
        .filter(pl.col("first_fraud") < pl.col("day") - timedelta(days=delay_days))
        .select("day", "account_id")
        .sort("day", "account_id")
    )


def exclusions_of(
    frame: pl.DataFrame, test: Period, kind: Exclusions = "published", delay_days: int = DELAY_DAYS
) -> pl.DataFrame:
    """(day, account_id) pairs left out of each test day: the published protocol's, or known labels'."""
    if kind == "published":
        return published_exclusions(frame, test, delay_days)
    if kind == "known_labels":
        if "label_ts" not in frame.columns:  # no label times: no account is known before a test day
            return pl.DataFrame(schema=_EXCLUSIONS)
        return ranking_exclusions(frame, test)
    raise ValueError(f"exclusions {kind!r}: expected 'published' or 'known_labels'")


_EVENT_DAY = pl.col("ts").dt.truncate("1d").alias("day")


def card_precision_at_k(
    scored: pl.DataFrame,
    labels: pl.DataFrame,
    test: Period,
    k: int = 100,
    exclusions: Exclusions = "published",
    delay_days: int = DELAY_DAYS,
) -> list[float]:
    """CP@k of each test day.

    scored: account_id, ts, score, is_fraud — the events of the test period with their scores.
    labels: the dataset (account_id, ts, is_fraud, label_ts), to know which accounts each day leaves out.
    """
    excluded = exclusions_of(labels, test, exclusions, delay_days)
    kept = scored.filter(test.contains()).with_columns(_EVENT_DAY)
    return ranked_card_precisions(
        kept.join(excluded, on=["day", "account_id"], how="anti"), test.day_starts(), k
    )


def ranked_card_precisions(events: pl.DataFrame, days: Iterable[datetime], k: int) -> list[float]:
    """The precision of each day's top k accounts, for each of `days` in order: accounts ranked by their
    highest event score of the day (ties by account id), an account caught (a fraud in an earlier day's top k)
    left out of the days after.

    events: day (the event's day start), account_id, score, is_fraud.
    """
    daily = events.group_by("day", "account_id").agg(pl.col("score").max(), pl.col("is_fraud").any())
    caught: set[str] = set()
    precisions = []
    for day in days:
        ranked = (
            daily.filter((pl.col("day") == day) & ~pl.col("account_id").is_in(list(caught)))
            .sort(["score", "account_id"], descending=[True, False])
            .head(k)
        )
        hits = ranked.filter(pl.col("is_fraud"))["account_id"].to_list()
        caught.update(hits)
        precisions.append(len(hits) / k)
    return precisions


def detection_metrics(
    scored: pl.DataFrame, labels: pl.DataFrame, test: Period, k: int = 100, delay_days: int = DELAY_DAYS
) -> DetectionMetrics:
    """All test metrics of one model on one test period (`scored` and `labels` as in card_precision_at_k)."""
    in_test = scored.filter(test.contains())
    if in_test.height == 0:
        raise ValueError(f"no scored events in the test period {test}")
    kept = in_test.with_columns(_EVENT_DAY).join(
        published_exclusions(labels, test, delay_days), on=["day", "account_id"], how="anti"
    )
    auc, ap = event_metrics(kept["score"].to_numpy(), kept["is_fraud"].to_numpy())
    all_auc, all_ap = event_metrics(in_test["score"].to_numpy(), in_test["is_fraud"].to_numpy())
    per_day = ranked_card_precisions(kept, test.day_starts(), k)  # the same exclusions as AUC and AP
    known_labels = card_precision_at_k(in_test, labels, test, k, "known_labels")
    return DetectionMetrics(
        auc=auc,
        ap=ap,
        cp_at_k=float(np.mean(per_day)),
        k=k,
        events=kept.height,
        frauds=int(kept["is_fraud"].sum()),
        cp_per_day=tuple(per_day),
        all_events_auc=all_auc,
        all_events_ap=all_ap,
        known_labels_cp_at_k=float(np.mean(known_labels)),
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
    "published_exclusions",
    "scenario_metrics",
]
