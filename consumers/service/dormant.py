"""Bounded memory: dormant accounts leave memory and come back exactly from the changelog when they return.

The service holds at most `capacity` account states, plus the accounts of the batches not yet committed
(one being scored, one committing). For every account of its partitions it keeps where the account's
latest committed state record is in the changelog, (partition, offset): compaction keeps a key's last
record, so the place stays valid. That is ~190 bytes an account against 1.6-9.3 KB of state record.

- A batch's accounts are touched with the batch's seq (least recently touched first).
- After a batch commits, its state records' offsets are noted, and the least recently touched accounts
  beyond capacity are evicted, but only those no uncommitted batch touched: their latest state is then a
  committed record.
- When a batch holds an account that is not in memory but has a record, the record is read back
  (compacted.read_at, read_committed) before the batch is scored, so the account continues exactly
  where it left off. An account with no record is new and starts from init_state.
- An aborted batch's accounts leave memory the same way (consumers/service/restore.py, _rewind): their
  redelivered events bring their last committed records back, and no other account is read again. For
  that, `ends` keeps where each changelog partition's known records end, so the records written after
  them (an abort whose commit did land after all) are found by reading only that tail.
"""

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping

Place = tuple[int, int]  # (changelog partition, offset)


class DormantStates:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity = {capacity!r}: memory must hold at least one account state")
        self.capacity = capacity
        self.where: dict[str, Place] = {}  # account -> its latest committed state record
        self.recency: OrderedDict[str, int] = OrderedDict()  # account -> seq of the last batch it was in
        self.ends: dict[int, int] = {}  # changelog partition -> the offset after its last record known here

    def touched(self, accounts: Iterable[str], seq: int) -> None:
        for account in accounts:
            self.recency[account] = seq
            self.recency.move_to_end(account)

    def committed(self, places: Mapping[str, Place]) -> None:
        """Note a committed batch's state records (or a changelog tail's): account -> where it went,
        None for a deleted account."""
        for account, place in places.items():
            if place is None:
                self.where.pop(account, None)
                continue
            self.where[account] = place
            partition, offset = place
            if offset >= self.ends.get(partition, 0):
                self.ends[partition] = offset + 1

    def returning(self, accounts: Iterable[str], in_memory: Collection[str]) -> dict[str, Place]:
        """Those of `accounts` that are out of memory but have a record: read them back before scoring."""
        return {a: self.where[a] for a in accounts if a not in in_memory and a in self.where}

    def to_evict(self, in_memory: Collection[str], committed_seq: int) -> list[str]:
        """The least recently touched accounts beyond capacity whose latest state is committed."""
        out: list[str] = []
        excess = len(in_memory) - self.capacity
        while len(out) < excess and self.recency:
            account, seq = next(iter(self.recency.items()))
            if seq > committed_seq:
                break  # this one and every later one were touched by a batch not committed yet
            del self.recency[account]
            if account in in_memory and account in self.where:
                out.append(account)
            # else: already gone (revoked, rewound), or never written: nothing to evict, or nothing to
            # restore it from, so it stays
        return out

    def restored(self, places: Mapping[str, Place], in_memory: Iterable[str], seq: int) -> None:
        """After a changelog restore: every account's place, and those now in memory as just touched."""
        self.committed(places)
        self.touched(in_memory, seq)

    def forget(self, accounts: Iterable[str]) -> None:
        """Accounts that left memory another way (their partition was revoked): no longer candidates."""
        for account in accounts:
            self.recency.pop(account, None)

    def drop_partitions(self, partitions: Collection[int]) -> None:
        """Forget the accounts of partitions leaving this instance (or about to be read again)."""
        if not partitions:
            return
        self.where = {a: place for a, place in self.where.items() if place[0] not in partitions}
        for partition in partitions:
            self.ends.pop(partition, None)
