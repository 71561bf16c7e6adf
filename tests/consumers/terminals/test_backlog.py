"""A backlog in the feed (a bulk import of labels, a catch-up after an outage): the table writer reads it poll
after poll, in transactions of at most about FLUSH_RECORDS records whose positions each say exactly what
they hold; a scorer reads on for FEED_READ_S at most. The consumer and the producer are stand-ins (kafka-
python's poll: at most max_records a call); the writer against the real broker:
tests/integration/test_service_labels.py."""

import threading
import time
from collections import namedtuple
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from kafka.structs import TopicPartition

from consumers.runtime.metrics import Metrics
from consumers.runtime.settings import load_serve_config
from consumers.scoring.messages import Label, MessageError, MessageLimits, encode_label
from consumers.service import batch_scoring
from consumers.service.batch_scoring import BatchScorer
from consumers.terminals import writer as terminal_writer
from consumers.terminals.feed import FeedRead, FeedReader, poll_records
from consumers.terminals.table import POSITIONS_KEY, Positions, decode_positions
from consumers.terminals.writer import TerminalTableWriter
from pipeline.features.stream import StreamingFeaturizer
from pipeline.features.stream_batches import TerminalOp

Record = namedtuple("Record", "topic partition offset key value timestamp")
NOW_US = time.time_ns() // 1000


class BacklogConsumer:
    """The feed's consumer with `n` fraud labels waiting on labels partition 0, label i at terminal T{i}."""

    def __init__(self, labels_topic: str, n: int):
        self.labels = TopicPartition(labels_topic, 0)
        sent_ms = NOW_US // 1000 - 3_600_000
        self.records = [
            Record(labels_topic, 0, i, b"A", encode_label(Label(f"E{i}", "A", f"T{i}", True, sent_ms * 1000)), sent_ms)
            for i in range(n)
        ]  # fmt: skip
        self.at: dict[TopicPartition, int] = {}

    def partitions_for_topic(self, topic):
        return {0}

    def assign(self, tps):
        self.at = {tp: 0 for tp in tps}

    def position(self, tp):
        return self.at[tp]

    def end_offsets(self, tps):
        return {tp: len(self.records) if tp == self.labels else 0 for tp in tps}

    def poll(self, timeout_ms=0, max_records=500):
        start = self.at[self.labels]
        got = self.records[start : start + max_records]
        self.at[self.labels] = start + len(got)
        return {self.labels: got} if got else {}

    def close(self):
        pass


class ScriptedProducer:
    def __init__(self, **settings):
        self.transactions: list[list] = []

    def init_transactions(self):
        pass

    def begin_transaction(self):
        self.transactions.append([])

    def send(self, topic, key, value, partition=None):
        self.transactions[-1].append((topic, key, value))

    def commit_transaction(self):
        pass

    def close(self, timeout=None):
        pass


def writer_over(
    monkeypatch, n: int, feed=BacklogConsumer
) -> tuple[TerminalTableWriter, BacklogConsumer, ScriptedProducer]:
    """A writer whose feed (`feed`, a BacklogConsumer) holds `n` labels and whose table is empty."""
    cfg = load_serve_config(None, overrides={"topic_prefix": "p-", "group_id": "g"}, env={})
    consumer, producer = feed(cfg.topic("labels"), n), ScriptedProducer()
    monkeypatch.setattr(terminal_writer, "KafkaProducer", lambda **settings: producer)
    offsets = SimpleNamespace(watermarks=consumer, close=lambda: None)
    monkeypatch.setattr(terminal_writer.Reader, "connect", lambda *args, **settings: offsets)
    monkeypatch.setattr(
        FeedReader, "connect", lambda bootstrap, client_id, reader, labels, deltas, *args, **settings: FeedReader(
            consumer, reader, labels, deltas, 10.0, MessageLimits()
        ),
    )  # fmt: skip
    monkeypatch.setattr(FeedReader, "start_from_table", lambda self, *args, **kwargs: [])
    return TerminalTableWriter(cfg, "unused:9092", Metrics()), consumer, producer


def run_until_read(writer: TerminalTableWriter, consumer: BacklogConsumer, within_s: float) -> float:
    """Run the writer until it has read the backlog (or `within_s` has passed), stop it; seconds taken."""
    stop, failed = threading.Event(), []
    thread = threading.Thread(target=lambda: _capture(failed, writer._run, stop))
    started = time.monotonic()
    thread.start()
    while consumer.at[consumer.labels] < len(consumer.records) and time.monotonic() - started < within_s:
        stop.wait(0.01)  # not time.sleep: a test may stand in for the writer's pauses
    took = time.monotonic() - started
    stop.set()
    thread.join(30)
    assert not failed, failed
    return took


