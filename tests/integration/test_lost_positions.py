"""Internal readers whose stored position has left the log, against the real broker: records are deleted
under them (DeleteRecords, as retention would), and they must say so, never jump to the log's end unsaid
(consumers/runtime/compacted.py, consumers/terminals/feed.py; docs/operations.md, "Lost feed positions")."""

import time

import pytest
from kafka import KafkaAdminClient, KafkaProducer
from kafka.structs import TopicPartition

from consumers.runtime.compacted import PositionLostError, Reader, read_at
from consumers.runtime.metrics import Metrics
from consumers.runtime.topics import ensure_topics
from consumers.scoring.messages import Label, MessageLimits, encode_label
from consumers.terminals.feed import FeedReader
from consumers.terminals.table import POSITIONS_KEY, Positions, encode_positions
from pipeline.features.stream import StreamingFeaturizer
from tests.integration.service_helpers import prefixed_configs

pytestmark = [pytest.mark.kafka]


def delete_before(bootstrap: str, topic: str, offset: int) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.delete_records({TopicPartition(topic, 0): offset})
    finally:
        admin.close()


def labels(n: int) -> list[bytes]:
    now_us = time.time_ns() // 1000
    return [encode_label(Label(f"E{i}", f"A{i}", f"T{i}", True, now_us - 60_000_000)) for i in range(n)]


@pytest.fixture
def feed_topics(kafka_bootstrap):
    """A deployment's topics (one partition each) whose table says it has read labels up to offset 1, and
    whose labels 0..2 have since been deleted: 5 labels written, 2 still there."""
    with prefixed_configs(kafka_bootstrap, "lost", transactions_partitions=1) as make:
        cfg = make()
        ensure_topics(cfg, kafka_bootstrap)
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        for value in labels(5):
            producer.send(cfg.topic("labels"), key=b"A", value=value, partition=0)
        positions = Positions(labels={0: 1}, deltas={0: 0})
        value = encode_positions(positions, cfg.topic("labels"), cfg.topic("terminal_deltas"))
        producer.send(cfg.topic("terminal_table"), key=POSITIONS_KEY.encode(), value=value, partition=0)
        producer.flush()
        producer.close()
        delete_before(kafka_bootstrap, cfg.topic("labels"), 3)
        yield cfg


def start_feed(cfg, bootstrap: str, lost_position: str, on_lost=None) -> tuple[FeedReader, Reader]:
    reader = Reader.connect(bootstrap, "test-lost")
    feed = FeedReader.connect(
        bootstrap, "test-lost-feed", reader, cfg.topic("labels"), cfg.topic("terminal_deltas"), 30.0,
        MessageLimits(), lost_position, on_lost,
    )  # fmt: skip
    feed.start_from_table(
        StreamingFeaturizer(), reader, cfg.topic("terminal_table"), row_limit=None
    )  # labels: 1
    return feed, reader


def test_a_feed_position_deleted_unread_stops_the_reader_naming_what_was_lost(kafka_bootstrap, feed_topics):
    cfg = feed_topics
    feed, reader = start_feed(cfg, kafka_bootstrap, "fail")
    try:
        with pytest.raises(PositionLostError) as lost:
            feed.read(to_high_watermark=True)
    finally:
        feed.close()
        reader.close()
    message = str(lost.value)
    assert f"'{cfg.topic('labels')}' partition 0 at offset 1" in message
    assert "the log now starts at 3, so 2 records were deleted unread" in message
    assert "lost_feed_position: earliest" in message and "terminal_deltas_retention_ms" in message


def test_with_earliest_the_reader_goes_on_from_the_logs_start_and_counts_what_was_lost(
    kafka_bootstrap, feed_topics
):
    metrics = Metrics()
    feed, reader = start_feed(
        feed_topics, kafka_bootstrap, "earliest",
        lambda records: metrics.inc("txsentinel_feed_records_lost_total", records),
    )  # fmt: skip
    try:
        got = feed.read(to_high_watermark=True)
        assert [label.event_id for label in got.labels] == ["E3", "E4"]  # the two still there, none skipped
        assert feed.records_lost == 2
        assert metrics.get("txsentinel_feed_records_lost_total") == 2
        assert feed.positions().labels == {0: 5}
    finally:
        feed.close()
        reader.close()


def test_a_restore_whose_record_was_deleted_names_it_instead_of_reading_on(kafka_bootstrap, topic_factory):
    topic = topic_factory("lost-state")  # delete retention: DeleteRecords is refused on compacted topics
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    for i in range(4):
        producer.send(topic, key=f"k{i}".encode(), value=b"state", partition=0)
    producer.flush()
    producer.close()
    delete_before(kafka_bootstrap, topic, 2)
    reader = Reader.connect(kafka_bootstrap, "test-lost-state")
    try:
        with pytest.raises(PositionLostError, match=r"partition 0 at offset 1: the log now starts at 2"):
            read_at(reader, topic, {"k1": (0, 1), "k3": (0, 3)}, timeout_s=30)
    finally:
        reader.close()
