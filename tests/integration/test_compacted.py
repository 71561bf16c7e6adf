"""Reading a compacted state topic back (consumers/runtime/compacted.py), and account states restored from one
(consumers/service/state_restore.py), against the real broker."""

import threading
import time
import uuid

import pytest
import torch
from kafka import KafkaProducer

from consumers.runtime.compacted import Reader, read_at, read_latest, read_recent
from consumers.scoring.messages import Transaction
from consumers.scoring.scorer import Scorer
from consumers.service.state_restore import restore_partitions
from models.registry import build_detector
from pipeline.features.definitions import FEATURE_NAMES
from pipeline.features.spec import FeatureSpec
from pipeline.registry.artifact import LoadedModel

pytestmark = [pytest.mark.kafka]


def reader(bootstrap: str) -> Reader:
    return Reader.connect(bootstrap, "test-compacted")


def transactional(bootstrap: str) -> KafkaProducer:
    producer = KafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"t-{uuid.uuid4().hex[:8]}")
    producer.init_transactions()
    return producer


def test_last_value_per_key_wins_tombstones_read_as_none_and_aborted_records_never_count(
    kafka_bootstrap, topic_factory
):
    topic = topic_factory("compacted", partitions=2)
    plain = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    for key, value, partition in [
        ("a", b"a1", 0), ("b", b"b1", 1), ("a", b"a2", 0), ("c", b"c1", 1), ("c", None, 1),
    ]:  # fmt: skip
        plain.send(topic, key=key.encode(), value=value, partition=partition)
    plain.flush()
    plain.close()
    zombie = transactional(kafka_bootstrap)
    zombie.begin_transaction()
    zombie.send(topic, key=b"b", value=b"b-aborted", partition=1)
    zombie.flush()
    zombie.abort_transaction()
    zombie.close()

    consumer = reader(kafka_bootstrap)
    try:
        latest, read = read_latest(consumer, topic, [0, 1], timeout_s=30)
        assert latest == {"a": b"a2", "b": b"b1", "c": None}
        assert read == 5
        assert consumer.committed.assignment() == set()  # unassigned afterwards, ready for the next restore
        only_0, _ = read_latest(consumer, topic, [0], timeout_s=30)
        assert only_0 == {"a": b"a2"}
    finally:
        consumer.close()


def test_a_keyless_record_is_refused_naming_where_it_is(kafka_bootstrap, topic_factory):
    topic = topic_factory("compacted")
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    producer.send(topic, key=b"a", value=b"1", partition=0)
    producer.send(topic, value=b"stray", partition=0)
    producer.flush()
    producer.close()
    consumer = reader(kafka_bootstrap)
    try:
        with pytest.raises(ValueError, match=r"partition 0 offset 1 has no key"):
            read_latest(consumer, topic, [0], timeout_s=30)
    finally:
        consumer.close()


def test_bounded_read_keeps_the_latest_written_and_where_each_live_key_is(kafka_bootstrap, topic_factory):
    topic = topic_factory("compacted", partitions=2)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    for key, value, partition in [
        ("a", b"a1", 0), ("b", b"b1", 1), ("c", b"c1", 0), ("a", b"a2", 0), ("d", b"d1", 1), ("b", None, 1),
    ]:  # fmt: skip
        producer.send(topic, key=key.encode(), value=value, partition=partition)
    producer.flush()
    producer.close()
    consumer = reader(kafka_bootstrap)
    try:
        # Which keys are "written last" depends on how the partitions interleave in the read, and a key
        # deleted late leaves its room empty: up to two of the live ones.
        values, where, read = read_recent(consumer, topic, [0, 1], timeout_s=30, keep=2)
        assert read == 6 and where == {"a": (0, 2), "c": (0, 1), "d": (1, 1)}  # b was deleted
        assert 1 <= len(values) <= 2 and values.items() <= {"a": b"a2", "c": b"c1", "d": b"d1"}.items()
        everything, _, _ = read_recent(consumer, topic, [0, 1], timeout_s=30, keep=10)
        assert everything == {"a": b"a2", "c": b"c1", "d": b"d1"}

        assert read_at(consumer, topic, where, timeout_s=30) == everything  # each read back from its place
        assert consumer.committed.assignment() == set()
        with pytest.raises(ValueError, match=r"offset 0 holds b'a', not the last record of 'c'"):
            read_at(consumer, topic, {"c": (0, 0)}, timeout_s=30)
        zombie = transactional(kafka_bootstrap)
        zombie.begin_transaction()
        zombie.send(topic, key=b"e", value=b"e-aborted", partition=1)  # offset 3
        zombie.flush()
        zombie.abort_transaction()
        zombie.close()
        with pytest.raises(ValueError, match=r"partition 1 has no record at offset 3 .* of 'e' was expected"):
            read_at(consumer, topic, {"e": (1, 3)}, timeout_s=30)
    finally:
        consumer.close()


def test_records_committed_after_a_transaction_still_open_are_read_once_it_ends(
    kafka_bootstrap, topic_factory
):
    # A crashed instance's transaction holds read_committed readers at its first record; what others
    # committed after it lies beyond. Stopping at the last stable offset would silently miss "a".
    topic = topic_factory("compacted")
    open_txn = transactional(kafka_bootstrap)
    open_txn.begin_transaction()
    open_txn.send(topic, key=b"ghost", value=b"never committed", partition=0)
    open_txn.flush()
    plain = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    plain.send(topic, key=b"a", value=b"a1", partition=0)
    plain.flush()
    plain.close()
    ender = threading.Timer(2.0, open_txn.abort_transaction)
    ender.start()
    consumer = reader(kafka_bootstrap)
    try:
        started = time.monotonic()
        latest, read = read_latest(consumer, topic, [0], timeout_s=30)
        assert latest == {"a": b"a1"} and read == 1
        assert time.monotonic() - started > 1.5  # it waited for the transaction to end
    finally:
        ender.join()
        open_txn.close()
        consumer.close()


