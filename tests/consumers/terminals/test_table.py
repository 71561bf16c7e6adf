"""The terminal table and the terminal deltas: their record codecs, and the specification of the protocol that
merges several instances' terminal counts: a table flushed at any point, plus the deltas after its positions,
gives back the state of every event and label, bit for bit, however the events were split between instances.
(Against the real broker: tests/integration/test_service_labels.py.)"""

import re

import numpy as np
import pytest

from consumers.scoring.message_limits import MessageError
from consumers.terminals import deltas as terminal_deltas
from consumers.terminals import table as terminal_table
from consumers.terminals.table import POSITIONS_KEY, Positions
from pipeline.data.generate import GenerateConfig, generate
from pipeline.features.state import TERMINAL_STATE, StateTable
from pipeline.features.stream import StreamingFeaturizer
from pipeline.features.stream_batches import EventBatch, LabelBatch, TerminalOp, replay_batches


def featurizer_with_two_terminals() -> StreamingFeaturizer:
    featurizer = StreamingFeaturizer()
    ts = np.array([1_700_000_000_000_000, 1_700_000_100_000_000], dtype=np.int64)
    featurizer.transform(EventBatch(["a", "b"], ["t1", "t2"], ts, np.array([5.0, 7.0])))
    featurizer.observe_labels(LabelBatch(["t1"], ts[1:], np.array([True]), ["e1"], ["a"]))
    return featurizer


def test_terminal_records_round_trip():
    source = featurizer_with_two_terminals()
    value = terminal_table.encode_terminal(source.terminals.get_bytes("t1"))
    assert terminal_table.decode_terminal("t1", value) == source.terminals.get_bytes("t1")


def test_a_record_of_another_version_or_layout_is_refused_with_what_to_do():
    value = terminal_table.encode_terminal(featurizer_with_two_terminals().terminals.get_bytes("t1"))
    other = value[:4] + (99).to_bytes(2, "little") + value[6:]
    with pytest.raises(ValueError, match=r"state version 99.*new topic and replay"):
        terminal_table.decode_terminal("t1", other)
    with pytest.raises(ValueError, match="before the terminal table writer: point terminal_table_topic"):
        terminal_table.decode_terminal("t1", b"TXT2" + value[4:])
    with pytest.raises(ValueError, match="before terminals remembered the verdicts of their reported events"):
        terminal_table.decode_terminal("t1", b"TXT4" + value[4:])
    with pytest.raises(ValueError, match="bad magic"):
        terminal_table.decode_terminal("t1", b"nope")


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("max_day", 2**31 - 1, "max_day = 2147483647, expected an epoch day"),
        ("report_count", -1, "report_count = -1, expected a count >= 0"),
        ("reported_day", -5, "reported_day = -5, expected an epoch day"),
        ("reported_verdict", -7, "reported_verdict = -7, expected 2 x an epoch day"),
        ("day_count", 5, "day_count = 5, expected 0 in an empty bucket"),  # bucket 0 holds no day here
        ("report_day", 7, r"report_day = 7, expected -1 \(empty\), or a day d in bucket d % 30"),
    ],
)
def test_a_table_record_no_events_give_is_left_out_naming_the_terminal(
    monkeypatch, caplog, field, value, reason
):
    # A day past the stream's range would spill into the windows of the other terminals of every batch.
    source = featurizer_with_two_terminals()
    broken = np.frombuffer(source.terminals.get_bytes("t2"), dtype=TERMINAL_STATE).copy()
    broken[field].flat[0] = value
    latest = {
        "t1": terminal_table.encode_terminal(source.terminals.get_bytes("t1")),
        "t2": terminal_table.encode_terminal(broken.tobytes()),
    }
    monkeypatch.setattr(terminal_table, "read_latest", lambda *args, **kwargs: (dict(latest), 2))
    now = 19_700  # the last day a ts may fall on as the table is read; the records' days are 19_675
    table, _, left_out = terminal_table.read_table(
        None, "table", "labels", "deltas", 1.0, now
    )  # stops nothing
    assert "t2" not in table and table.get_bytes("t1") == source.terminals.get_bytes("t1")
    assert left_out == ["t2"]  # the writer's next flush deletes it
    assert re.search(rf"terminals=1 first='t2': {reason}.* no events or labels give", caplog.text)
    latest["t2"] = terminal_table.encode_terminal(source.terminals.get_bytes("t2"))
    table = terminal_table.read_table(None, "table", "labels", "deltas", 1.0, now).terminals
    assert table.get_bytes("t2") == source.terminals.get_bytes("t2")