def _capture(failed: list, run, *args) -> None:
    try:
        run(*args)
    except Exception as error:
        failed.append(error)


def test_a_backlog_is_read_poll_after_poll_not_one_poll_a_second(monkeypatch):
    # One poll each READ_EVERY_S read 500 records a second at most, whatever was waiting: 12 s for these.
    writer, consumer, _ = writer_over(monkeypatch, 6_000)
    took = run_until_read(writer, consumer, within_s=10.0)
    read = consumer.at[consumer.labels]
    print(f"read {read} labels in {took:.2f} s: {read / took:,.0f} a second")
    assert read == 6_000 and took < 4.0, f"{read} labels in {took:.1f} s"


def test_a_backlog_is_flushed_in_bounded_transactions_each_holding_what_its_positions_say(monkeypatch):
    monkeypatch.setattr(terminal_writer, "FLUSH_RECORDS", 100)
    # Behind: its polls full for longer than READ_EVERY_S (this backlog is read in well under a second).
    monkeypatch.setattr(terminal_writer, "READ_EVERY_S", 0.0)
    paces = []
    monkeypatch.setattr(terminal_writer.time, "sleep", lambda s: paces.append(s))
    writer, consumer, producer = writer_over(monkeypatch, 1_000)
    run_until_read(writer, consumer, within_s=10.0)  # terminal_table_flush_s is 10 s: only the cap flushes

    poll = poll_records(writer.cfg.max_poll_records)
    held: set[str] = set()
    for records in producer.transactions:
        assert len(records) <= 100 + poll + 1 and records[-1][1] == POSITIONS_KEY
        held |= {key for _, key, _ in records[:-1]}
        positions = decode_positions(records[-1][2], "p-labels", "p-terminal-deltas")
        # the table is exactly the fold of the labels before its positions: T{i} for each label i
        assert held == {f"T{i}" for i in range(positions.labels[0])}
    assert len(producer.transactions) >= 10 and positions.labels[0] == 1_000
    assert paces == []  # behind, a writer does not pause between chunks


class SteadyConsumer(BacklogConsumer):
    """The backlog's labels arriving steadily, `rate` a second from its creation, none waiting at first."""

    rate = 60.0  # e.g. 3 instances scoring 20 batches a second: a delta each, more than a poll a second

    def __init__(self, labels_topic: str, n: int):
        super().__init__(labels_topic, n)
        self.started = time.monotonic()

    def arrived(self) -> int:
        return min(len(self.records), int((time.monotonic() - self.started) * self.rate))

    def end_offsets(self, tps):
        return {tp: self.arrived() if tp == self.labels else 0 for tp in tps}

    def poll(self, timeout_ms=0, max_records=500):
        start = self.at[self.labels]
        got = self.records[start : min(self.arrived(), start + max_records)]
        self.at[self.labels] = start + len(got)
        return {self.labels: got} if got else {}


def test_a_writer_keeping_up_with_steady_arrivals_paces_its_flushes_and_drains_on_stop(monkeypatch):
    # More than a poll's records arrive each READ_EVERY_S, so the first poll after each wait comes back full;
    # the polls after it catch up at once: the writer is not behind, and its flushes spare the scorer.
    writer, consumer, producer = writer_over(monkeypatch, 1_000, SteadyConsumer)
    writer.cfg = replace(writer.cfg, terminal_table_flush_s=1.0)
    assert consumer.rate > poll_records(writer.cfg.max_poll_records) / terminal_writer.READ_EVERY_S
    flushes = []
    transaction = TerminalTableWriter._transaction
    monkeypatch.setattr(
        TerminalTableWriter, "_transaction", lambda self, p, records, paced: (
            flushes.append(paced), transaction(self, p, records, paced)
        ),
    )  # fmt: skip
    stop, failed = threading.Event(), []
    thread = threading.Thread(target=lambda: _capture(failed, writer._run, stop))
    thread.start()
    stop.wait(3.5)
    arrived = consumer.arrived()
    stop.set()
    thread.join(30)
    assert not failed, failed
    assert len(flushes) >= 3 and all(flushes[:-1]), flushes  # the last one, stopping, goes at once
    last = decode_positions(producer.transactions[-1][-1][2], "p-labels", "p-terminal-deltas")
    assert last.labels[0] >= arrived  # stopping, it read what had arrived


