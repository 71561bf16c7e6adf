"""Changelog partitions read back into a Scorer as they stream in, in bounded memory.

The changelog is compacted, so it may still hold several records of one account, the last one counting.
Records are applied in chunks of about CHUNK_BYTES, in the order read: within a chunk the last value of each
account wins, and a later chunk overwrites what an earlier one restored, so the scorer ends holding each
account's last record. Memory holds at most `keep` of them, the most recently written: an account pushed
out by newer ones is let go of again (it stays dormant, its place noted). So the values of one chunk are in
memory at a time (with the copies its decoding makes, a few times CHUNK_BYTES), never the whole
partition's: at 1M accounts of ~1.8 KB that is ~100 MB, not 1.8 GB, next to the states themselves.

Per record, Python does only what the order needs (a few dict operations); decoding and copying the states
is one batched call per chunk (Scorer.restore_accounts).
"""

import gc
from collections import OrderedDict
from dataclasses import dataclass, field

from consumers.runtime.compacted import Reader, high_watermarks, offset_span, read_chunks
from consumers.scoring.scorer import Scorer

# ~4,500 LSTM or ~900 linear Transformer states of the default size. Small enough that the chunk's copies
# come from malloc's heap and are reused chunk after chunk: at 32 MB each was a fresh mapping, faulted in anew.
CHUNK_BYTES = 8 * 1024 * 1024

Place = tuple[int, int]  # (changelog partition, offset)


@dataclass
class Restored:
    accounts: list[str]  # held in memory now, least recently written first
    where: dict[str, Place] = field(default_factory=dict)  # every live account -> its last record
    read: int = 0  # changelog records read
    corrupt: int = 0  # latest records refused as corrupt: their accounts start again from no history


def restore_partitions(
    scorer: Scorer, reader: Reader, topic: str, partitions: list[int], timeout_s: float, keep: int
) -> Restored:
    """Read changelog `partitions` (read_committed, to their high watermarks) into `scorer`, holding at most
    `keep` of their accounts. An account whose last record is corrupt is not held, nor noted: it starts
    again from no history (logged, counted in Restored.corrupt). Raises what Scorer.restore_accounts raises
    for a record of another model, and compacted's TimeoutError past `timeout_s`."""
    # A restore makes millions of objects and no cycle: the collector's passes over them would cost more
    # than the restore itself (gen-2 collections walk every object made so far).
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _restore(scorer, reader, topic, partitions, timeout_s, keep)
    finally:
        if collecting:
            gc.enable()


def _restore(
    scorer: Scorer, reader: Reader, topic: str, partitions: list[int], timeout_s: float, keep: int
) -> Restored:
    recent: OrderedDict[str, None] = OrderedDict()  # accounts held, by the order of their last record
    where: dict[str, Place] = {}
    read = corrupt = 0
    # Asked for once: the reservation and the read stop at the same place
    end = high_watermarks(reader, topic, partitions)
    # Rows for every account the read can find, at once: the store does not double (and copy) its way there
    scorer.reserve_accounts(min(keep, offset_span(reader, end)))
    for chunk in read_chunks(reader, topic, partitions, timeout_s, CHUNK_BYTES, end):
        read += len(chunk)
        latest: dict[str, bytes] = {}
        for key, record in chunk:
            recent.pop(key, None)
            latest.pop(key, None)  # a dict keeps its first insertion order: re-inserted, it moves last
            where.pop(key, None)  # so does `where`: least recently written first (dormant.py)
            if record.value is None:
                if key in scorer.store:
                    scorer.evict(key, discard_changes=True)  # deleted: its earlier record is void
                continue
            where[key] = (record.partition, record.offset)
            recent[key] = None
            latest[key] = record.value
        while len(recent) > keep:
            oldest, _ = recent.popitem(last=False)
            if latest.pop(oldest, None) is None and oldest in scorer.store:
                scorer.evict(oldest, discard_changes=True)  # it stays dormant, its place noted
        for account, _ in scorer.restore_accounts(list(latest), list(latest.values())):  # logged there
            corrupt += 1
            recent.pop(account, None)
            where.pop(account, None)  # never brought back: its next event starts it again
    return Restored(list(recent), where, read, corrupt)
