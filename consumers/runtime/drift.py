"""Input and score drift over a sliding window of scored events, and the alert rate against the model's budget.

Per committed batch, `observe` bins each feature column and the scores into the model's reference bins
(pipeline/features/drift_reference.py) with one searchsorted per feature and ONE bincount over all of them
(each feature's bins offset into one flat count vector), and keeps the batch's counts and a copy of its event
times in a deque; batches leave from the old end once the window holds `window_events` without them, so the
window keeps fewer than `window_events` + one batch of times (160 KB for 20,000). `publish` turns the window's
counts into PSIs and gauges: it runs every few seconds, not per batch, so the per-batch cost is the binning
(~0.4 ms for 500 events and 27 features of ten bins each, on one core of the development VM) and ~1 us for the
copy of the times; the alert rate's two order statistics cost ~0.15 ms a publish over 20,000 events.

The alert rate is the window's alerts per event times its events per day of EVENT time (not the clock: a
replay of history scores days in minutes), and the events per day come from the bulk of the window:
`events_per_day` measures the span between its 10th and 90th percentile event times and counts the events
between them. Producers date events, and a valid event may be years old (a late one, or a replay of
2000-01-01) or up to max_ts_skew_s ahead of the clock, which in a replay is years after the stream: over the
whole span (newest minus oldest) ONE such event would stretch the window to years and read an alert storm as
half an alert a day. Trimmed at the deciles, stragglers on either side do not move the rate as long as they
are fewer than a tenth of the window's events on that side (2,000 of the default 20,000: four batches of the
default 500). The price is the rate of the middle 80% of the window's events instead of all of them: on
steady traffic the two agree (the estimate counts the gaps between events, so evenly spaced events give their
rate exactly), and at 20,000 events the 16,000 gaps kept leave a random stream's rate a standard error of
0.8%.

A model without references (trained before they existed, or a baseline) still serves: its PSIs are NaN and
txsentinel_drift_reference says 0, which `txsentinel monitor` prints as "no reference".
"""

import logging
import math
from collections import deque
from typing import Any, NamedTuple

import numpy as np

from consumers.runtime.metrics import Metrics
from pipeline.features.drift_reference import bin_index, check_reference, psi

log = logging.getLogger(__name__)

DAY_US = 86_400_000_000
TRIM = 0.1  # the share of a window's events left out at each end of its event times for the rate
MIN_SPAN_US = 60_000_000  # the bulk of a window spans less event time than this: too short to judge a rate


def events_per_day(ts_us: np.ndarray) -> float:
    """Events per day of event time over the bulk of ts_us [N] (any order): the gaps between the 10th and the
    90th percentile event times, over the span between them. NaN while that span is under a minute: no
    events, one event, or a bulk dated within one minute."""
    n = len(ts_us)
    lo = int(n * TRIM)
    hi = n - 1 - lo
    if hi <= lo:
        return math.nan
    bulk = np.partition(ts_us, (lo, hi))
    span_us = int(bulk[hi]) - int(bulk[lo])
    if span_us < MIN_SPAN_US:
        return math.nan
    return (hi - lo) * DAY_US / span_us


class _Batch(NamedTuple):
    events: int
    counts: np.ndarray  # [sum of bins] every feature's bins, then the scores'
    alerts: int
    ts_us: np.ndarray  # [M] int64 event times


