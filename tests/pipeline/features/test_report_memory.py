"""A terminal's fraud reports (pipeline/features/report_memory.py): each labelled event counted once whatever
order and however often its labels come, a later label saying not fraud taking it back, in bounded state."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.features import EventBatch, LabelBatch, StreamingFeaturizer, replay_batches
from pipeline.features.definitions import DAY_US, REMEMBERED_REPORTS, RING_DAYS

D = 20_000  # an epoch day (2024-10-04)
HOUR_US = 3_600_000_000

# (event number, label time in µs, is_fraud): labels of account "a"'s events e0, e1, ... at terminal "t"
Label = tuple[int, int, bool]


def batch_of(labels: list[Label], terminal: str = "t") -> LabelBatch:
    return LabelBatch(
        [terminal] * len(labels),
        np.array([us for _, us, _ in labels], dtype=np.int64),
        np.array([fraud for _, _, fraud in labels], dtype=bool),
        [f"e{event}" for event, _, _ in labels],
        ["a"] * len(labels),
    )


def fraud(event: int, day: int, hour: int = 0) -> Label:
    return (event, day * DAY_US + hour * HOUR_US, True)


def not_fraud(event: int, day: int, hour: int = 0) -> Label:
    return (event, day * DAY_US + hour * HOUR_US, False)


def record(featurizer: StreamingFeaturizer, terminal: str = "t") -> np.ndarray:
    return np.frombuffer(featurizer.terminals.get_bytes(terminal), dtype=featurizer.terminals.dtype)[0]


def reports(featurizer: StreamingFeaturizer, day: int, hour: int = 12) -> dict[int, int]:
    """{window: terminal_reports} of an event at "t" on `day`, read from a copy (the state is left as is)."""
    probe = StreamingFeaturizer.from_bytes(featurizer.to_bytes())
    raw = probe.raw_aggregates(
        EventBatch(["probe"], ["t"], np.array([day * DAY_US + hour * HOUR_US]), np.ones(1))
    )
    return {d: int(raw[f"terminal_reports_{d}d"][0]) for d in (1, 7, 30)}


def observe(featurizer: StreamingFeaturizer, labels: list[Label], cuts=()) -> StreamingFeaturizer:
    """`featurizer` after observing `labels`, in batches cut at `cuts`."""
    for part in np.split(np.arange(len(labels)), sorted(set(cuts))):
        if len(part):
            featurizer.observe_labels(batch_of([labels[i] for i in part.tolist()]))
    return featurizer


def fold(labels: list[Label], cuts=()) -> StreamingFeaturizer:
    return observe(StreamingFeaturizer(), labels, cuts)


# -- a label repeated never counts twice ------------------------------------------------------------------


def test_one_label_sent_a_thousand_times_to_a_terminal_whose_memory_is_full_counts_once_at_most():
    """A busy terminal remembers REMEMBERED_REPORTS reports of today. A label dated 5 days back, older than all
    of them, may repeat a report let go: it is not counted, however often it comes (it once added one report
    a send: 1,032 reports after 1,000 sends, a risk over 24). One dated after them is counted once."""
    featurizer = fold([fraud(i, D, 1) for i in range(REMEMBERED_REPORTS)])
    assert reports(featurizer, D) == {1: 32, 7: 32, 30: 32}
    for _ in range(1000):
        featurizer.observe_labels(batch_of([fraud(100, D - 5)]))
    assert reports(featurizer, D) == {1: 32, 7: 32, 30: 32}
    for _ in range(1000):
        featurizer.observe_labels(batch_of([fraud(101, D + 1)]))
    assert reports(featurizer, D + 1) == {1: 1, 7: 33, 30: 33}


def test_labels_cycled_through_a_full_memory_count_once():
    """40 events reported on one day at one terminal, their labels sent again and again one at a time (a
    re-published labels topic): the first pass counts what the memory can hold, the later ones nothing (each
    once added ~9 reports)."""
    labels = [(i, D * DAY_US + HOUR_US + i, True) for i in range(40)]
    featurizer = StreamingFeaturizer()
    counts = []
    for _ in range(4):
        for label in labels:
            featurizer.observe_labels(batch_of([label]))
        counts.append(reports(featurizer, D)[1])
    assert REMEMBERED_REPORTS <= counts[0] <= 40
    assert counts == [counts[0]] * 4


def test_a_terminal_with_more_reports_than_it_remembers_counts_each_once_in_time_order():
    """More reports than a terminal remembers, then all of them again: in time order every report is
    counted (each is the newest when it comes), and no repeat, of a report remembered or let go, is."""
    n = REMEMBERED_REPORTS + 8
    days = 10 + np.arange(n) // 4
    labels = [fraud(i, int(day)) for i, day in enumerate(days)]
    featurizer = fold(labels)
    featurizer.observe_labels(batch_of(labels))
    featurizer.observe_labels(batch_of(labels[::-1]))
    assert record(featurizer)["report_count"].sum() == n
    assert sorted(record(featurizer)["reported_day"].tolist()) == days[-REMEMBERED_REPORTS:].tolist()


@settings(max_examples=200, deadline=None, database=None)  # no example database left in the checkout
@given(
    days=st.lists(st.integers(0, RING_DAYS - 1), min_size=1, max_size=3 * REMEMBERED_REPORTS),
    data=st.data(),
)
def test_repeats_in_any_order_and_batching_never_count_an_event_twice(days, data):
    """Events with one label each (event i on days[i], all in one ring length, so the ring's total is what
    was counted), sent in any order and batching, then again and again: never more reports than events,
    and a repeat never adds one."""
    labels = [fraud(i, day) for i, day in enumerate(days)]
    order = data.draw(st.permutations(labels))
    featurizer = fold(order, data.draw(st.lists(st.integers(0, len(labels)), max_size=6)))
    counted = record(featurizer)["report_count"].sum()
    assert counted <= len(labels)
    for _ in range(2):
        again = data.draw(st.lists(st.sampled_from(labels), max_size=2 * len(labels)))
        observe(featurizer, again, data.draw(st.lists(st.integers(0, len(again)), max_size=6)))
        assert record(featurizer)["report_count"].sum() == counted


def test_two_accounts_events_of_one_id_are_two_reports():
    # event_id tells an account's events apart (as replays are): the same id at two accounts is two events.
    featurizer = StreamingFeaturizer()
    featurizer.observe_labels(
        LabelBatch(["t", "t"], np.full(2, 5 * DAY_US), np.ones(2, bool), ["7", "7"], ["A", "B"])
    )
    featurizer.observe_labels(
        LabelBatch(["t"], np.array([5 * DAY_US]), np.ones(1, bool), ["7"], ["A"])
    )  # a repeat
    assert record(featurizer)["report_count"].sum() == 2


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
    verdicts = np.concatenate([b.is_fraud for b, _ in pieces])
    order = rng.permutation(len(events))
    return LabelBatch(
        [terminals[i] for i in order],
        ts[order],
        verdicts[order],
        [events[i] for i in order],
        [accounts[i] for i in order],
    )


def test_a_repeated_label_changes_no_feature(generated):
    """Every label given twice with its batch, and again with later batches, in shuffled order: the
    features and the terminals' report rings are those of each label given once, as a dataset has it."""
    rng = np.random.default_rng(7)
    once, repeated, earlier = StreamingFeaturizer(), StreamingFeaturizer(), []
    for events, labels in replay_batches(generated.head(20_000), 500):
        expected, _ = once.transform(events, labels)
        got, _ = repeated.transform(events, with_repeats(labels, earlier, rng))
        np.testing.assert_array_equal(got, expected)
        if labels is not None:
            earlier.append(labels)
    assert len(earlier) > 5 and once.terminals.records["report_count"].sum() > 0
    assert list(repeated.terminals) == list(once.terminals)
    for field in ("report_day", "report_count", "reported_event", "reported_day"):
        # Sorted: a repeat dated a day later makes its event's verdict newer, which orders the memory.
        got = np.sort(repeated.terminals.records[field][: len(once.terminals)], axis=1)
        np.testing.assert_array_equal(
            got, np.sort(once.terminals.records[field][: len(once.terminals)], axis=1)
        )


