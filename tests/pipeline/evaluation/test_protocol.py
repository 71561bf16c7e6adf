"""The evaluation protocol: event metrics and Card Precision@k with its exclusions."""

from datetime import UTC, datetime

import numpy as np
import polars as pl
import pytest

from pipeline.data.splits import Period
from pipeline.evaluation.protocol import (
    DetectionMetrics,
    card_precision_at_k,
    detection_metrics,
    event_metrics,
    published_exclusions,
    ranked_card_precisions,
)


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


def test_ranked_card_precisions_break_ties_by_account_and_count_an_empty_day_as_none_caught():
    events = scored([("b", utc(2), 0.7, True), ("a", utc(2), 0.7, False), ("b", utc(3), 0.9, True)])
    days = [datetime(2026, 1, d, tzinfo=UTC) for d in (2, 3, 4)]
    events = events.with_columns(pl.col("ts").dt.truncate("1d").alias("day"))
    # Day 2: a and b tie at 0.7, a ranks first and fills k = 1: nothing caught. Day 3: b alone, caught.
    # Day 4: no events.
    assert ranked_card_precisions(events, days, k=1) == [0.0, 1.0, 0.0]
    # With k = 2 b is caught on day 2 and leaves day 3's ranking.
    assert ranked_card_precisions(events, days, k=2) == [0.5, 0.0, 0.0]


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
    assert card_precision_at_k(events, labels, test, k=2, exclusions="known_labels") == [0.5, 0.5]
    metrics = detection_metrics(events, labels, test, k=2)
    assert metrics.known_labels_cp_at_k == 0.5
    assert metrics.events == 8 and metrics.frauds == 5
    assert set(metrics.as_dict()) == {
        "test/auc",
        "test/ap",
        "test/cp_at_2",
        "test/events",
        "test/frauds",
        "test/all_events/auc",
        "test/all_events/ap",
        "test/known_labels/cp_at_2",
    }


def test_metrics_refuse_an_empty_test_period():
    with pytest.raises(ValueError, match="no scored events"):
        detection_metrics(
            scored([("a", utc(1), 0.5, False)]),
            scored([]).select("account_id"),
            Period.parse("2026-01-05:2026-01-06"),
        )


def protocol_dataset(rows) -> pl.DataFrame:
    return pl.DataFrame(
        rows,
        schema={"account_id": pl.String, "ts": pl.Datetime("us", "UTC"), "is_fraud": pl.Boolean},
        orient="row",
    )


def test_published_exclusions_are_the_training_week_then_one_more_delay_day_per_test_day():
    # Test 16-18 Jan, delay 7 days (9-15 Jan), so the training week is 2-8 Jan.
    test = Period.parse("2026-01-16:2026-01-19")
    frame = protocol_dataset(
        [
            ("week", utc(5), True),  # fraud in the training week: out on every test day
            ("old", utc(1), True),  # fraud before the training week: stays in
            ("d0", utc(9), True),  # fraud on the delay's first day: known from test day 1 on
            ("d1", utc(10), True),  # fraud on the delay's second day: known from test day 2 on
            ("late", utc(15), True),  # fraud on the delay's last day: known only after this test
            ("legit", utc(5), False),
        ]
    )
    out = published_exclusions(frame, test, delay_days=7)
    day = {i: datetime(2026, 1, 16 + i, tzinfo=UTC) for i in range(3)}
    assert out.rows() == [
        (day[0], "week"),
        (day[1], "d0"),
        (day[1], "week"),
        (day[2], "d0"),
        (day[2], "d1"),
        (day[2], "week"),
    ]


def test_published_metrics_leave_the_excluded_accounts_out_of_auc_ap_and_cp():
    test = Period.parse("2026-01-16:2026-01-18")
    history = protocol_dataset([("week", utc(5), True), ("d0", utc(9), True)])
    events = scored(
        [
            ("week", utc(16), 0.99, True),  # excluded: its fraud is in the training week
            ("d0", utc(16), 0.10, True),  # kept on day 0, excluded on day 1
            ("d0", utc(17), 0.98, True),
            ("a", utc(16), 0.90, False),
            ("b", utc(17), 0.80, True),
            ("c", utc(17), 0.20, False),
        ]
    )
    frame = pl.concat([history, events.select("account_id", "ts", "is_fraud")])
    metrics = detection_metrics(events, frame, test, k=1, delay_days=7)
    kept = events.filter(
        ~((pl.col("account_id") == "week") | ((pl.col("account_id") == "d0") & (pl.col("ts") >= utc(17, 0))))
    )
    assert metrics.events == kept.height == 4
    assert metrics.frauds == 2
    auc, ap = event_metrics(kept["score"].to_numpy(), kept["is_fraud"].to_numpy())
    assert (metrics.auc, metrics.ap) == (auc, ap)
    # day 0: a (legit, 0.90) tops d0 (0.10); day 1: b (0.80) tops c; d0's 0.98 is left out.
    assert metrics.cp_per_day == (0.0, 1.0)
    assert list(metrics.cp_per_day) == card_precision_at_k(events, frame, test, 1, "published", 7)
    all_auc, all_ap = event_metrics(events["score"].to_numpy(), events["is_fraud"].to_numpy())
    assert (metrics.all_events_auc, metrics.all_events_ap) == (all_auc, all_ap)
    assert metrics.ap != metrics.all_events_ap


@pytest.mark.parametrize(
    ("kept", "all_events_ap", "why"),
    [
        ((0, 0), float("nan"), "the published protocol leaves out every event of the test period"),
        (
            (5, 5),
            float("nan"),
            "every event of the test period 2026-01-10:2026-01-17 that the protocol keeps is",
        ),
        ((9, 0), float("nan"), "the test period 2026-01-10:2026-01-17 has no fraud labels (is_fraud)"),
        ((9, 0), 0.4, "2026-01-10:2026-01-17's frauds are all of accounts the published protocol leaves out"),
    ],
    ids=["none kept", "all fraud", "no fraud", "frauds left out"],
)
def test_undefined_metrics_say_why(kept, all_events_ap, why):
    events, frauds = kept
    nan = float("nan")
    metrics = DetectionMetrics(nan, nan, 0.0, 100, events, frauds, all_events_ap=all_events_ap)
    said = metrics.undefined(Period(utc(10, 0), utc(17, 0)))
    assert why in said and said.endswith("AUC and AP are undefined (NaN), and not logged")
    defined = DetectionMetrics(0.9, 0.5, 0.1, 100, events=9, frauds=2)
    assert defined.undefined(Period(utc(10, 0), utc(17, 0))) == ""
