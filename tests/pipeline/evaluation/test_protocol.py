"""The evaluation protocol: event metrics and Card Precision@k with its exclusions."""

from datetime import UTC, datetime

import numpy as np
import polars as pl
import pytest

from pipeline.data.splits import Period
from pipeline.evaluation.protocol import card_precision_at_k, detection_metrics, event_metrics


def utc(day: int, hour: int = 12) -> datetime:
    return datetime(2026, 1, day, hour, tzinfo=UTC)


def scored(rows):
    return pl.DataFrame(
        rows,
        schema={
            "account_id": pl.String,
            "ts": pl.Datetime("us", "UTC"),
            "score": pl.Float64,
            "is_fraud": pl.Boolean,
        },
        orient="row",
    )


def test_event_metrics_match_their_definitions_and_are_nan_on_one_class():
    auc, ap = event_metrics(np.array([0.9, 0.8, 0.1, 0.2]), np.array([1, 0, 0, 1]))
    # fraud-legit pairs ranked right: (0.9, 0.8), (0.9, 0.1), (0.2, 0.1) of 4.
    assert auc == pytest.approx(3 / 4)
    # ranked 0.9 F, 0.8 L, 0.2 F: precision 1/1 at the first fraud, 2/3 at the second.
    assert ap == pytest.approx((1 + 2 / 3) / 2)
    assert np.isnan(event_metrics(np.array([0.1, 0.2]), np.array([0, 0]))[0])


def test_cp_at_k_ranks_accounts_by_their_best_event_and_drops_known_and_caught_accounts():
    test = Period.parse("2026-01-02:2026-01-04")
    events = scored(
        [
            # day 2: a (fraud) scores highest through its best event; b legit; c fraud but low.
            ("a", utc(2), 0.2, False),
            ("a", utc(2, 13), 0.95, True),
            ("b", utc(2), 0.9, False),
            ("c", utc(2), 0.1, True),
            # day 3: a was caught on day 2 and leaves the ranking; c's fraud became known before day 3.
            ("a", utc(3), 0.99, True),
            ("c", utc(3), 0.98, True),
            ("b", utc(3), 0.5, False),
            ("d", utc(3), 0.4, True),
        ]
    )
    labels = pl.DataFrame(
        {
            "account_id": ["a", "c", "d"],
            "is_fraud": [True, True, True],
            "label_ts": [utc(9), utc(2, 20), utc(9)],
        }
    )
    assert card_precision_at_k(events, labels, test, k=2) == [0.5, 0.5]
    metrics = detection_metrics(events, labels, test, k=2)
    assert metrics.cp_at_k == 0.5
    assert metrics.events == 8 and metrics.frauds == 5
    assert set(metrics.as_dict()) == {"test/auc", "test/ap", "test/cp_at_2", "test/events", "test/frauds"}


def test_metrics_refuse_an_empty_test_period():
    with pytest.raises(ValueError, match="no scored events"):
        detection_metrics(
            scored([("a", utc(1), 0.5, False)]),
            scored([]).select("account_id"),
            Period.parse("2026-01-05:2026-01-06"),
        )