# -- the day a report counts on ----------------------------------------------------------------------------


def test_a_report_counts_on_the_earliest_day_its_event_was_labelled_whatever_order_labels_come_in():
    records = {
        fold([fraud(0, day) for day in days]).terminals.get_bytes("t")
        for days in itertools.permutations([5, 9, 7])
    }
    assert len(records) == 1

    featurizer = fold([fraud(0, 9), fraud(0, 5)])  # moves the report from day 9 to day 5
    raw = featurizer.raw_aggregates(
        EventBatch(["a"] * 2, ["t"] * 2, np.array([5, 9]) * DAY_US + 1, np.ones(2))
    )
    assert raw["terminal_reports_1d"].tolist() == [1, 0]
    assert raw["terminal_reports_7d"].tolist() == [1, 1]


# -- a later label saying not fraud withdraws the report ------------------------------------------------


def test_a_later_label_saying_not_fraud_withdraws_the_report():
    featurizer = fold([fraud(0, D, 2)])
    assert reports(featurizer, D) == {1: 1, 7: 1, 30: 1}
    featurizer.observe_labels(batch_of([not_fraud(0, D, 3)]))  # the verdict reversed, an hour later
    assert reports(featurizer, D) == reports(featurizer, D + 10) == {1: 0, 7: 0, 30: 0}
    assert record(featurizer)["report_count"].sum() == 0