def test_a_table_record_dated_in_days_to_come_is_left_out(monkeypatch, caplog):
    # Sound in itself, but by its day every other terminal would look idle, and be let go
    # (consumers/terminals/idle.py): a day after the last a ts may fall on as the table is read is refused.
    source = featurizer_with_two_terminals()  # day 19_675
    ahead = StreamingFeaturizer()
    ahead.transform(EventBatch(["a"], ["t9"], np.array([19_800 * 86_400_000_000]), np.array([1.0])))
    latest = {
        "t1": terminal_table.encode_terminal(source.terminals.get_bytes("t1")),
        "t9": terminal_table.encode_terminal(ahead.terminals.get_bytes("t9")),
    }
    monkeypatch.setattr(terminal_table, "read_latest", lambda *args, **kwargs: (dict(latest), 2))
    table, _, left_out = terminal_table.read_table(None, "table", "labels", "deltas", 1.0, 19_700)
    assert list(table) == ["t1"] and left_out == ["t9"]
    assert (
        "first='t9': max_day = 19800, expected an epoch day in 0..19700 (a later one is still to come), or -1 "
        "for none" in caplog.text
    )
    assert list(terminal_table.read_table(None, "table", "labels", "deltas", 1.0, 19_800).terminals) == [
        "t1",
        "t9",
    ]


def test_a_table_record_that_is_not_one_is_left_out_and_stops_nothing(monkeypatch, caplog):
    # Anyone who can write the topic can put one there: one bad record must not stop every scorer's start.
    source = featurizer_with_two_terminals()
    good = terminal_table.encode_terminal(source.terminals.get_bytes("t1"))
    positions = terminal_table.encode_positions(Positions(labels={0: 4}), "labels", "deltas")
    for bad in (b"nope", b"", good[:-1], good + b"x"):
        latest = {"t1": good, "t2": bad, POSITIONS_KEY: positions}
        monkeypatch.setattr(terminal_table, "read_latest", lambda *args, latest=latest, **kwargs: (latest, 3))
        table, read_positions, left_out = terminal_table.read_table(None, "table", "labels", "deltas", 1.0)
        assert "t2" not in table and table.get_bytes("t1") == source.terminals.get_bytes("t1")
        assert read_positions == Positions(labels={0: 4}) and left_out == ["t2"]
        assert re.search(r"terminals=1 first: terminal table record of 't2'", caplog.text)


@pytest.mark.parametrize(
    "positions",
    [
        b"{not json",
        b"\xff\xfe",
        b"[" * 5000,
        b"null",
        b'{"labels_topic": "labels", "deltas_topic": "deltas"}',
        b'{"labels_topic": "labels", "labels": {"0": -1}, "deltas_topic": "deltas", "deltas": {}}',
        b'{"labels_topic": "labels", "labels": {"x": 1}, "deltas_topic": "deltas", "deltas": {}}',
        b'{"labels_topic": "labels", "labels": {"0": 1.5}, "deltas_topic": "deltas", "deltas": {}}',
        b'{"labels_topic": 7, "labels": {}, "deltas_topic": "deltas", "deltas": {}}',
    ],
)
def test_a_positions_record_that_is_not_one_reads_as_no_table(monkeypatch, caplog, positions):
    # Without positions the records cannot be joined to the deltas after them: the counts are rebuilt from
    # the deltas and labels from their start, rather than the start stopped or the deltas counted twice.
    source = featurizer_with_two_terminals()
    latest = {
        "t1": terminal_table.encode_terminal(source.terminals.get_bytes("t1")),
        POSITIONS_KEY: positions,
    }
    monkeypatch.setattr(terminal_table, "read_latest", lambda *args, **kwargs: (dict(latest), 2))
    table, read_positions, left_out = terminal_table.read_table(None, "table", "labels", "deltas", 1.0)
    assert len(table) == 0 and read_positions == Positions() and left_out == ["t1"]
    assert "terminal table read as empty: topic=table the terminal table's positions record is not one" in (
        caplog.text
    )


