"""Read compacted topics back into memory: the account-state changelog and the terminal-risk table.

Both are restored the same way: a group-less read_committed consumer is assigned the partitions, reads
them from their beginning up to the end offsets seen at the start (for read_committed, the last stable
offset: a zombie's open transaction delays the restore until the broker aborts it, and never lets its
records in), and the last record per key wins, as it will once the cleaner has run. A deadline turns a
stuck restore into an error that says how far it got; progress is logged on long restores.
"""

import logging
import time

from kafka import KafkaConsumer
from kafka.structs import TopicPartition

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 5.0


def read_latest(
    reader: KafkaConsumer, topic: str, partitions: list[int], timeout_s: float
) -> tuple[dict[str, bytes | None], int]:
    """({key: last value, None for a tombstone}, records read) of `partitions` of `topic`.

    Keys are UTF-8 (account and terminal ids). `reader` is assigned the partitions and unassigned after.
    Raises TimeoutError past `timeout_s`, naming what was left, and ValueError for a record without a key.
    """
    started = time.monotonic()
    tps = [TopicPartition(topic, p) for p in partitions]
    reader.assign(tps)
    reader.seek_to_beginning(*tps)
    end = reader.end_offsets(tps)
    latest: dict[str, bytes | None] = {}
    read, next_log = 0, started + PROGRESS_EVERY_S
    while any(reader.position(tp) < end[tp] for tp in tps):
        now = time.monotonic()
        if now - started > timeout_s:
            left = {tp.partition: end[tp] - reader.position(tp) for tp in tps}
            raise TimeoutError(
                f"restoring {topic!r} partitions {partitions} took over {timeout_s} s with {left} records "
                "left; raise restore_timeout_s or check the broker"
            )
        if now >= next_log:
            log.info(
                "restore progress topic=%s partitions=%s records=%d end=%s", topic, partitions, read, end
            )
            next_log = now + PROGRESS_EVERY_S
        for records in reader.poll(timeout_ms=200).values():
            for record in records:
                if record.key is None:
                    raise ValueError(
                        f"{topic!r} partition {record.partition} offset {record.offset} has no key: a compacted "
                        "state topic holds keyed records only; was another producer pointed at it?"
                    )
                latest[record.key.decode()] = record.value  # the last record per key wins
                read += 1
    reader.unsubscribe()
    return latest, read
