"""The guarantees the scoring service relies on, checked against the project's real Kafka broker.

Keyed partitioning and group offsets (scale-out and resume), transactions with offsets inside them
(exactly-once output), compaction (the state changelog), and durability across a broker restart.
"""

from __future__ import annotations

import time
import uuid

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.serializer import DefaultSerializer
from kafka.structs import OffsetAndMetadata, TopicPartition

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(180)]

POLL_MS = 200
# Keys are account ids (str <-> UTF-8). kafka-python 3 deprecates plain functions as (de)serializers.
KEYS = DefaultSerializer()


def _producer(bootstrap: str, **config) -> KafkaProducer:
    return KafkaProducer(bootstrap_servers=bootstrap, acks="all", key_serializer=KEYS, **config)


def _group_consumer(bootstrap: str, topic: str, group: str, **config) -> KafkaConsumer:
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        key_deserializer=KEYS,
        **config,
    )
    consumer.subscribe([topic])
    # Fetch the topic's metadata before the first poll. kafka-python 3.0.12 can otherwise lose its own
    # assignment: the first join assigns nothing (no metadata yet), the metadata then triggers a rejoin,
    # and if poll() times out while that rejoin is in flight the new assignment is never applied. The
    # consumer then idles in a stable group with no partitions.
    consumer.partitions_for_topic(topic)
    return consumer


def _poll_n(consumer: KafkaConsumer, count: int, timeout_s: float = 30.0) -> list:
    """Polls until exactly ``count`` records arrived; ``max_records`` keeps it from taking more."""
    records: list = []
    deadline = time.monotonic() + timeout_s
    while len(records) < count:
        assert time.monotonic() < deadline, f"got {len(records)} of {count} records within {timeout_s} s"
        batches = consumer.poll(timeout_ms=POLL_MS, max_records=count - len(records))
        for batch in batches.values():
            records.extend(batch)
    return records