def test_an_empty_table_is_read_as_empty(monkeypatch):
    # A new deployment's table: nothing to check, nothing refused (a check of zero records must not fail).
    monkeypatch.setattr(terminal_table, "read_latest", lambda *args, **kwargs: ({}, 0))
    table = terminal_table.read_table(None, "table", "labels", "deltas", 1.0).terminals
    assert len(table) == 0


def test_a_delta_of_another_version_or_garbage_is_a_message_error_to_skip():
    # Any instance, or anyone who can write the topic, can put one there: it must not stop every reader.
    (delta,) = terminal_deltas.encode_deltas([TerminalOp("events", ["a"], np.array([1], dtype=np.int64))])
    newer = delta[:4] + (99).to_bytes(2, "little") + delta[6:]
    with pytest.raises(MessageError, match=r"state version 99.*new topic and replay.*skipped"):
        terminal_deltas.decode_deltas("deltas[0]@3", newer)
    garbage = {
        b"nope": "bad magic",
        terminal_table.pack_header(b"TXD1") + b"{not json": r"deltas\[0\]@3 does not decode",
        terminal_table.pack_header(b"TXD1") + b'[["a","b"],[1]]': r"deltas\[0\]@3 has 2 terminals",
        terminal_table.pack_header(b"TXD1") + b"[" * 5000: r"deltas\[0\]@3 does not decode",
        terminal_table.pack_header(b"TXD1") + b'[["a"],[1e999]]': r"deltas\[0\]@3 does not decode",
        terminal_table.pack_header(b"TXD1")
        + b'[["a"],['
        + b"9" * 30
        + b"]]": r"deltas\[0\]@3 does not decode",
        terminal_table.pack_header(b"TXD1") + b'[["\\ud800"],[1]]': "U\\+D800, a lone surrogate",
        terminal_table.pack_header(b"TXD1") + b'[[{"a":1}],[1]]': "a terminal id that is not a string",
        # what no decoded transaction carries: ids the decoder refuses, days that are not integers
        terminal_table.pack_header(b"TXD1")
        + b'["ab",[1,1]]': r"expected \[\[terminal ids\], \[epoch days\]\]",
        terminal_table.pack_header(b"TXD1")
        + b'[{"a":1},[1]]': r"expected \[\[terminal ids\], \[epoch days\]\]",
        terminal_table.pack_header(b"TXD1") + b'[[""],[1]]': "expected a non-empty string",
        terminal_table.pack_header(b"TXD1") + b'[["a\\u034fb"],[1]]': "U\\+034F, which prints as nothing",
        terminal_table.pack_header(b"TXD1")
        + b'[["'
        + b"a" * 257
        + b'"],[1]]': "257 characters; the limit is 256",
        terminal_table.pack_header(b"TXD1") + b'[["a"],[1.5]]': "an epoch day that is not an integer",
        terminal_table.pack_header(b"TXD1") + b'[["a"],["1"]]': "an epoch day that is not an integer",
        terminal_table.pack_header(b"TXD1") + b'[["a"],[true]]': "an epoch day that is not an integer",
        terminal_table.pack_header(b"TXD1") + b'[["a"],[2000000]]': r"days 2000000\.\.2000000, outside",
    }
    for value, reason in garbage.items():
        with pytest.raises(MessageError, match=reason):
            terminal_deltas.decode_deltas("deltas[0]@3", value)


