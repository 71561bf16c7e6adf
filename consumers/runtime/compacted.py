"""Read compacted topics back into memory: the account-state changelog and the terminal-risk table.

Both are restored the same way: a group-less read_committed consumer is assigned the partitions and reads
them from their beginning up to their high watermarks as they stood at the start, and the last record per key
wins, as it will once the cleaner has run. The high watermark, not the last stable offset: an open
transaction holds read_committed readers at its first record, and records committed after it began lie
beyond. Stopping there would miss them, so the read waits until the transaction ends (its producer commits
or aborts; the broker aborts a crashed producer's after its transaction_timeout_ms; a successor with the
same transactional id aborts it at once). Aborted records never count. A deadline turns a stuck restore
into an error that says how far it got; progress is logged on long restores.

No internal reader ever jumps silently: their consumers have no offset reset policy (auto_offset_reset
'none'), so a position that has left its partition's log (records deleted under it, the topic recreated)
raises PositionLostError, naming the partition, the position, where the log now starts and how many records
are gone, instead of moving to the log's end (kafka-python's default) and skipping them unsaid.
"""

import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from kafka import KafkaConsumer
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import OffsetOutOfRangeError
from kafka.structs import TopicPartition

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 5.0
# Fetch sizes of a reader that restores whole partitions: larger per partition than kafka-python's 1 MB
# (a round trip per ~600 LSTM states), but responses of at most 8 MB in all, not its 50 MB. A response's
# buffers then stay under glibc's 32 MB mmap ceiling and are reused from the heap, fetch after fetch; larger
# ones are mapped afresh and faulted in page by page each time. 100,000 linear-Transformer states from 10
# partitions: 0.35-0.46M page faults and 6.6-6.8 s of CPU, against 1.2-1.3M and 8.0-8.7 s with 16 MB / 64 MB
# (docs/benchmarks.md, "Restore").
RESTORE_FETCH = {"max_partition_fetch_bytes": 4 * 1024 * 1024, "fetch_max_bytes": 8 * 1024 * 1024}


class PositionLostError(RuntimeError):
    """A reader's position is no longer in its partition's log: records it had not read were deleted, or the
    topic was recreated. The message names each partition and says what to do."""


def group_less_consumer(
    bootstrap: str, client_id: str, isolation_level: str = "read_committed", **settings
) -> KafkaConsumer:
    """A consumer that is assigned partitions by hand: no group, nothing committed, and no offset reset (a
    lost position raises OffsetOutOfRangeError from poll: lost_positions says where)."""
    return KafkaConsumer(
        bootstrap_servers=bootstrap,
        isolation_level=isolation_level,
        enable_auto_commit=False,
        auto_offset_reset="none",
        client_id=client_id,
        **settings,
    )


def lost_positions(
    error: OffsetOutOfRangeError, watermarks: KafkaConsumer
) -> dict[TopicPartition, tuple[int, int, int]]:
    """{partition: (position, the log's first offset, its end offset)} of each partition `error` names."""
    positions = error.args[0] if error.args and isinstance(error.args[0], dict) else {}
    tps = list(positions)
    first, end = watermarks.beginning_offsets(tps), watermarks.end_offsets(tps)
    return {tp: (positions[tp], first[tp], end[tp]) for tp in tps}


def describe_lost(lost: dict[TopicPartition, tuple[int, int, int]]) -> str:
    """One clause per partition: where the reader was, where the log is, what is gone."""
    parts = []
    for tp, (position, first, end) in sorted(lost.items()):
        where = f"{tp.topic!r} partition {tp.partition} at offset {position}"
        if position < first:
            parts.append(
                f"{where}: the log now starts at {first}, so {first - position} records were deleted unread"
            )
        else:
            parts.append(f"{where}: the log now ends at {end}, so the topic was recreated or truncated")
    return "; ".join(parts)


def _poll(reader: "Reader", timeout_ms: int, topic: str) -> dict:
    try:
        return reader.committed.poll(timeout_ms=timeout_ms)
    except OffsetOutOfRangeError as error:
        raise PositionLostError(
            f"reading compacted topic {topic!r}: {describe_lost(lost_positions(error, reader.watermarks))}. A "
            "state topic must keep every key's last record for ever: check that its cleanup.policy is compact "
            "and retention.ms is -1, and that nothing deletes its records; then restore the topic, or point "
            "the setting naming it at a new topic and replay"
        ) from None


@dataclass
class Reader:
    """What compacted topics are read with: a group-less read_committed consumer, and a read_uncommitted
    one that only asks how far partitions go (their high watermarks, open transactions included)."""

    committed: KafkaConsumer
    watermarks: KafkaConsumer

    @classmethod
    def connect(cls, bootstrap: str, client_id: str, **settings) -> "Reader":
        return cls(
            group_less_consumer(bootstrap, client_id, **settings),
            group_less_consumer(bootstrap, client_id + "-watermarks", "read_uncommitted", **settings),
        )

    def close(self) -> None:
        self.committed.close()
        self.watermarks.close()


