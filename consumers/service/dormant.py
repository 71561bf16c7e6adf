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

The accounts kept. Dormant accounts cost little each, but nothing else bounds their number: valid events
each naming a new account id would grow `where` (and the changelog, and every restore) until the process
is killed for memory. So past `max_accounts` accounts with a record (max_accounts_kept), the least
recently written ones out of memory are let go, down to CAP_KEEP of it, each with a tombstone in the
transaction of the batch that lets it go (let_go): the changelog deletes them too, and a restore, which
reads the tombstones, agrees. One scan picks them (a scan per tenth of the bound in new accounts, not one
per batch) into a queue that batches drain, at most `let_go_per_batch` a batch, so that a batch's
transaction stays far inside its timeout however many there are (a restore onto more partitions can bring
millions past the bound); a candidate written again or held in memory by the time its turn comes stays.
They leave `where` when their batch takes them, so no later batch reads them back; should the batch not
commit, they are put back (put_back), first in the queue again, as its tombstones never landed. An account
let go that returns starts again from init_state, as a new one.
`where` keeps the order its accounts' records were last written in (a restore: the order it read them), so
its first entries are the least recently written.
"""

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Mapping, Sequence

from consumers.runtime.settings import ServeConfig

Place = tuple[int, int]  # (changelog partition, offset)

CAP_KEEP = 0.9  # past max_accounts, accounts are let go down to this share of it
# Tombstones a batch carries at most, per record a poll may take (max_poll_records): 5,000 at the default
# 500. They are sent one by one in the batch's transaction, ~15-30 us each (docs/bench-stream-log.md), twice
# with a shadow changelog: ~0.15-0.3 s, far inside transaction_timeout_ms (30 s), where an unbounded let-go
# of a million past the bound takes 30-60 s, and the broker aborts it, batch after batch. And each event
# brings at most one new account, so letting go of ten an event outruns any flood of new ids.
LET_GO_PER_POLLED_RECORD = 10
LET_GO_LOG_EVERY_S = 60.0  # the let-go warning, at most this often (the first at once)

log = logging.getLogger(__name__)


def changelog_places(records: Sequence, sent: Sequence, topic: str) -> dict[str, Place | None]:
    """Where a committed batch's records to `topic` went: account -> (partition, offset), None for a
    tombstone. `records` are (topic, key, value, partition), `sent` kafka-python's futures of them."""
    return {
        key: None if value is None else (partition, future.value.offset)
        for (to, key, value, partition), future in zip(records, sent, strict=True)
        if to == topic
    }


