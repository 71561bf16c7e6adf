"""The table writer's flush: one transaction that holds the bad labels' dead letters, the changed terminals and,
last, the positions (a table read ends on them: consumers/terminals/table.py). The producer is a scripted
stand-in; the writer against the real broker: tests/integration/test_service_labels.py."""

import json
import time
from collections import namedtuple

import numpy as np

from consumers.runtime.metrics import Metrics
from consumers.runtime.settings import load_serve_config
from consumers.scoring.messages import Label, MessageError, MessageLimits, encode_label
from consumers.terminals import writer as terminal_writer
from consumers.terminals.feed import FeedRead, FeedReader
from consumers.terminals.table import POSITIONS_KEY, Positions, decode_positions
from consumers.terminals.writer import TerminalTableWriter
from pipeline.features.stream import StreamingFeaturizer
from pipeline.features.stream_batches import TerminalOp

Record = namedtuple("Record", "topic partition offset key value timestamp", defaults=[None])


class ScriptedProducer:
    def __init__(self):
        self.log = []

    def begin_transaction(self):
        self.log.append(("begin",))

    def send(self, topic, key, value, partition=None):
        self.log.append(("send", topic, key, value))

    def commit_transaction(self):
        self.log.append(("commit",))


def test_a_flush_is_one_transaction_ending_with_the_positions_and_counts_what_it_wrote():
    cfg = load_serve_config(None, overrides={"topic_prefix": "p-", "group_id": "g"}, env={})
    metrics = Metrics()
    writer = TerminalTableWriter(cfg, "unused:9092", metrics)
    assert writer.transactional_id == "txsentinel-scorer-terminal-table-g"  # one per deployment
    featurizer, changed = StreamingFeaturizer(), set()
    got = FeedRead(
        deltas=[TerminalOp("events", ["t2", "t1", "t2"], np.array([5, 5, 6]))],
        bad=[(Record("p-labels", 0, 7, b"k", b"{nope"), MessageError("not valid UTF-8 JSON"))],
    )
    writer._fold(featurizer, got, changed)
    producer = ScriptedProducer()
    positions = Positions(labels={0: 8}, deltas={0: 3})
    writer._flush(producer, featurizer, changed, got.bad, positions, table_at=Positions())

    kinds = [entry[0] for entry in producer.log]
    assert kinds == ["begin", "send", "send", "send", "send", "commit"]
    dead = producer.log[1]
    assert dead[1] == "p-dead-letter" and json.loads(dead[3])["source_offset"] == 7
    assert [(e[1], e[2]) for e in producer.log[2:5]] == [
        ("p-terminal-risk-table", "t1"), ("p-terminal-risk-table", "t2"), ("p-terminal-risk-table", POSITIONS_KEY)
    ]  # fmt: skip
    assert decode_positions(producer.log[4][3], "p-labels", "p-terminal-deltas") == positions
    assert (writer.stats.flushes, writer.stats.terminals_written, writer.stats.dead_lettered) == (
        1,
        2,
        1,
    )
    assert metrics.get("txsentinel_terminal_table_flushes_total") == 1
    assert metrics.get("txsentinel_events_dead_lettered_total") == 1


def test_a_label_withdrawing_a_report_has_its_terminal_written_by_the_next_flush():
    cfg = load_serve_config(None, overrides={"topic_prefix": "p-", "group_id": "g"}, env={})
    writer = TerminalTableWriter(cfg, "unused:9092", Metrics())
    featurizer, day_us = StreamingFeaturizer(), 20_000 * 86_400_000_000
    writer._fold(featurizer, FeedRead(labels=[Label("E1", "A1", "T1", True, day_us)]), set())
    changed = set()
    withdrawals = [Label("E1", "A1", "T1", False, day_us + 1), Label("E2", "A2", "T9", False, day_us + 1)]
    writer._fold(featurizer, FeedRead(labels=withdrawals), changed)
    assert changed == {"T1"}  # T9 holds no report to withdraw: no record
    producer = ScriptedProducer()
    writer._flush(producer, featurizer, changed, [], Positions(), table_at=Positions())
    (written,) = [entry for entry in producer.log if entry[0] == "send" and entry[2] == "T1"]
    assert written[3].endswith(featurizer.terminals.get_bytes("T1"))
    assert featurizer.terminals.records["report_count"].sum() == 0