def high_watermarks(reader: Reader, topic: str, partitions: list[int]) -> dict[TopicPartition, int]:
    """Where a read of `partitions` starting now stops (open transactions included): asked for once by a
    caller that needs them before the read too (offset_span), then passed to read_chunks."""
    return reader.watermarks.end_offsets([TopicPartition(topic, p) for p in partitions])


def offset_span(reader: Reader, end: dict[TopicPartition, int]) -> int:
    """Offsets from the partitions' log starts to `end`, their high_watermarks: at least as many as the
    records a whole read to them returns, and so the keys it finds (superseded and control records count too)."""
    first = reader.watermarks.beginning_offsets(list(end))
    return sum(end[tp] - first[tp] for tp in end)


def read_latest(
    reader: Reader, topic: str, partitions: list[int], timeout_s: float, last_key: str | None = None
) -> tuple[dict[str, bytes | None], int]:
    """({key: last value, None for a tombstone}, records read) of `partitions` of `topic`.

    Keys are UTF-8 (account and terminal ids). `reader` is assigned the partitions and unassigned after.
    With `last_key`, the read goes on past the high watermark while the last record read has another key
    and the topic holds more (a transaction being written): a writer that ends each transaction with it is
    then read at a transaction's end. What comes after the last record with that key, once the topic holds
    no more, no such transaction wrote: it is left out, logged. One partition only then: "the last record"
    of several would mean nothing.
    Raises TimeoutError past `timeout_s`, naming what was left, and ValueError for a record without a key.
    A record whose key is not UTF-8 names no account or terminal: it is skipped, logged.
    """
    if last_key is not None and len(partitions) != 1:
        raise ValueError(f"a read up to a last key reads one partition, got {partitions}")
    latest: dict[str, bytes | None] = {}
    pending: dict[str, bytes | None] = {}  # with last_key: read since the last record with it
    read = 0
    for key, record in _records(reader, topic, partitions, timeout_s, last_key):
        (latest if last_key is None else pending)[key] = record.value  # the last record per key wins
        if key == last_key:
            latest.update(pending)
            pending.clear()
        read += 1
    if pending:
        log.error(
            "records after the last %r record of %r left out: keys=%d first=%r (no transaction that ends "
            "with one wrote them: another producer, or a writer that failed)",
            last_key, topic, len(pending), next(iter(pending))[:100],
        )  # fmt: skip
    return latest, read


def read_recent(
    reader: Reader, topic: str, partitions: list[int], timeout_s: float, keep: int
) -> tuple[dict[str, bytes], dict[str, tuple[int, int]], int]:
    """Like read_latest, in bounded memory: (values, where, records read).

    values: the last values of the live keys written most recently (in the order read), at most `keep` of
    them (fewer when a key they displaced was deleted later). where: every live key -> (partition, offset)
    of its last record, which compaction keeps, so read_at finds it later. Deleted keys are in neither.
    """
    recent: OrderedDict[str, bytes] = OrderedDict()
    where: dict[str, tuple[int, int]] = {}
    read = 0
    for key, record in _records(reader, topic, partitions, timeout_s):
        read += 1
        recent.pop(key, None)
        if record.value is None:
            where.pop(key, None)
            continue
        where[key] = (record.partition, record.offset)
        recent[key] = record.value
        if len(recent) > keep:
            recent.popitem(last=False)
    return dict(recent), where, read


def read_chunks(
    reader: Reader,
    topic: str,
    partitions: list[int],
    timeout_s: float,
    chunk_bytes: int,
    end: dict[TopicPartition, int],
) -> Iterator[list[tuple[str, ConsumerRecord]]]:
    """The (key, record) pairs of read_latest, in order, about `chunk_bytes` of values at a time: for a
    caller that applies them as they come instead of holding every value (consumers/service/state_restore.py).
    `end`: the partitions' high watermarks to read up to (high_watermarks), which the caller asks for once."""
    chunk: list[tuple[str, ConsumerRecord]] = []
    size = 0
    for pair in _records(reader, topic, partitions, timeout_s, end=end):
        chunk.append(pair)
        size += pair[1].serialized_value_size
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def read_places(
    reader: Reader, topic: str, starts: dict[int, int], timeout_s: float
) -> tuple[dict[str, tuple[int, int] | None], int]:
    """({key: (partition, offset) of its last record, None if deleted}, records read) of the records of
    partitions `starts` from the given offsets up to their high watermarks: the tail of a changelog past
    the records already known, read without keeping any value."""
    places: dict[str, tuple[int, int] | None] = {}
    read = 0
    for key, record in _records(reader, topic, sorted(starts), timeout_s, starts=starts):
        places[key] = None if record.value is None else (record.partition, record.offset)
        read += 1
    return places, read