def _read_all(bootstrap: str, topic: str, isolation_level: str = "read_uncommitted", timeout_s: float = 20.0):
    """Every record of ``topic`` from offset 0 up to its current end, without joining a group."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, isolation_level=isolation_level, key_deserializer=KEYS
    )
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        consumer.assign(partitions)
        consumer.seek_to_beginning()
        # For read_committed the end offset is the last stable offset; the consumer's position moves past
        # aborted batches and transaction markers too, so "position == end" terminates in both modes.
        end = consumer.end_offsets(partitions)
        records: list = []
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < end[tp] for tp in partitions):
            assert time.monotonic() < deadline, f"could not read {topic} up to {end} within {timeout_s} s"
            for batch in consumer.poll(timeout_ms=POLL_MS).values():
                records.extend(batch)
        return records
    finally:
        consumer.close()


def test_keyed_records_share_a_partition_and_a_group_resumes_after_its_commit(kafka_bootstrap, topic_factory):
    topic = topic_factory("keyed", partitions=3)
    keys = [f"account-{i}" for i in range(6)]
    producer = _producer(kafka_bootstrap)
    for seq in range(5):
        for key in keys:
            producer.send(topic, key=key, value=f"{key}:{seq}".encode())
    producer.flush()
    producer.close()

    group = f"group-{uuid.uuid4().hex[:8]}"
    first = _group_consumer(kafka_bootstrap, topic, group)
    seen = _poll_n(first, 12)
    # Commit exactly what was processed (offset of the next record to read), not the fetch position.
    processed = {}
    for record in seen:
        tp = TopicPartition(record.topic, record.partition)
        processed[tp] = max(processed.get(tp, 0), record.offset + 1)
    first.commit({tp: OffsetAndMetadata(offset, "", -1) for tp, offset in processed.items()})
    assert {tp: first.committed(tp) for tp in processed} == processed
    first.close(autocommit=False)

    second = _group_consumer(kafka_bootstrap, topic, group)
    rest = _poll_n(second, 30 - len(seen))
    second.close(autocommit=False)

    for tp, committed in processed.items():
        resumed = [r.offset for r in rest if (r.topic, r.partition) == tp]
        assert not resumed or min(resumed) == committed, (
            f"{tp} resumed at {min(resumed)}, committed {committed}"
        )
    everything = seen + rest
    assert len({(r.partition, r.offset) for r in everything}) == 30, "a record was read twice or never"
    partitions_of = {key: {r.partition for r in everything if r.key == key} for key in keys}
    assert all(len(p) == 1 for p in partitions_of.values()), f"a key spans partitions: {partitions_of}"
    assert len(set().union(*partitions_of.values())) > 1, "all keys hashed to one partition: nothing shown"
    # Within a key the order is the produce order, the property per-account state depends on.
    for key in keys:
        in_partition = sorted((r for r in everything if r.key == key), key=lambda r: r.offset)
        assert [r.value.decode() for r in in_partition] == [f"{key}:{seq}" for seq in range(5)]


def test_aborted_transactions_are_invisible_to_read_committed_consumers(kafka_bootstrap, topic_factory):
    topic = topic_factory("txn-visibility")
    producer = _producer(kafka_bootstrap, transactional_id=f"txs-test-{uuid.uuid4().hex[:8]}")
    producer.init_transactions()
    for outcome in ("commit-1", "abort-1", "commit-2"):
        producer.begin_transaction()
        for i in range(2):
            producer.send(topic, key="k", value=f"{outcome}/{i}".encode())
        # Flush first so the aborted records really reach the log; an abort may otherwise drop them
        # unsent, and the read_uncommitted check below would prove nothing.
        producer.flush()
        if outcome.startswith("commit"):
            producer.commit_transaction()
        else:
            producer.abort_transaction()
    producer.close()

    committed = [r.value.decode() for r in _read_all(kafka_bootstrap, topic, "read_committed")]
    everything = [r.value.decode() for r in _read_all(kafka_bootstrap, topic, "read_uncommitted")]
    assert committed == ["commit-1/0", "commit-1/1", "commit-2/0", "commit-2/1"]
    assert everything == ["commit-1/0", "commit-1/1", "abort-1/0", "abort-1/1", "commit-2/0", "commit-2/1"]


def test_offsets_sent_to_a_transaction_commit_and_abort_with_its_output(kafka_bootstrap, topic_factory):
    source, sink = topic_factory("txn-in"), topic_factory("txn-out")
    plain = _producer(kafka_bootstrap)
    for i in range(6):
        plain.send(source, key="k", value=f"event-{i}".encode())
    plain.flush()
    plain.close()

    group = f"scorer-{uuid.uuid4().hex[:8]}"
    # read_committed also makes committed() ask for stable offsets (it waits out pending transactions).
    consumer = _group_consumer(kafka_bootstrap, source, group, isolation_level="read_committed")
    producer = _producer(kafka_bootstrap, transactional_id=f"scorer-{uuid.uuid4().hex[:8]}")
    producer.init_transactions()
    tp = TopicPartition(source, 0)

    def process(records, commit: bool) -> None:
        # consume-transform-produce: outputs and the input offset succeed or fail together.
        producer.begin_transaction()
        for record in records:
            producer.send(sink, key=record.key, value=b"score-of-" + record.value)
        next_offset = records[-1].offset + 1
        # group_metadata() carries member id and generation, so the broker can fence a zombie (KIP-447).
        producer.send_offsets_to_transaction(
            {tp: OffsetAndMetadata(next_offset, "", -1)}, consumer.group_metadata()
        )
        producer.flush()
        if commit:
            producer.commit_transaction()
        else:
            producer.abort_transaction()

    process(_poll_n(consumer, 3), commit=True)
    assert consumer.committed(tp) == 3

    aborted = _poll_n(consumer, 3)
    process(aborted, commit=False)
    assert consumer.committed(tp) == 3, "an aborted transaction moved the group's offset"

    # After an abort the service rewinds to the last committed offset and processes again.
    consumer.seek(tp, 3)
    process(_poll_n(consumer, 3), commit=True)
    assert consumer.committed(tp) == 6
    consumer.close(autocommit=False)
    producer.close()

    outputs = [r.value.decode() for r in _read_all(kafka_bootstrap, sink, "read_committed")]
    assert outputs == [f"score-of-event-{i}" for i in range(6)], "exactly once: each input scored once"
    # The aborted attempt is still in the log, only hidden: read_uncommitted sees 9 records.
    assert len(_read_all(kafka_bootstrap, sink, "read_uncommitted")) == 9


def test_compaction_keeps_only_the_latest_value_per_key(kafka_bootstrap, topic_factory):
    # segment.ms rolls a segment on the first append after 100 ms; only closed segments are compacted.
    # (Kafka 4 rejects segment.bytes below 1 MiB, so time is the only quick way to roll.)
    topic = topic_factory(
        "changelog",
        config={
            "cleanup.policy": "compact",
            "segment.ms": 100,
            "min.cleanable.dirty.ratio": 0.01,
            "min.compaction.lag.ms": 0,
            "delete.retention.ms": 100,
        },
    )
    keys = [f"account-{i}" for i in range(5)]
    producer = _producer(kafka_bootstrap)
    for version in range(3):
        for key in keys:
            producer.send(topic, key=key, value=f"{key}@v{version}".encode())
        producer.send(topic, key="closed-account", value=b"alive" if version == 0 else None)
        producer.flush()
        time.sleep(0.3)
    # One more record rolls the segment holding the latest values, so the cleaner may compact it too.
    producer.send(topic, key="roll", value=b"x")
    producer.flush()
    producer.close()

    latest = {key: f"{key}@v2" for key in keys}
    deadline = time.monotonic() + 60
    while True:
        records = _read_all(kafka_bootstrap, topic)
        values = [(r.key, r.value.decode() if r.value is not None else None) for r in records]
        by_key = [(k, v) for k, v in values if k in latest]
        if sorted(by_key) == sorted(latest.items()):
            break
        assert time.monotonic() < deadline, f"compaction did not finish within 60 s; the topic holds {values}"
        time.sleep(1)
    # A tombstone deletes a key: its live value is gone, at most the tombstone itself remains.
    assert [v for k, v in values if k == "closed-account"] in ([], [None])


def test_records_and_committed_offsets_survive_a_broker_restart(kafka_broker, kafka_bootstrap, topic_factory):
    topic = topic_factory("durable", partitions=2)
    producer = _producer(kafka_bootstrap)
    for i in range(10):
        producer.send(topic, key=f"account-{i % 4}", value=f"event-{i}".encode())
    producer.flush()
    producer.close()

    group = f"group-{uuid.uuid4().hex[:8]}"
    consumer = _group_consumer(kafka_bootstrap, topic, group)
    seen = _poll_n(consumer, 4)
    offsets = {}
    for record in seen:
        tp = TopicPartition(record.topic, record.partition)
        offsets[tp] = max(offsets.get(tp, 0), record.offset + 1)
    consumer.commit({tp: OffsetAndMetadata(offset, "", -1) for tp, offset in offsets.items()})
    consumer.close(autocommit=False)

    kafka_broker.restart()

    before = sorted(f"event-{i}" for i in range(10))
    assert sorted(r.value.decode() for r in _read_all(kafka_bootstrap, topic)) == before
    resumed = _group_consumer(kafka_bootstrap, topic, group)
    try:
        assert {tp: resumed.committed(tp) for tp in offsets} == offsets
        rest = _poll_n(resumed, 6)
    finally:
        resumed.close(autocommit=False)
    assert sorted(r.value.decode() for r in seen + rest) == before