def test_a_table_stops_doubling_at_its_row_limit_and_doubles_on_past_it():
    table = StateTable(TERMINAL_STATE, capacity=4)
    table.row_limit = 10  # a holder's cap and its room (consumers/terminals/idle.py)
    table.slots([f"t{i}" for i in range(5)])  # one at a time: 4 -> 8
    assert len(table.records) == 8
    table.slots(["t5", "t6", "t7", "t8"])  # 9 held: 8 -> 10, not 16
    assert len(table.records) == 10
    table.add([f"u{i}" for i in range(5)])  # 14 held: past the limit it doubles on
    assert len(table.records) == 20 and len(table) == 14
    empty = StateTable(TERMINAL_STATE).records[0].tobytes()
    assert table.get_bytes("u4") == empty == table.get_bytes("t8")


def test_positions_round_trip_and_refuse_other_topics():
    positions = Positions(labels={1: 7, 0: 3}, deltas={0: 11})
    data = terminal_table.encode_positions(positions, "labels", "deltas")
    assert terminal_table.decode_positions(data, "labels", "deltas") == positions
    with pytest.raises(ValueError, match=r"labels topic 'labels'.*reads 'other-labels'"):
        terminal_table.decode_positions(data, "other-labels", "deltas")
    with pytest.raises(ValueError, match=r"deltas topic 'deltas'.*reads 'd2'"):
        terminal_table.decode_positions(data, "labels", "d2")


def test_a_delta_carries_a_batchs_event_counts_and_leaves_reports_out():
    featurizer = StreamingFeaturizer()
    featurizer.terminal_journal = []
    featurizer.observe_labels(
        LabelBatch(["t9"], np.array([5], dtype=np.int64), np.array([True]), ["e9"], ["a"])
    )
    assert terminal_deltas.encode_deltas(featurizer.take_terminal_journal()) == []  # reports only
    ts = np.array([3, 2, 1], dtype=np.int64) * 86_400_000_000
    featurizer.transform(EventBatch(["a", "b", "a"], ["t1", "t2", "t1"], ts, np.ones(3)))
    (value,) = terminal_deltas.encode_deltas(featurizer.take_terminal_journal())
    op = terminal_deltas.decode_deltas("here", value)
    assert op.kind == "events" and op.terminals == ["t1", "t2", "t1"] and op.days.tolist() == [3, 2, 1]


def test_a_batch_of_long_terminal_ids_writes_several_deltas_each_small_enough_for_the_broker():
    # 256 emoji escape to ~3 KB in JSON: 500 such valid events made one 1.5 MB record, past the broker's 1 MiB,
    # and the batch's transaction failed on every try.
    terminals = [f"{i:03d}" + "\U0001f600" * 253 for i in range(500)]
    days = np.arange(500, dtype=np.int64) % 7
    values = terminal_deltas.encode_deltas([TerminalOp("events", terminals, days)])
    assert len(values) > 1 and all(len(v) <= terminal_deltas.DELTA_VALUE_BYTES for v in values)
    ops = [terminal_deltas.decode_deltas("here", v) for v in values]
    assert [t for op in ops for t in op.terminals] == terminals
    assert np.concatenate([op.days for op in ops]).tolist() == days.tolist()


def test_a_flush_ends_with_the_positions():
    featurizer = featurizer_with_two_terminals()
    records = terminal_table.flush_records(featurizer.terminals, {"t2", "t1"}, Positions(), "l", "d")
    assert [key for key, _ in records] == ["t1", "t2", POSITIONS_KEY]


@pytest.fixture(scope="module")
def stream() -> list[tuple[EventBatch, LabelBatch | None]]:
    frame = generate(GenerateConfig(accounts=600, days=20, seed=5)).sort("ts", "event_id").head(12_000)
    assert frame["terminal_id"].n_unique() > 500 and frame["is_fraud"].sum() > 20
    return list(replay_batches(frame, 200))