def test_a_big_flush_pauses_between_chunks_in_its_one_transaction_unless_stopping(monkeypatch):
    cfg = load_serve_config(None, overrides={"topic_prefix": "p-", "group_id": "g"}, env={})
    writer = TerminalTableWriter(cfg, "unused:9092", Metrics())
    featurizer, changed = StreamingFeaturizer(), set()
    terminals = [f"t{i:03d}" for i in range(2 * terminal_writer.FLUSH_CHUNK + 50)]
    writer._fold(
        featurizer,
        FeedRead(deltas=[TerminalOp("events", terminals, np.zeros(len(terminals), dtype=np.int64))]),
        changed,
    )
    producer = ScriptedProducer()
    monkeypatch.setattr(terminal_writer.time, "sleep", lambda s: producer.log.append(("pause",)))

    writer._flush(producer, featurizer, changed, [], Positions(), table_at=Positions())
    kinds = [entry[0] for entry in producer.log]
    assert kinds.count("begin") == 1 and kinds[-1] == "commit" and kinds.count("send") == len(terminals) + 1
    pauses = [i for i, kind in enumerate(kinds) if kind == "pause"]
    chunk = terminal_writer.FLUSH_CHUNK
    assert pauses == [1 + chunk, 2 + 2 * chunk]  # after each full chunk, none after the last
    assert producer.log[-2][2] == POSITIONS_KEY  # still the last record

    producer.log.clear()
    # stopping: at once
    writer._flush(producer, featurizer, changed, [], Positions(), paced=False, table_at=Positions())
    assert ("pause",) not in producer.log


# -- the labels path keeps the service's promises ----------------------------------------------------------


class StandInConsumer:
    def partitions_for_topic(self, topic):
        return {0}

    def assign(self, tps):
        pass


def label_record(offset: int, value: bytes | None, sent_ms: int | None = None) -> Record:
    return Record("p-labels", 0, offset, b"A1", value, sent_ms)


def test_hostile_labels_are_set_aside_with_their_reasons_and_never_raise():
    feed = FeedReader(StandInConsumer(), None, "p-labels", "p-terminal-deltas", 1.0, MessageLimits())
    now_us = int(time.time() * 1e6)
    good = Label("E1", "A1", "T1", True, now_us - 3_600_000_000)
    values = [
        encode_label(good),
        b"[" * 10_000,  # RecursionError in the parser, once
        encode_label(Label("E2", "A1", "T\ud800", True, now_us)),
        encode_label(Label("E3", "A1", "T1", True, now_us + 10 * 3_600_000_000)),  # 10 h after its record
        b'{"event_id":"E4","account_id":"A1","terminal_id":"T1","is_fraud":1e999,"label_ts":0}',
        None,
    ]
    records = [label_record(offset, value, now_us // 1000) for offset, value in enumerate(values)]
    out = FeedRead()
    feed._labels(records, out, now_us)
    assert out.labels == [good] and out.label_records == [records[0]]
    reasons = {record.offset: str(error) for record, error in out.bad}
    assert sorted(reasons) == [1, 2, 3, 4, 5]
    assert "nested 10000 deep" in reasons[1] and "lone surrogate" in reasons[2]
    assert "36000 s after the timestamp of its record" in reasons[3]
    assert "'is_fraud': expected true or false" in reasons[4]


def test_a_label_whose_fold_fails_is_rolled_back_and_set_aside_and_the_others_are_folded(caplog):
    featurizer, clean = StreamingFeaturizer(), StreamingFeaturizer()
    featurizer.terminal_journal = []
    fold = featurizer._fold_terminal_reports

    def faulty(terminals, slots, days, events, fraud):
        fold(
            terminals, slots, days, events, fraud
        )  # changes the state, then fails: the rollback must undo it
        if "poison" in terminals:
            raise IndexError("a fault nobody foresaw")

    featurizer._fold_terminal_reports = faulty
    labels = [Label(f"E{i}", "A1", t, True, 5 * 86_400_000_000) for i, t in enumerate(["T1", "poison", "T2"])]
    records = [label_record(i, b"...") for i in range(3)]
    delta = TerminalOp("events", ["T1", "poison"], np.array([5, 5]))
    got = FeedRead(labels=list(labels), label_records=records, deltas=[delta], delta_records=[None])
    got.fold_into(featurizer)
    assert [label.terminal_id for label in got.labels] == ["T1", "T2"]
    assert [(record.offset, str(error)) for record, error in got.bad] == [
        (1, "folding this label failed: IndexError('a fault nobody foresaw')")
    ]
    FeedRead(labels=[labels[0], labels[2]], deltas=[delta]).fold_into(clean)
    for terminal in ("T1", "T2", "poison"):
        assert featurizer.terminals.get_bytes(terminal) == clean.terminals.get_bytes(terminal), terminal
    assert "folding them one at a time" in caplog.text