class DriftWindow:
    """The last `window_events` scored events, as bin counts.

    names: the features' names in column order; references: spec.drift_reference ({name: reference});
    score_reference: meta["score_reference"] or None; alert_budget_per_day: None when the model has none.
    """

    def __init__(
        self,
        names: tuple[str, ...],
        references: dict[str, Any],
        score_reference: dict | None,
        threshold: float,
        alert_budget_per_day: float | None,
        window_events: int,
    ):
        if window_events < 1:
            raise ValueError(f"drift window of {window_events} events: expected at least 1")
        self.names = names
        self.window_events = window_events
        self.threshold = threshold
        self.alert_budget_per_day = alert_budget_per_day
        self.has_features = bool(references)
        missing = [name for name in names if name not in references]
        if references and missing:
            raise ValueError(
                f"the feature spec's drift reference lacks {', '.join(missing)}: the artifact is inconsistent; "
                "retrain or re-export it"
            )
        self.edges: list[np.ndarray] = []
        expected = []
        for name in names if references else ():
            edges, proportions = check_reference(name, references[name])
            self.edges.append(edges)
            expected.append(proportions)
        self.has_scores = score_reference is not None
        if score_reference is not None:
            edges, proportions = check_reference("the scores", score_reference)
            self.score_edges = edges
            expected.append(proportions)
        sizes = [len(p) for p in expected]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # [bins of each + 1]
        self.expected = expected
        self.batches: deque[_Batch] = deque()
        self.counts = np.zeros(int(self.offsets[-1]), dtype=np.int64)
        self.events = self.alerts = 0

    def observe(self, features: np.ndarray, scores: np.ndarray, ts_us: np.ndarray) -> None:
        """Add one batch: features [M, F] float64 (before normalisation), scores [M] probabilities, ts_us [M]."""
        m = len(scores)
        if m == 0:
            return
        columns = self.edges if self.has_features else []
        index = [bin_index(edges, features[:, f]) + self.offsets[f] for f, edges in enumerate(columns)]
        if self.has_scores:
            index.append(bin_index(self.score_edges, scores) + self.offsets[len(columns)])
        counts = (
            np.bincount(np.concatenate(index), minlength=len(self.counts))
            if index
            else np.zeros(0, dtype=np.int64)
        )
        alerts = int((scores >= self.threshold).sum())
        self.batches.append(_Batch(m, counts, alerts, np.array(ts_us, dtype=np.int64)))
        self.counts += counts
        self.events += m
        self.alerts += alerts
        while self.events - self.batches[0].events >= self.window_events:
            old = self.batches.popleft()
            self.counts -= old.counts
            self.events -= old.events
            self.alerts -= old.alerts

    def feature_psi(self) -> dict[str, float]:
        """{feature: PSI} over the window; {} without a reference."""
        if not self.has_features:
            return {}
        return {
            name: psi(self.expected[f], self.counts[self.offsets[f] : self.offsets[f + 1]])
            for f, name in enumerate(self.names)
        }

    def score_psi(self) -> float:
        if not self.has_scores:
            return math.nan
        return psi(self.expected[-1], self.counts[self.offsets[-2] : self.offsets[-1]])

    def alerts_per_day(self) -> float:
        """The window's alerts per event times its events per day of event time (`events_per_day`: robust to
        stragglers dated far from the rest); NaN where events_per_day is."""
        if not self.events:
            return math.nan
        ts_us = np.concatenate([b.ts_us for b in self.batches])  # [events]
        return self.alerts / self.events * events_per_day(ts_us)

    def publish(self, metrics: Metrics) -> None:
        """Set the drift gauges from the window's counts."""
        by_feature = self.feature_psi()
        metrics.set_labelled("txsentinel_feature_psi", by_feature)
        metrics.set("txsentinel_feature_psi_max", max(by_feature.values(), default=math.nan))
        metrics.set("txsentinel_score_psi", self.score_psi())
        metrics.set_labelled(
            "txsentinel_drift_reference",
            {"features": float(self.has_features), "scores": float(self.has_scores)},
        )
        metrics.set("txsentinel_drift_window_events", self.events)
        metrics.set("txsentinel_window_alerts_per_day", self.alerts_per_day())
        budget = self.alert_budget_per_day
        metrics.set("txsentinel_alert_budget_per_day", math.nan if budget is None else budget)


def drift_window(spec, meta: dict, threshold: float, window_events: int) -> DriftWindow:
    """The DriftWindow of a model: its feature spec's references, its meta's score reference and budget."""
    budget = (meta.get("alert_budget") or {}).get("alert_budget_per_day")
    window = DriftWindow(
        spec.names,
        spec.drift_reference,
        meta.get("score_reference"),
        threshold,
        None if budget is None else float(budget),
        window_events,
    )
    if not window.has_features or not window.has_scores:
        log.info(
            "drift: no reference for%s%s; those PSIs are NaN (train the model again to have them)",
            "" if window.has_features else " features",
            "" if window.has_scores else " scores",
        )
    return window