def flush_tombstones(monkeypatch, tombstones: int) -> list[list]:
    """One flush of 3 changed terminals, a dead letter and `tombstones` let go over the cap, with
    FLUSH_RECORDS 10; the transactions sent."""
    monkeypatch.setattr(terminal_writer, "FLUSH_RECORDS", 10)
    cfg = load_serve_config(None, overrides={"topic_prefix": "p-", "group_id": "g"}, env={})
    metrics = Metrics()
    writer, featurizer, producer = (
        TerminalTableWriter(cfg, "unused:9092", metrics),
        StreamingFeaturizer(),
        ScriptedProducer(),
    )
    featurizer.apply_terminal_ops([TerminalOp("events", ["c1", "c2", "c3"], np.array([5, 5, 5]))])
    bad = [(Record("p-labels", 0, 7, b"k", b"{nope", 0), MessageError("not JSON"))]
    gone = {f"gone{i:03d}" for i in range(tombstones)}
    table_at, read_to = Positions(labels={0: 3}, deltas={0: 4}), Positions(labels={0: 8}, deltas={0: 9})
    writer._flush(producer, featurizer, {"c1", "c2", "c3"}, bad, read_to, True, (), gone, table_at=table_at)
    assert metrics.get("txsentinel_terminal_table_flushes_total") == len(producer.transactions)
    for records in producer.transactions:
        assert len(records) <= 10 and records[-1][1] == POSITIONS_KEY
    ends = [
        decode_positions(records[-1][2], "p-labels", "p-terminal-deltas") for records in producer.transactions
    ]
    assert ends[-1] == read_to and all(end == table_at for end in ends[:-1])  # fmt: skip
    sent = [key for records in producer.transactions for _, key, value in records if value is None]
    assert sorted(sent) == sorted(gone)  # each tombstone once
    last = producer.transactions[-1]
    assert [topic for topic, _, _ in last].count("p-dead-letter") == 1  # with the positions past it, only
    assert {key for _, key, value in last if value is not None} >= {"c1", "c2", "c3"}
    return producer.transactions


def test_tombstones_beyond_a_transaction_go_first_in_their_own_ending_with_the_tables_positions(monkeypatch):
    transactions = flush_tombstones(
        monkeypatch, 25
    )  # 9 + 9 alone, then 2 beside the 5 others and the positions
    assert [len(records) for records in transactions] == [10, 10, 3, 10]


def test_tombstones_that_fit_go_in_the_one_transaction(monkeypatch):
    assert [len(records) for records in flush_tombstones(monkeypatch, 4)] == [9]


# -- a scorer reads on while polls come back full, for FEED_READ_S at most ---------------------------------


class BacklogFeed:
    """Full reads of one delta each, `full` of them, then one that is not full."""

    def __init__(self, full: int):
        self.full, self.reads = full, 0

    def read(self, session):
        self.reads += 1
        op = TerminalOp("events", [f"t{self.reads}"], np.array([20_000]))
        return FeedRead(deltas=[op], full=self.reads <= self.full)


def scorer_over(feed) -> BatchScorer:
    cfg = load_serve_config(None, overrides={"terminal_feed_interval_ms": 250}, env={})
    return BatchScorer(cfg, SimpleNamespace(featurizer=StreamingFeaturizer()), feed, "1", True, None, None)


def test_a_scorer_reads_on_while_polls_come_back_full(monkeypatch):
    feed = BacklogFeed(full=30)
    batches = scorer_over(feed)
    assert feed.poll_records == poll_records(500)
    monkeypatch.setattr(batch_scoring.time, "monotonic", lambda: 100.0)  # no time passes
    assert batches.fold_feed() == (0, 31) and feed.reads == 31
    assert len(batches.scorer.featurizer.terminals) == 31


@pytest.mark.parametrize("read_s", [1 / 64, 1 / 32])  # exact in binary: the clock sums them exactly
def test_a_scorer_reads_a_backlog_for_feed_read_s_at_most_then_scores(monkeypatch, read_s):
    feed = BacklogFeed(full=1_000)
    batches = scorer_over(feed)
    clock = iter(100.0 + read_s * i for i in range(1_000))
    monkeypatch.setattr(batch_scoring.time, "monotonic", lambda: next(clock))
    _, deltas = batches.fold_feed()
    assert deltas == feed.reads == int(np.ceil(batch_scoring.FEED_READ_S / read_s))
