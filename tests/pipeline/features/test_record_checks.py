"""The bounds a restored featurizer record is held to (pipeline/features/record_checks.py): every record the
folds write keeps them, whatever the events, their order and batching, and the labels; a record that breaks
one is refused by the field that breaks it."""

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.data.generate import GenerateConfig, generate
from pipeline.data.schema import MAX_AMOUNT
from pipeline.features.definitions import DAY_US, RING_DAYS
from pipeline.features.record_checks import record_fault, record_faults
from pipeline.features.state import ACCOUNT_STATE, MAX_EPOCH_DAY, TERMINAL_STATE
from pipeline.features.stream import StreamingFeaturizer
from pipeline.features.stream_batches import EventBatch, LabelBatch, replay_batches

DAY = 20_500  # an epoch day in 2026


def all_records(featurizer: StreamingFeaturizer) -> tuple[np.ndarray, np.ndarray]:
    tables = (featurizer.accounts, featurizer.terminals)
    return tuple(t.records[np.fromiter(t.slot_of.values(), dtype=np.int64)] for t in tables)


def assert_sound(featurizer: StreamingFeaturizer) -> None:
    for records in all_records(featurizer):
        faults = np.flatnonzero(record_faults(records))
        assert not len(faults), record_fault(records[faults[0]])


def events(accounts, terminals, days, amounts, seconds=None) -> EventBatch:
    seconds = np.zeros(len(days), dtype=np.int64) if seconds is None else np.asarray(seconds)
    ts = np.asarray(days, dtype=np.int64) * DAY_US + seconds * 1_000_000
    return EventBatch(list(accounts), list(terminals), ts, np.asarray(amounts, dtype=np.float64))


def test_the_records_of_a_generated_history_pass_in_time_order_and_shuffled_with_repeated_labels():
    frame = generate(GenerateConfig(accounts=150, days=50, seed=4)).sort("ts", "event_id")
    in_order = StreamingFeaturizer()
    for batch, labels in replay_batches(frame, 400):
        in_order.transform(batch, labels)
    assert_sound(in_order)

    rng = np.random.default_rng(8)
    rows = frame[rng.permutation(frame.height)]  # late events by the thousand
    fraud = rows.filter(rows["is_fraud"])
    shuffled = StreamingFeaturizer()
    for start in range(0, rows.height, 777):
        part = rows.slice(start, 777)
        shuffled.transform(
            EventBatch(
                part["account_id"].to_list(),
                part["terminal_id"].to_list(),
                part["ts"].dt.epoch("us").to_numpy(),
                part["amount"].to_numpy(),
            )
        )
        labels = fraud.sample(min(fraud.height, 40), seed=start)  # repeats, in any order
        shuffled.observe_labels(
            LabelBatch(
                labels["terminal_id"].to_list(),
                labels["label_ts"].dt.epoch("us").to_numpy() - rng.integers(0, 40, labels.height) * DAY_US,
                np.ones(labels.height, dtype=bool),
                labels["event_id"].to_list(),
                labels["account_id"].to_list(),
            )
        )
    assert_sound(shuffled)


def test_an_account_at_the_largest_amount_every_event_keeps_its_bounds():
    # The bounds hold exactly, float rounding of long sums included: 60,000 events of one day at MAX_AMOUNT.
    featurizer = StreamingFeaturizer()
    for _ in range(3):
        featurizer.transform(events(["a"] * 20_000, ["t"] * 20_000, [DAY] * 20_000, [MAX_AMOUNT] * 20_000))
    featurizer.transform(events(["a", "b"], ["t", "t"], [DAY + 1, DAY], [MAX_AMOUNT, 0.0]))
    assert_sound(featurizer)
    record = np.frombuffer(featurizer.accounts.get_bytes("a"), dtype=ACCOUNT_STATE)[0]
    assert record["sum_log_amount"] == pytest.approx(60_001 * np.log1p(MAX_AMOUNT), rel=1e-12)