def test_a_withdrawn_report_stays_withdrawn_when_its_fraud_label_comes_again():
    featurizer = fold([fraud(0, D, 2), not_fraud(0, D, 3)])
    for _ in range(100):  # a re-published labels topic
        featurizer.observe_labels(batch_of([fraud(0, D, 2)]))
        featurizer.observe_labels(batch_of([fraud(0, D, 4)]))  # on the withdrawal's day: it outranks them
    assert reports(featurizer, D) == {1: 0, 7: 0, 30: 0}


def test_a_fraud_label_dated_after_the_withdrawal_reports_the_event_again_on_its_earliest_fraud_day():
    featurizer = fold([fraud(0, D, 2), not_fraud(0, D, 3), fraud(0, D + 2)])
    assert reports(featurizer, D) == {1: 1, 7: 1, 30: 1}
    assert reports(featurizer, D + 2) == {1: 0, 7: 1, 30: 1}
    featurizer.observe_labels(batch_of([not_fraud(0, D + 3)]))
    assert reports(featurizer, D + 3) == {1: 0, 7: 0, 30: 0}


def test_a_label_saying_not_fraud_for_an_event_never_reported_changes_nothing():
    featurizer = fold([fraud(0, D)])
    before = featurizer.to_bytes()
    featurizer.observe_labels(batch_of([not_fraud(1, D, 5)]))  # another event at the terminal
    featurizer.observe_labels(batch_of([not_fraud(0, D, 5)], terminal="elsewhere"))  # no terminal is made
    assert featurizer.to_bytes() == before
    assert "elsewhere" not in featurizer.terminals


def test_a_withdrawal_that_comes_before_the_fraud_label_it_postdates_finds_nothing_until_it_comes_again():
    """Arrival order matters here: a label saying not fraud with no report to withdraw is not kept (most
    labels are of that kind). The labels of one event share a partition of the labels topic (keyed by
    account), so every reader folds them in the same order; re-sent, the withdrawal takes effect."""
    featurizer = fold([not_fraud(0, D, 3), fraud(0, D, 2)], cuts=[1])
    assert reports(featurizer, D)[1] == 1
    featurizer.observe_labels(batch_of([not_fraud(0, D, 3)]))
    assert reports(featurizer, D)[1] == 0
    assert (
        reports(fold([not_fraud(0, D, 3), fraud(0, D, 2)]), D)[1] == 0
    )  # one batch: folded in label_ts order