def test_a_read_until_a_key_takes_a_transaction_written_across_its_start_whole(
    kafka_bootstrap, topic_factory
):
    # The terminal table writer ends each flush with its positions record. A read that began while a flush
    # was being written must not stop in the middle of it (terminals ahead of the positions they came with).
    topic = topic_factory("compacted")
    writer = transactional(kafka_bootstrap)
    writer.begin_transaction()
    writer.send(topic, key=b"t1", value=b"t1@1", partition=0)
    writer.send(topic, key=b"POS", value=b"1", partition=0)
    writer.commit_transaction()
    writer.begin_transaction()
    writer.send(topic, key=b"t1", value=b"t1@2", partition=0)
    writer.flush()  # below the high watermark the read takes; the rest of the flush comes after it
    consumer = reader(kafka_bootstrap)
    result = {}
    read = threading.Thread(
        target=lambda: result.update(latest=read_latest(consumer, topic, [0], 30, last_key="POS")[0])
    )
    try:
        read.start()
        time.sleep(1.0)  # the read has taken its high watermark and waits for the open transaction
        # More than one poll's worth (max_poll_records 500): a read that stopped at its high watermark
        # would return after the first poll past it, in the middle of these.
        later = {f"t{i}": f"t{i}@2".encode() for i in range(2, 1202)}
        for key, value in later.items():
            writer.send(topic, key=key.encode(), value=value, partition=0)
        writer.send(topic, key=b"POS", value=b"2", partition=0)
        writer.commit_transaction()
        read.join(30)
        assert result["latest"] == {"t1": b"t1@2", **later, "POS": b"2"}
    finally:
        writer.close()
        consumer.close()


def test_what_follows_the_last_key_is_left_out_at_once_and_a_key_not_utf8_is_skipped(
    kafka_bootstrap, topic_factory, caplog
):
    # A record after the writer's last flush (another producer's, or garbage) ends no transaction with the
    # last key: the read must not wait for one that is not coming (it held every start to its timeout).
    topic = topic_factory("compacted")
    writer = transactional(kafka_bootstrap)
    writer.begin_transaction()
    writer.send(topic, key=b"t1", value=b"t1@1", partition=0)
    writer.send(topic, key=b"\xff\xfe", value=b"not a terminal", partition=0)
    writer.send(topic, key=b"POS", value=b"1", partition=0)
    writer.commit_transaction()
    writer.close()
    stray = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    stray.send(topic, key=b"t2", value=b"stray", partition=0)
    stray.flush()
    stray.close()
    consumer = reader(kafka_bootstrap)
    try:
        started = time.monotonic()
        latest, read = read_latest(consumer, topic, [0], 30, last_key="POS")
        assert time.monotonic() - started < 10
    finally:
        consumer.close()
    assert latest == {"t1": b"t1@1", "POS": b"1"} and read == 3
    assert "offset 1 skipped: its key is not UTF-8" in caplog.text
    assert "records after the last 'POS' record of" in caplog.text and "keys=1 first='t2'" in caplog.text


def test_a_restore_reads_each_accounts_last_state_into_a_store_that_grows_once(
    kafka_bootstrap, topic_factory
):
    n = len(FEATURE_NAMES)

    def scorer() -> Scorer:
        torch.manual_seed(0)
        detector = build_detector("lstm", {"num_features": n, "d_model": 8, "num_layers": 1})
        return Scorer(LoadedModel(detector=detector, spec=FeatureSpec(mean=(0.0,) * n, std=(1.0,) * n)))

    accounts = [f"A{i}" for i in range(1500)]
    source = scorer()
    topic = topic_factory("state", partitions=2)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    for round_ in range(2):  # every account's state twice: the first record is superseded
        source.score(
            [Transaction(f"E{round_}-{a}", a, 1_700_000_000_000_000 + round_, 10.0, "T") for a in accounts]
        )
        for i, (a, value) in enumerate(zip(accounts, source.account_states_bytes(accounts), strict=True)):
            producer.send(topic, key=a.encode(), value=value, partition=i % 2)
    producer.flush()
    producer.close()

    consumer = reader(kafka_bootstrap)
    try:
        restored = scorer()
        assert restored.store.capacity == 1024
        done = restore_partitions(restored, consumer, topic, [0, 1], timeout_s=60, keep=10**6)
        assert done.read == 3000 and sorted(done.accounts) == sorted(accounts)
        assert restored.account_states_bytes(accounts) == source.account_states_bytes(accounts)
        # one step to room for every record the read could find (3000), not doubling through 2048 to 4096
        assert restored.store.capacity == 3000

        kept = scorer()
        done = restore_partitions(kept, consumer, topic, [0, 1], timeout_s=60, keep=500)
        assert len(done.accounts) == 500 and kept.store.capacity == 1024  # room for `keep` was there
        assert kept.account_states_bytes(done.accounts) == source.account_states_bytes(done.accounts)
    finally:
        consumer.close()
