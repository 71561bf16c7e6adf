"""A terminal's fraud reports: each labelled event counted once whatever order and however often its labels
come, in bounded state."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.features import EventBatch, LabelBatch, StreamingFeaturizer, replay_batches
from pipeline.features.definitions import DAY_US, REMEMBERED_REPORTS


def terminal_records(featurizer: StreamingFeaturizer) -> dict[str, bytes]:
    return {t: featurizer.terminals.get_bytes(t) for t in featurizer.terminals}


def with_repeats(labels: LabelBatch | None, earlier: list[LabelBatch], rng) -> LabelBatch | None:
    """The batch's labels twice over, and repeats of labels given with the batches before (on their own
    label day or a day later), shuffled."""
    pieces = [(labels, 0), (labels, 0)] if labels is not None else []
    pieces += [(b, DAY_US * int(rng.integers(2))) for b in earlier[-3:] if rng.random() < 0.5]
    if not pieces:
        return None
    terminals = [t for b, _ in pieces for t in b.terminal_ids]
    events = [e for b, _ in pieces for e in b.event_ids]
    accounts = [a for b, _ in pieces for a in b.account_ids]
    ts = np.concatenate([b.label_ts_us + shift for b, shift in pieces])
    fraud = np.concatenate([b.is_fraud for b, _ in pieces])
    order = rng.permutation(len(events))
    return LabelBatch(
        [terminals[i] for i in order],
        ts[order],
        fraud[order],
        [events[i] for i in order],
        [accounts[i] for i in order],
    )


def test_a_repeated_label_changes_no_feature(generated):
    """Every label given twice with its batch, and again with later batches, in shuffled order: the
    features and the terminal records are those of each label given once, as a dataset has it."""
    rng = np.random.default_rng(7)
    once, repeated, earlier = StreamingFeaturizer(), StreamingFeaturizer(), []
    for events, labels in replay_batches(generated.head(20_000), 500):
        expected, _ = once.transform(events, labels)
        got, _ = repeated.transform(events, with_repeats(labels, earlier, rng))
        np.testing.assert_array_equal(got, expected)
        if labels is not None:
            earlier.append(labels)
    assert len(earlier) > 5 and once.terminals.records["report_count"].sum() > 0
    assert terminal_records(repeated) == terminal_records(once)


def test_a_report_counts_on_the_earliest_day_its_event_was_labelled_whatever_order_labels_come_in():
    def label(day: int) -> LabelBatch:
        return LabelBatch(["t"], np.array([day * DAY_US]), np.array([True]), ["e"], ["a"])

    records = []
    for days in itertools.permutations([5, 9, 7]):
        featurizer = StreamingFeaturizer()
        for day in days:
            featurizer.observe_labels(label(day))
        records.append(terminal_records(featurizer))
    assert all(r == records[0] for r in records)

    featurizer = StreamingFeaturizer()
    featurizer.observe_labels(label(9))
    featurizer.observe_labels(label(5))  # moves the report from day 9 to day 5
    raw = featurizer.raw_aggregates(
        EventBatch(["a"] * 2, ["t"] * 2, np.array([5, 9]) * DAY_US + 1, np.ones(2))
    )
    assert raw["terminal_reports_1d"].tolist() == [1, 0]
    assert raw["terminal_reports_7d"].tolist() == [1, 1]


def fold_labels(labels: list[tuple[int, int]], cuts: list[int] = ()) -> bytes:
    """The terminal record after (event number, label day) labels at terminal "t", given in batches cut at
    `cuts`."""
    featurizer = StreamingFeaturizer()
    for part in np.split(np.arange(len(labels)), sorted(set(cuts))):
        if len(part):
            picked = [labels[i] for i in part.tolist()]
            featurizer.observe_labels(
                LabelBatch(
                    ["t"] * len(picked),
                    np.array([day for _, day in picked]) * DAY_US,
                    np.ones(len(picked), bool),
                    [f"e{event}" for event, _ in picked],
                    ["a"] * len(picked),
                )
            )
    return featurizer.terminals.get_bytes("t")


def each_once_on_its_earliest_day(labels: list[tuple[int, int]]) -> bytes:
    earliest = {}
    for event, day in labels:
        earliest[event] = min(day, earliest.get(event, day))
    return fold_labels(sorted(earliest.items()))


@pytest.mark.parametrize(
    "labels",
    [
        [(0, 9), (0, 5)],  # the earlier-dated repeat second, in the same batch
        [(0, 5), (1, 35), (1, 10)],  # 5 and 35 share a ring bucket: 35 hides 5 until it moves to 10
        [(0, 35), (1, 40), (1, 5), (0, 3)],
    ],
)
def test_repeats_in_one_batch_or_one_at_a_time_fold_alike_in_every_order(labels):
    want = each_once_on_its_earliest_day(labels)
    for order in itertools.permutations(labels):
        assert fold_labels(list(order)) == want, order  # one batch
        assert fold_labels(list(order), list(range(len(order)))) == want, order  # one at a time


@settings(max_examples=300, deadline=None, database=None)  # no example database left in the checkout
@given(
    labels=st.lists(
        st.tuples(st.integers(0, REMEMBERED_REPORTS - 1), st.integers(0, 99)), min_size=1, max_size=60
    ),
    data=st.data(),
)
def test_any_repeats_in_any_order_and_batching_fold_to_each_event_once_on_its_earliest_day(labels, data):
    """Up to REMEMBERED_REPORTS events at one terminal, each labelled any number of times on days spread
    over several ring lengths: the record is that of each event reported once, on its earliest day."""
    order = data.draw(st.permutations(labels))
    cuts = data.draw(st.lists(st.integers(0, len(labels)), max_size=6))
    assert fold_labels(order, cuts) == each_once_on_its_earliest_day(labels)


def test_two_accounts_events_of_one_id_are_two_reports():
    # event_id tells an account's events apart (as replays are): the same id at two accounts is two events.
    featurizer = StreamingFeaturizer()
    featurizer.observe_labels(
        LabelBatch(["t", "t"], np.full(2, 5 * DAY_US), np.ones(2, bool), ["7", "7"], ["A", "B"])
    )
    featurizer.observe_labels(
        LabelBatch(["t"], np.array([5 * DAY_US]), np.ones(1, bool), ["7"], ["A"])
    )  # a repeat
    record = np.frombuffer(featurizer.terminals.get_bytes("t"), dtype=featurizer.terminals.dtype)[0]
    assert record["report_count"].sum() == 2


def test_a_terminal_remembers_its_newest_reports():
    # More reports than a terminal remembers, then all of them again: the repeats of the newest
    # REMEMBERED_REPORTS are not counted, those of the older ones, forgotten, are.
    n = REMEMBERED_REPORTS + 8
    days = 10 + np.arange(n) // 4
    labels = LabelBatch(["t"] * n, days * DAY_US, np.ones(n, bool), [f"e{i}" for i in range(n)], ["a"] * n)
    featurizer = StreamingFeaturizer()
    featurizer.observe_labels(labels)
    featurizer.observe_labels(labels)
    record = np.frombuffer(featurizer.terminals.get_bytes("t"), dtype=featurizer.terminals.dtype)[0]
    assert record["report_count"].sum() == n + 8
    assert sorted(record["reported_day"].tolist()) == days[-REMEMBERED_REPORTS:].tolist()