def read_at(
    reader: Reader, topic: str, wanted: dict[str, tuple[int, int]], timeout_s: float
) -> dict[str, bytes]:
    """{key: value} of the records at wanted[key] = (partition, offset).

    Each round seeks every partition to its lowest offset still wanted and polls once: one fetch serves
    all partitions, and a response brings every wanted record within its ~1 MB. Raises ValueError if a
    record there has another key or none (the place was not the key's last record), TimeoutError past
    `timeout_s`.
    """
    started = time.monotonic()
    consumer = reader.committed
    pending: dict[TopicPartition, dict[int, str]] = {}  # partition -> {offset: key} still to read
    for key, (partition, offset) in wanted.items():
        pending.setdefault(TopicPartition(topic, partition), {})[offset] = key
    consumer.assign(list(pending))
    found: dict[str, bytes] = {}
    position: dict[TopicPartition, int] = {}  # where the reader is in each partition
    try:
        while pending:
            if time.monotonic() - started > timeout_s:
                left = {tp.partition: sorted(offsets)[:5] for tp, offsets in pending.items()}
                raise TimeoutError(
                    f"reading {len(wanted)} records of {topic!r} took over {timeout_s} s; "
                    f"{len(wanted) - len(found)} left, the first at (partition: offsets) {left}"
                )
            for tp, keys_at in pending.items():
                if position.get(tp) != min(keys_at):  # not again while its fetch is on the way
                    position[tp] = min(keys_at)
                    consumer.seek(tp, position[tp])
            for tp, records in _poll(reader, 200, topic).items():
                keys_at = pending.get(tp, {})
                for record in records:
                    key = keys_at.pop(record.offset, None)
                    if key is None:
                        continue
                    if record.key is None or record.key.decode() != key or record.value is None:
                        raise ValueError(
                            f"{topic!r} partition {tp.partition} offset {record.offset} holds "
                            f"{record.key!r}, not the last record of {key!r} that was expected there"
                        )
                    found[key] = record.value
            for tp, keys_at in pending.items():
                position[tp] = consumer.position(tp)  # past what was read, aborted records included
                skipped = sorted(offset for offset in keys_at if offset < position[tp])
                if skipped:
                    raise ValueError(
                        f"{topic!r} partition {tp.partition} has no record at offset {skipped[0]} (read "
                        f"committed), where the last record of {keys_at[skipped[0]]!r} was expected"
                    )
            pending = {tp: keys_at for tp, keys_at in pending.items() if keys_at}
    finally:
        consumer.unsubscribe()
    return found


def _records(
    reader: Reader,
    topic: str,
    partitions: list[int],
    timeout_s: float,
    last_key: str | None = None,
    starts: dict[int, int] | None = None,
    end: dict[TopicPartition, int] | None = None,
):
    """(key, record) for every committed record of the partitions, from their beginning (or from
    starts[partition]) to their high watermarks at the start (or `end`, high_watermarks fetched by the
    caller), waiting out transactions still open there (module docstring); then on, while `last_key` is
    given and the last record read had another key."""
    started = time.monotonic()
    tps = [TopicPartition(topic, p) for p in partitions]
    consumer = reader.committed
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    for tp in tps:
        if starts and starts.get(tp.partition):
            consumer.seek(tp, starts[tp.partition])
    end = dict(reader.watermarks.end_offsets(tps) if end is None else end)  # more() may move it on
    read, next_log = 0, started + PROGRESS_EVERY_S
    last = last_key  # the last record's key; nothing read yet counts as ending right

    def more() -> bool:
        if any(consumer.position(tp) < end[tp] for tp in tps):
            return True
        if last_key is None or last == last_key:
            return False
        # Past the end taken at the start, on only while a transaction is written (or ends) beyond it.
        end.update(reader.watermarks.end_offsets(tps))
        return any(consumer.position(tp) < end[tp] for tp in tps)

    while more():
        now = time.monotonic()
        if now - started > timeout_s:
            left = {tp.partition: end[tp] - consumer.position(tp) for tp in tps}
            raise TimeoutError(
                f"restoring {topic!r} partitions {partitions} took over {timeout_s} s with {left} records "
                "left. A transaction still open there holds the read (a crashed instance's: the broker "
                "aborts it after its transaction_timeout_ms, or at once when an instance with the same "
                "instance_id starts); raise restore_timeout_s or check the broker"
            )
        if now >= next_log:
            log.info(
                "restore progress topic=%s partitions=%s records=%d end=%s", topic, partitions, read, end
            )
            next_log = now + PROGRESS_EVERY_S
        for records in _poll(reader, 200, topic).values():
            for record in records:
                if record.key is None:
                    raise ValueError(
                        f"{topic!r} partition {record.partition} offset {record.offset} has no key: a compacted "
                        "state topic holds keyed records only; was another producer pointed at it?"
                    )
                read += 1
                try:
                    last = record.key.decode()
                except UnicodeDecodeError:
                    log.error(
                        "%r partition %d offset %d skipped: its key is not UTF-8, so it names no account or "
                        "terminal (%r)", topic, record.partition, record.offset, bytes(record.key[:40]),
                    )  # fmt: skip
                    continue
                yield last, record
    consumer.unsubscribe()