def terminal_bytes(terminals: StateTable) -> dict[str, bytes]:
    return {t: terminals.get_bytes(t) for t in terminals}


def test_a_table_flushed_anywhere_plus_the_later_deltas_is_every_instances_state(stream):
    """Three instances score interleaved batches, each writing its delta to a shared log; the writer folds
    the log and flushes at irregular points (labels, read by all, are folded at the end: order-free); a restore from any flush, plus the deltas after
    its positions, equals one featurizer that saw everything, and so does every live instance after it has
    folded the others' deltas (as the service does each batch)."""
    everything = StreamingFeaturizer()
    instances = [StreamingFeaturizer() for _ in range(3)]
    for instance in instances:
        instance.terminal_journal = []
    log: list[tuple[int, bytes]] = []  # the deltas topic: (writer instance, value)
    labels: list[LabelBatch] = []
    writer, writer_at, table, flushed = StreamingFeaturizer(), 0, {}, []
    rng = np.random.default_rng(3)
    for i, (events, batch_labels) in enumerate(stream):
        everything.transform(events, batch_labels)
        who = instances[i % 3]
        who.transform(events)  # labels: every instance reads them; kept apart here, folded below
        if batch_labels is not None:
            labels.append(batch_labels)
        log += [(i % 3, value) for value in terminal_deltas.encode_deltas(who.take_terminal_journal())]
        if rng.random() < 0.2:  # the writer catches up and flushes
            ops = [terminal_deltas.decode_deltas("log", value) for _, value in log[writer_at:]]
            writer.apply_terminal_ops(ops)
            changed = {t for op in ops for t in op.terminals}
            writer_at = len(log)
            for key, value in terminal_table.flush_records(
                writer.terminals, changed, Positions(deltas={0: writer_at}), "l", "d"
            ):
                table[key] = value
            flushed.append(dict(table))

    def restore(snapshot: dict) -> StreamingFeaturizer:
        restored = StreamingFeaturizer()
        positions = terminal_table.decode_positions(snapshot[POSITIONS_KEY], "l", "d")
        restored.terminals = StateTable(TERMINAL_STATE)
        for key, value in snapshot.items():
            if key != POSITIONS_KEY:
                restored.terminals.put_bytes(key, terminal_table.decode_terminal(key, value))
        restored.apply_terminal_ops(
            [terminal_deltas.decode_deltas("log", value) for _, value in log[positions.deltas[0] :]]
        )
        return restored

    fraud = LabelBatch(
        [t for b in labels for t in b.terminal_ids],
        np.concatenate([b.label_ts_us for b in labels]),
        np.concatenate([b.is_fraud for b in labels]),
        [e for b in labels for e in b.event_ids],
        [a for b in labels for a in b.account_ids],
    )
    expected = terminal_bytes(everything.terminals)
    assert len(flushed) >= 5
    for snapshot in flushed:
        restored = restore(snapshot)
        restored.observe_labels(fraud)
        assert terminal_bytes(restored.terminals) == expected
    for n, instance in enumerate(instances):
        instance.apply_terminal_ops([terminal_deltas.decode_deltas("log", v) for w, v in log if w != n])
        instance.observe_labels(fraud)
        assert terminal_bytes(instance.terminals) == expected


def test_an_events_op_folds_the_same_as_the_batch_that_made_it():
    featurizer = StreamingFeaturizer()
    featurizer.terminal_journal = []
    ts = np.array([10, 12, 11], dtype=np.int64) * 86_400_000_000
    featurizer.transform(EventBatch(["a"] * 3, ["t"] * 3, ts, np.ones(3)))
    (op,) = featurizer.take_terminal_journal()
    again = StreamingFeaturizer()
    again.apply_terminal_ops([TerminalOp(op.kind, op.terminals, op.days, op.events)])
    assert terminal_bytes(again.terminals) == terminal_bytes(featurizer.terminals)