_amounts = st.one_of(
    st.sampled_from([0.0, 1.0, MAX_AMOUNT]), st.floats(0.0, MAX_AMOUNT, allow_nan=False, allow_infinity=False)
)
_event = st.tuples(
    st.sampled_from("abc"),
    st.sampled_from(["t0", "t1", "t2"]),
    st.integers(0, 80),
    st.integers(0, 86_399),
    _amounts,
)
_label = st.tuples(st.sampled_from(["t0", "t1", "t2"]), st.integers(0, 90), st.integers(0, 50), st.booleans())


@settings(max_examples=80, deadline=None)
@given(
    batches=st.lists(
        st.tuples(st.lists(_event, min_size=1, max_size=12), st.lists(_label, max_size=5)), max_size=8
    )
)
def test_any_events_in_any_order_and_any_labels_fold_to_records_that_pass(batches):
    featurizer = StreamingFeaturizer()
    for batch, labels in batches:
        accounts, terminals, days, seconds, amounts = zip(*batch, strict=True)
        featurizer.transform(events(accounts, terminals, np.asarray(days) + DAY, amounts, seconds))
        if labels:
            terminals, days, event, verdicts = zip(*labels, strict=True)
            featurizer.observe_labels(
                LabelBatch(
                    list(terminals),
                    (np.asarray(days) + DAY) * DAY_US,
                    np.array(verdicts, dtype=bool),
                    [f"e{e}" for e in event],
                    ["a"] * len(labels),
                )
            )
    assert_sound(featurizer)


def test_a_terminal_past_its_remembered_reports_keeps_its_bounds():
    # Reports, repeats and withdrawals of 70 events, in any order.
    featurizer = StreamingFeaturizer()
    featurizer.transform(events(["a"], ["t"], [DAY], [3.0]))
    rng = np.random.default_rng(2)
    for _ in range(6):
        n = 30
        featurizer.observe_labels(
            LabelBatch(
                ["t"] * n,
                (DAY + rng.integers(0, 90, n)) * DAY_US,
                rng.random(n) < 0.8,
                [f"e{i}" for i in rng.integers(0, 70, n)],
                ["a"] * n,
            )
        )
    assert_sound(featurizer)


def folded() -> StreamingFeaturizer:
    """Account "a" with events on three days at two terminals; terminal "t" with reports on three days."""
    featurizer = StreamingFeaturizer()
    featurizer.transform(
        events(["a", "a", "a", "b"], ["t", "u", "t", "t"], [DAY, DAY, DAY + 2, DAY + 3], [5, 7, 9, 1])
    )
    featurizer.observe_labels(
        LabelBatch(
            ["t"] * 3,
            np.array([DAY + 1, DAY + 4, DAY + 9]) * DAY_US,
            np.ones(3, bool),
            ["x", "y", "z"],
            ["a"] * 3,
        )
    )
    return featurizer


def held(days: np.ndarray, day: int) -> int:
    return int(np.flatnonzero(days == day)[0])


def _account(change):
    def broken() -> np.ndarray:
        record = np.frombuffer(folded().accounts.get_bytes("a"), dtype=ACCOUNT_STATE).copy()
        change(record[0])
        return record

    return broken


def _terminal(change):
    def broken() -> np.ndarray:
        record = np.frombuffer(folded().terminals.get_bytes("t"), dtype=TERMINAL_STATE).copy()
        change(record[0])
        return record

    return broken


def _set(field, value, at=None):
    def change(r):
        if at is None:
            r[field] = value
        else:
            r[field][at(r)] = value

    return change


def _set_last_ts_a_day_back(r):
    r["last_ts_us"] -= DAY_US


def _swap_remembered(r):
    for field in ("reported_event", "reported_day", "reported_verdict"):
        r[field][[-1, -2]] = r[field][[-2, -1]]


def _remember_later(r):  # the newest report a ring length later than the day its bucket holds
    r["reported_day"][-1] += RING_DAYS
    r["reported_verdict"][-1] += 2 * RING_DAYS


def _empty(field):
    return lambda r: int(np.flatnonzero(r[field] == -1)[0])