class DormantStates:
    def __init__(
        self, capacity: int, max_accounts: int = 0, max_poll_records: int = ServeConfig.max_poll_records
    ):
        """`capacity`: account states memory holds; `max_accounts`: max_accounts_kept, accounts with a record
        kept in all (0: no bound), at least twice `capacity` so that a tenth of it is dormant to let go of;
        `max_poll_records`: the most events a batch holds, which sizes the accounts it lets go of."""
        if capacity < 1:
            raise ValueError(f"capacity = {capacity!r}: memory must hold at least one account state")
        if max_accounts and max_accounts < 2 * capacity:
            raise ValueError(
                f"max_accounts_kept = {max_accounts}: expected 0 (no bound) or at least twice the {capacity} "
                "account states memory holds (max_states_in_memory, max_state_bytes_in_memory), so that the "
                "accounts let go past it are dormant ones; raise it, or lower max_states_in_memory"
            )
        self.capacity, self.max_accounts = capacity, max_accounts
        self.keep = math.ceil(max_accounts * CAP_KEEP)
        self.let_go_per_batch = LET_GO_PER_POLLED_RECORD * max_poll_records
        self.where: dict[str, Place] = {}  # account -> its latest committed state record, least recent first
        # (account, its place when picked): the candidates to let go, least recently written first
        self.to_let_go: deque[tuple[str, Place]] = deque()
        # batch seq -> accounts it deletes, until it commits
        self.letting_go: dict[int, dict[str, Place]] = {}
        # accounts let go (committed) since the start, since the warning
        self.let_go_total = self.unlogged = 0
        self.logged_at = -math.inf  # time.monotonic() of the last warning
        self.recency: OrderedDict[str, int] = OrderedDict()  # account -> seq of the last batch it was in
        self.ends: dict[int, int] = {}  # changelog partition -> the offset after its last record known here

    def touched(self, accounts: Iterable[str], seq: int) -> None:
        for account in accounts:
            self.recency[account] = seq
            self.recency.move_to_end(account)

    def committed(self, places: Mapping[str, Place | None], seq: int | None = None) -> None:
        """Note a committed batch's state records (or a changelog tail's): account -> where it went,
        None for a deleted account; `seq`: the batch's, whose accounts let go are gone for good now."""
        where = self.where
        for account, place in places.items():
            where.pop(account, None)  # re-inserted, it moves last: `where` keeps the order of writing
            if place is None:
                continue
            where[account] = place
            partition, offset = place
            if offset >= self.ends.get(partition, 0):
                self.ends[partition] = offset + 1
        if seq is not None:
            for done in [s for s in self.letting_go if s <= seq]:
                del self.letting_go[done]

    def let_go(self, in_memory: Collection[str], seq: int) -> dict[str, Place]:
        """Past max_accounts, the least recently written accounts out of memory, down to `keep` and at most
        `let_go_per_batch`: account -> its record's place, for batch `seq` to write a tombstone each. Taken
        out of `where` now (module docstring). Cheap when under the bound and nothing is queued: a len."""
        if not self.max_accounts or len(self.where) <= self.keep:
            self.to_let_go.clear()  # down to `keep` another way (partitions left): the rest stay
            return {}
        if not self.to_let_go:
            if len(self.where) <= self.max_accounts:
                return {}
            self._pick(in_memory)
        gone: dict[str, Place] = {}
        wanted = min(self.let_go_per_batch, len(self.where) - self.keep)
        while self.to_let_go and len(gone) < wanted:
            account, place = self.to_let_go.popleft()
            # written again since it was picked (its place moved, or it was deleted), or held now: it stays
            if self.where.get(account) == place and account not in in_memory:
                gone[account] = place
        for account in gone:
            del self.where[account]
        self.letting_go.setdefault(seq, {}).update(gone)
        return gone

    def _pick(self, in_memory: Collection[str]) -> None:
        """Queue the accounts to let go down to `keep`, the least recently written first: one scan of
        `where` (~0.5 us an account picked) for the batches that follow."""
        excess = len(self.where) - self.keep
        for account, place in self.where.items():  # least recently written first
            if account not in in_memory:  # held accounts are the recently active ones, and not dormant
                self.to_let_go.append((account, place))
                if len(self.to_let_go) == excess:
                    break

    def put_back(self) -> set[int]:
        """After an abort: the accounts the uncommitted batches were letting go are kept again (their
        tombstones did not land, unless a commit landed after all: read the changelog tail of the
        partitions returned, which holds them then), and are the first candidates again."""
        back: dict[str, Place] = {}
        for gone in self.letting_go.values():
            back.update(gone)
        self.letting_go.clear()
        if back:  # first again, as the least recently written (a copy of `where`: aborts are rare)
            self.where = {**back, **self.where}
            self.to_let_go.extendleft(reversed(back.items()))
        return {partition for partition, _ in back.values()}

    def count_let_go(self, accounts: int, now: float | None = None) -> None:
        """Count the accounts a committed batch let go; a warning with the count at most every
        LET_GO_LOG_EVERY_S: letting go is never silent."""
        self.let_go_total += accounts
        self.unlogged += accounts
        if not self.unlogged:
            return
        now = time.monotonic() if now is None else now
        if now - self.logged_at < LET_GO_LOG_EVERY_S:
            return
        self.logged_at = now
        log.warning(
            "accounts let go past the bound max_accounts_kept=%d let_go=%d since_start=%d kept=%d: the least "
            "recently written, deleted from the changelog; their next events start again from the model's "
            "initial state, as a new account's. Raise max_accounts_kept (~200 bytes an account, up to ~1.2 KB "
            "with the longest ids) above the accounts of this instance's partitions, and look for what sends "
            "so many new account ids (docs/operations.md, \"Too many accounts\")",
            self.max_accounts, self.unlogged, self.let_go_total, len(self.where),
        )  # fmt: skip
        self.unlogged = 0

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
        for gone in self.letting_go.values():
            for account in [a for a, place in gone.items() if place[0] in partitions]:
                del gone[account]
        for partition in partitions:
            self.ends.pop(partition, None)
        self.to_let_go.clear()  # the next let_go picks again from what stays, if still past the bound
