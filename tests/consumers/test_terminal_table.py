"""The terminal table: its record codecs, and the specification of its write protocol: whatever batch the
service stops after, restoring the table it wrote gives back the featurizer's terminal state bit for bit."""

import numpy as np
import pytest

from consumers import terminal_table
from consumers.terminal_table import POSITIONS_KEY, TerminalTable
from pipeline.features.stream import EventBatch, LabelBatch, StreamingFeaturizer, replay_batches
from pipeline.generate import GenerateConfig, generate


def featurizer_with_two_terminals() -> StreamingFeaturizer:
    featurizer = StreamingFeaturizer()
    ts = np.array([1_700_000_000_000_000, 1_700_000_100_000_000], dtype=np.int64)
    featurizer.transform(EventBatch(["a", "b"], ["t1", "t2"], ts, np.array([5.0, 7.0])))
    featurizer.observe_labels(LabelBatch(["t1"], ts[1:], np.array([True])))
    return featurizer


def test_terminal_records_round_trip_with_their_stamp():
    source = featurizer_with_two_terminals()
    value = terminal_table.encode_terminal(source.terminals.get_bytes("t1"), stamp=41)
    assert terminal_table.decode_terminal("t1", value) == (41, source.terminals.get_bytes("t1"))


def test_a_record_of_another_version_or_layout_is_refused_with_what_to_do():
    value = terminal_table.encode_terminal(featurizer_with_two_terminals().terminals.get_bytes("t1"), 0)
    other = value[:4] + (99).to_bytes(2, "little") + value[6:]
    with pytest.raises(ValueError, match=r"state version 99.*new topic and replay"):
        terminal_table.decode_terminal("t1", other)
    with pytest.raises(ValueError, match="before the terminal journal: point terminal_table_topic"):
        terminal_table.decode_terminal("t1", b"TXST" + value[4:])
    with pytest.raises(ValueError, match="bad magic"):
        terminal_table.decode_terminal("t1", b"nope")
    with pytest.raises(ValueError, match="not a journal record"):
        terminal_table.decode_journal("\x00journal/1/w", value)


def test_label_positions_round_trip_and_refuse_another_labels_topic():
    data = terminal_table.encode_positions("labels", {1: 7, 0: 3}, seq=12)
    assert terminal_table.decode_positions(data, "labels") == ({0: 3, 1: 7}, 12)
    with pytest.raises(ValueError, match=r"labels topic 'labels'.*reads 'other-labels'"):
        terminal_table.decode_positions(data, "other-labels")


@pytest.fixture(scope="module")
def stream() -> list[tuple[EventBatch, LabelBatch | None]]:
    frame = generate(GenerateConfig(accounts=600, days=20, seed=5)).sort("ts", "event_id").head(12_000)
    assert frame["terminal_id"].n_unique() > 500 and frame["is_fraud"].sum() > 20
    return list(replay_batches(frame, 200))


def write(topic: dict, records) -> int:
    """Apply one batch's records to a compacted topic as a read_committed reader would see it."""
    for key, value in records:
        topic[key] = value
    return len(records)


def restored(topic: dict, snapshot_batches: int) -> tuple[StreamingFeaturizer, TerminalTable]:
    featurizer = StreamingFeaturizer()
    table = TerminalTable(featurizer, snapshot_batches, writer="restored")
    table.restore(dict(topic), "labels")
    return featurizer, table


def terminal_bytes(featurizer: StreamingFeaturizer) -> dict[str, bytes]:
    return {t: featurizer.terminals.get_bytes(t) for t in featurizer.terminals}


def test_restoring_after_any_batch_gives_back_every_terminal_bit_for_bit(stream):
    live = StreamingFeaturizer()
    table = TerminalTable(live, snapshot_batches=7, writer="live")
    topic: dict[str, bytes | None] = {}
    sent = []
    for i, (events, labels) in enumerate(stream):
        if labels is not None and i % 2:
            live.observe_labels(labels)  # between batches, as the service applies them
            labels = None
        live.transform(events, labels)
        sent.append(write(topic, table.batch_records("labels", {0: i})))
        if i % 9 == 4 or i == len(stream) - 1:
            featurizer, _ = restored(topic, 7)
            assert terminal_bytes(featurizer) == terminal_bytes(live), f"after batch {i}"
    # A batch of 200 events touched ~150 terminals, each a record before the journal; now a handful.
    assert max(sent) <= 3 + max(8, -(-len(live.terminals) // 7)), max(sent)
    journal = [k for k, v in topic.items() if k.startswith(terminal_table.JOURNAL_PREFIX) and v is not None]
    assert 0 < len(journal) <= 8, "journal records older than every terminal's snapshot are tombstoned"
    assert terminal_table.decode_positions(topic[POSITIONS_KEY], "labels")[0] == {0: len(stream) - 1}


def test_a_restored_instance_writes_on_and_restores_again_exactly(stream):
    live = StreamingFeaturizer()
    table = TerminalTable(live, snapshot_batches=5, writer="first")
    topic: dict[str, bytes | None] = {}
    half = len(stream) // 2
    for events, labels in stream[:half]:
        live.transform(events, labels)
        write(topic, table.batch_records("labels", {}))
    resumed, resumed_table = restored(topic, 5)  # a restart: a new writer goes on from the table
    for events, labels in stream[half:]:
        expected, _ = live.transform(events, labels)
        got, _ = resumed.transform(events, labels)
        np.testing.assert_array_equal(got[:, -9:], expected[:, -9:])  # the terminal features
        write(topic, resumed_table.batch_records("labels", {}))
        write({}, table.batch_records("labels", {}))  # keeps the live journal drained
    again, _ = restored(topic, 5)
    assert terminal_bytes(again) == terminal_bytes(live)


def test_journaled_operations_redo_only_for_the_terminals_asked():
    featurizer = featurizer_with_two_terminals()
    featurizer.terminal_journal = []
    ts = np.array([1_700_090_000_000_000], dtype=np.int64)
    featurizer.transform(EventBatch(["a"], ["t2"], ts, np.array([1.0])))
    ops = featurizer.take_terminal_journal()
    assert [(op.kind, op.terminals) for op in ops] == [("events", ["t2"])]
    other = featurizer_with_two_terminals()
    other.apply_terminal_ops(ops, redo=lambda terminal, index: terminal != "t2")
    assert other.terminals.get_bytes("t2") != featurizer.terminals.get_bytes("t2")  # not redone
    other.apply_terminal_ops(ops)
    assert terminal_bytes(other) == terminal_bytes(featurizer)


def test_idle_terminals_cost_nothing_and_the_journal_drains(stream):
    live = StreamingFeaturizer()
    table = TerminalTable(live, snapshot_batches=4, writer="live")
    topic: dict[str, bytes | None] = {}
    for events, labels in stream[:20]:  # hundreds of terminals become dirty
        live.transform(events, labels)
        write(topic, table.batch_records("labels", {}))
    quiet = EventBatch(["A0"], ["T-busy"], stream[19][0].ts_us[-1:], np.array([3.0]))
    sent = [write(topic, table.batch_records("labels", {})) for _ in range(30) if live.transform(quiet)]
    assert not table.dirty and sent[-1] == 2  # its one terminal's snapshot and the positions: no journal
    journal = [k for k, v in topic.items() if k.startswith(terminal_table.JOURNAL_PREFIX) and v is not None]
    assert journal == [], "with nothing dirty, every journal record is tombstoned"
    featurizer, _ = restored(topic, 4)
    assert terminal_bytes(featurizer) == terminal_bytes(live)