@pytest.mark.parametrize(
    "broken, reason",
    [
        (
            _account(_set("sum_log_amount", 1e300)),
            r"sum_log_amount = 1e\+300, expected at most count x log1p",
        ),
        (_account(_set("sumsq_log_amount", 1e300)), r"sumsq_log_amount = 1e\+300, expected at most log1p"),
        (
            _account(_set("day_amount", 1e300, lambda r: held(r["day"], DAY + 2))),
            r"day_amount = 1e\+300, expected at most day_count x 1e\+15 \(the largest amount\)",
        ),
        (
            _account(_set("day_amount", 5.0, _empty("day"))),
            r"day_amount = 5.0, expected .*: 0 in an empty bucket",
        ),
        (_account(_set("count", 2**62)), f"count = {2**62}, expected at least the events its day ring holds"),
        (_account(_set("count", 2)), "count = 2, expected at least the events its day ring holds"),
        (_account(_set("count", 0)), "count = 0, expected .* 0 exactly when max_day is -1"),
        (
            _account(_set_last_ts_a_day_back),
            "last_ts_us = .*, expected 0 with no events, else a time on day max_day",
        ),
        (_account(_set("max_day", DAY + 3)), f"max_day = {DAY + 3}, expected -1 .*, or the day its bucket"),
        (
            _account(_set("day", DAY + 1, lambda r: held(r["day"], DAY))),
            f"day = {DAY + 1}, expected -1 \\(empty\\), or a day d <= max_day in bucket d % {RING_DAYS}",
        ),
        (
            _account(_set("day_count", 0, lambda r: held(r["day"], DAY))),
            "day_count = 0, expected 0 in an empty bucket .*, at least 1 in a bucket holding a day",
        ),
        (_account(_set("seen_terminals", 255)), "seen_terminals = 255, expected at most count bits set"),
        (_terminal(_set("day_count", 5, _empty("day"))), "day_count = 5, expected 0 in an empty bucket"),
        (_terminal(_set("max_day", DAY + 5)), f"max_day = {DAY + 5}, expected -1 .*, or the day its bucket"),
        (
            _terminal(_set("report_day", DAY + 2, lambda r: held(r["report_day"], DAY + 1))),
            f"report_day = {DAY + 2}, expected -1 \\(empty\\), or a day d in bucket d % {RING_DAYS}",
        ),
        (
            _terminal(_set("report_count", 0, lambda r: held(r["report_day"], DAY + 4))),
            "report_count = 0, expected 0 in an empty bucket",
        ),
        (
            _terminal(_set("reported_event", 0, lambda r: -1)),
            r"reported_event = 0, expected 0 exactly in an empty place \(reported_day -1\)",
        ),
        (
            _terminal(_swap_remembered),
            "reported_day = .*, expected -1 .* in strictly increasing \\(verdict, event\\) order",
        ),
        (
            _terminal(_remember_later),
            f"reported_day = {DAY + 9 + RING_DAYS}, expected .* at most the day its bucket of the report ring holds",
        ),
        (
            _terminal(_set("reported_verdict", 2 * DAY, lambda r: -1)),
            f"reported_verdict = {2 * DAY}, expected -1 in an empty place, else at least 2 x reported_day",
        ),
        (
            _terminal(_set("reported_verdict", 5, lambda r: 0)),
            "reported_verdict = 5, expected -1 in an empty place",
        ),
        (
            _terminal(_set("reported_verdict", 2 * MAX_EPOCH_DAY + 2, lambda r: -1)),
            f"reported_verdict = {2 * MAX_EPOCH_DAY + 2}, expected 2 x an epoch day in 0..{MAX_EPOCH_DAY}",
        ),
    ],
)
def test_a_record_no_events_fold_is_refused_naming_the_field(broken, reason):
    record = broken()
    sound = np.frombuffer(
        (
            folded().accounts.get_bytes("a")
            if record.dtype == ACCOUNT_STATE
            else folded().terminals.get_bytes("t")
        ),
        dtype=record.dtype,
    )
    assert record_fault(sound[0]) is None
    assert record_faults(np.concatenate([sound, record, sound])).tolist() == [False, True, False]
    fault = record_fault(record[0])
    assert fault is not None
    assert re.match(reason, fault), fault
