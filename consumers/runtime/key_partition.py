"""The `transactions` partition a record's key belongs on, under the producers' partitioner.

An account's state lives with the owner of one partition (the changelog partition of the same number), so
every event of the account must reach that partition: one elsewhere is scored by another owner, or under
another changelog partition, without its history, and splits the account's state in two. Producers that
send by key keep this for free; one that names a partition itself (or a custom partitioner) does not, and
nothing in the record says so. The service recomputes the key's partition with the rule the producers use
(setting `producer_partitioner`):

- "murmur2": the Java client's and kafka-python's default for keyed records, librdkafka's
  `partitioner=murmur2_random`: (murmur2(key) & 0x7fffffff) % partitions;
- "crc32": librdkafka's default (`consistent_random`, and `consistent`): crc32(key) % partitions;
- "unchecked": the producers partition by a rule of their own, trusted to keep one account on one partition.

murmur2 is pure Python in kafka-python (~3 us for an 18-byte key, ~9 us for 64 bytes), so the hashes of
the last KEYS_REMEMBERED keys are remembered (LRU): the stream meets the same accounts over and over.

A record with its account's key that is off that key's partition is never written again (key_mismatch:
rekey repairs keys only): sent again, it could only go back and forth between instances that disagree on
the rule or the partition count.
"""

import functools
import zlib
from collections.abc import Callable

from kafka.partitioner.default import murmur2

PRODUCER_PARTITIONERS = ("murmur2", "crc32", "unchecked")
KEYS_REMEMBERED = 1 << 16  # ~16 MB with 20-byte keys; a key not remembered costs ~3 us


@functools.lru_cache(maxsize=KEYS_REMEMBERED)
def _murmur2(key: bytes) -> int:
    return murmur2(key) & 0x7FFFFFFF


def _crc32(key: bytes) -> int:
    return zlib.crc32(key)  # C speed: nothing to remember


_HASHES = {"murmur2": _murmur2, "crc32": _crc32}


def key_partition(partitioner: str, partitions: int) -> Callable[[bytes], int] | None:
    """The partition of a key among `partitions` under `partitioner` (PRODUCER_PARTITIONERS), or None where
    nothing is checked ("unchecked", or no partition count known)."""
    if partitioner not in PRODUCER_PARTITIONERS:
        raise ValueError(
            f"producer_partitioner = {partitioner!r}, expected one of {PRODUCER_PARTITIONERS}: 'murmur2' for "
            "the Java client, kafka-python and librdkafka's murmur2_random, 'crc32' for librdkafka's default, "
            "'unchecked' for producers with a rule of their own"
        )
    if partitioner == "unchecked" or partitions < 1:
        return None
    hashed = _HASHES[partitioner]
    return lambda key: hashed(key) % partitions