def test_a_withdrawal_of_a_report_the_terminal_let_go_changes_nothing():
    labels = [fraud(i, D + i // 4) for i in range(REMEMBERED_REPORTS + 4)]  # e0..e3 are let go
    featurizer = fold(labels)
    before = featurizer.to_bytes()
    featurizer.observe_labels(batch_of([not_fraud(0, D + 20)]))
    assert featurizer.to_bytes() == before


def test_labels_given_with_a_batch_apply_from_their_label_ts_as_between_batches():
    """Events and labels (reports, a repeat dated earlier, withdrawals, a report again) in one batch: each
    event's features are those of the labels before it, as when the labels come between one-event batches."""
    labels = [
        fraud(0, D, 1), fraud(1, D, 2), not_fraud(0, D, 4), fraud(2, D + 1, 1), fraud(1, D - 3, 9),
        not_fraud(2, D + 1, 6), fraud(0, D + 1, 8), not_fraud(3, D + 1, 9),
    ]  # fmt: skip
    # Every 3 hours over two days, and one at a label's time exactly.
    ts = np.sort([D * DAY_US + h * HOUR_US for h in range(0, 48, 3)] + [(D + 1) * DAY_US + 8 * HOUR_US])
    events = EventBatch(["b"] * len(ts), ["t"] * len(ts), ts, np.ones(len(ts)))

    whole = StreamingFeaturizer()
    whole.observe_labels(batch_of([fraud(3, D - 1)]))
    got = whole.raw_aggregates(events, batch_of(labels[::-1]))  # given in any order

    apart = StreamingFeaturizer()
    apart.observe_labels(batch_of([fraud(3, D - 1)]))
    expected = {d: [] for d in (1, 7, 30)}
    waiting = sorted(labels, key=lambda label: label[1])
    for i in range(len(ts)):
        known = [label for label in waiting if label[1] <= ts[i]]
        waiting = waiting[len(known) :]
        if known:
            apart.observe_labels(batch_of(known))
        one = apart.raw_aggregates(EventBatch(["b"], ["t"], ts[i : i + 1], np.ones(1)))
        for d in expected:
            expected[d].append(int(one[f"terminal_reports_{d}d"][0]))
    for d in expected:
        assert got[f"terminal_reports_{d}d"].tolist() == expected[d], d
    assert np.count_nonzero(np.diff(expected[7])) >= 6  # reports came and went within the batch
    assert whole.terminals.get_bytes("t") == apart.terminals.get_bytes("t")


# -- for the events a terminal remembers, the order of their labels does not matter ------------------------


def expected_record(sequences: dict[int, list[Label]]) -> dict[str, list]:
    """What a terminal must hold after each event's labels, in that event's own order: a label saying not
    fraud before the event's first fraud label finds nothing; after it, the report counts on the earliest
    fraud label's day unless the newest label says not fraud (on one day, a withdrawal outranks)."""
    remembered = {}  # event key: (day counted on, verdict)
    for labels in sequences.values():
        key = int(batch_of([labels[0]]).report_keys([0])[0])
        for _, us, is_fraud in labels:
            day, code = us // DAY_US, 2 * (us // DAY_US) + (0 if is_fraud else 1)
            if key in remembered:
                counted_on, verdict = remembered[key]
                remembered[key] = (min(counted_on, day) if is_fraud else counted_on, max(verdict, code))
            elif is_fraud:
                remembered[key] = (day, code)
    memory = sorted((verdict, key, day) for key, (day, verdict) in remembered.items())
    empty = [(-1, 0, -1)] * (REMEMBERED_REPORTS - len(memory))
    ring_day, ring_count = [-1] * RING_DAYS, [0] * RING_DAYS
    for day in sorted(day for verdict, _, day in memory if verdict % 2 == 0):  # the newest day of a bucket
        bucket = day % RING_DAYS
        ring_count[bucket] = ring_count[bucket] + 1 if ring_day[bucket] == day else 1
        ring_day[bucket] = day
    return {
        "reported_verdict": [v for v, _, _ in empty + memory],
        "reported_event": [k for _, k, _ in empty + memory],
        "reported_day": [d for _, _, d in empty + memory],
        "report_day": ring_day,
        "report_count": ring_count,
    }


@settings(max_examples=300, deadline=None, database=None)
@given(
    sequences=st.dictionaries(
        st.integers(0, 99),
        st.lists(st.tuples(st.integers(0, 99), st.integers(0, 23), st.booleans()), min_size=1, max_size=5),
        max_size=REMEMBERED_REPORTS,
    ),
    data=st.data(),
)
def test_labels_of_the_events_a_terminal_remembers_fold_alike_in_any_interleaving_and_batching(
    sequences, data
):
    """Up to REMEMBERED_REPORTS events at one terminal, each with labels in time order (fraud or not, on days
    over several ring lengths), the events' labels interleaved and batched in any way: the record is what
    each event's labels say (expected_record), however they were interleaved."""
    in_time = {
        event: [(event, day * DAY_US + hour * HOUR_US, is_fraud) for day, hour, is_fraud in sorted(labels)]
        for event, labels in sequences.items()
    }
    interleaved, cursors = [], {event: 0 for event in in_time}
    while cursors:
        event = data.draw(st.sampled_from(sorted(cursors)))
        interleaved.append(in_time[event][cursors[event]])
        cursors[event] += 1
        if cursors[event] == len(in_time[event]):
            del cursors[event]
    featurizer = fold(interleaved, data.draw(st.lists(st.integers(0, len(interleaved)), max_size=6)))
    if "t" not in featurizer.terminals:
        assert not any(label[2] for labels in in_time.values() for label in labels)
        return
    got = record(featurizer)
    for field, expected in expected_record(in_time).items():
        assert got[field].tolist() == expected, field


@pytest.mark.parametrize(
    "labels",
    [
        [fraud(0, 9), fraud(0, 5)],  # the earlier-dated repeat second, in the same batch
        [fraud(0, 5), fraud(1, 35), fraud(1, 10)],  # 5 and 35 share a ring bucket: 35 hides 5 until it moves
        [fraud(0, 35), fraud(1, 40), fraud(1, 5), fraud(0, 3)],
        [fraud(0, 5), fraud(1, 35), not_fraud(1, 36)],  # 35 withdrawn: 5 shows again
    ],
)
def test_repeats_and_withdrawals_in_one_batch_or_one_at_a_time_fold_alike(labels):
    want = fold(labels, range(len(labels))).terminals.get_bytes("t")
    for order in itertools.permutations(labels):
        if [label for label in order if label[0] == 1] == [label for label in labels if label[0] == 1]:
            assert fold(list(order)).terminals.get_bytes("t") == want, order  # one batch
            assert fold(list(order), range(len(order))).terminals.get_bytes("t") == want, order
