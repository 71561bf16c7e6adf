"""Recurrent states of the accounts in memory, as rows of batched tensors, with their exactly-once bookkeeping.

A micro-batch is applied by the detector's step_in_place on the rows where the states lie: in rounds of one
event an account by default (each round one gather, batched step and scatter, so a round costs one batched
call however many accounts are in memory), in one pass per layer for the linear Transformer on CPU. Rows:
account -> row through a dict; capacity doubles when full, up to `row_limit` when one is set (the service
sets what its memory cap holds, so doubling never allocates far beyond it), or grows once by what a restore
reserves; an evicted account's row goes to a free list. A row is reset to init_state when handed out, so
rows never handed out are left uninitialised.

Beside each row: the account's last applied source position (partition, offset) and the newest event ts
applied, as numpy arrays [capacity], and the hashes of its last RECENT_EVENT_IDS event ids as a ring
[capacity, K] with its next slot [capacity] — what the scorer's duplicate, replay and out-of-order checks
read.
"""

from collections.abc import KeysView, Sequence

import numpy as np
import torch

from consumers.scoring.account_state import NO_POSITION, NO_TS, RECENT_EVENT_IDS
from models import contract
from models.contract import RecurrentDetector, State, gather_states, scatter_states


class StateStore:
    """Batched detector states [capacity, ...] on the detector's device, one row per account in memory."""

    @torch.inference_mode()
    def __init__(self, detector: RecurrentDetector, capacity: int = 1024):
        self.detector = detector
        # detector.device walks its parameters (~10 us a call, several a round): asked once
        self.device = detector.device
        self._init = detector.init_state(1)  # {key: [1, ...]}: the row of an account with no history
        self.states: State = {
            key: value.expand(capacity, *value.shape[1:]).clone() for key, value in self._init.items()
        }
        self.partition = np.full(capacity, NO_POSITION, dtype=np.int64)
        self.offset = np.full(capacity, NO_POSITION, dtype=np.int64)
        self.last_ts_us = np.full(capacity, NO_TS, dtype=np.int64)
        self.recent_ids = np.zeros((capacity, RECENT_EVENT_IDS), dtype=np.uint64)  # 0: an empty slot
        self.recent_next = np.zeros(capacity, dtype=np.int64)
        self.slot_of: dict[str, int] = {}
        self._free: list[int] = []
        self._used = 0  # rows 0 .. _used - 1 have been handed out at least once
        self._buffers: State = {}  # gather's output buffers, [rows of the largest gather so far, ...]
        # Doubling stops here once (None: never); should more rows still be needed, it doubles on from there.
        self.row_limit: int | None = None

    @property
    def capacity(self) -> int:
        return len(self.offset)

    @property
    def row_bytes(self) -> int:
        """Bytes of one account's detector state."""
        return sum(value.numel() * value.element_size() for value in self._init.values())

    def accounts(self) -> KeysView[str]:
        return self.slot_of.keys()

    def __contains__(self, account_id: str) -> bool:
        return account_id in self.slot_of

    def rows(self, account_ids: Sequence[str]) -> np.ndarray:
        """[N] row of each account, giving fresh rows (state of no history) to accounts not in memory."""
        found = list(map(self.slot_of.get, account_ids))  # C-speed look-ups; None for new accounts
        if None in found:
            new = []
            for i, row in enumerate(found):
                if row is None:
                    # An account repeated within the batch gets one row, at its first occurrence.
                    row = self.slot_of.get(account_ids[i])
                    if row is None:
                        row = self._allocate(account_ids[i])
                        new.append(row)
                    found[i] = row
            self._reset(np.asarray(new, dtype=np.int64))
        return np.asarray(found, dtype=np.int64)

    def add(self, account_ids: Sequence[str], overwritten: bool = False) -> np.ndarray:
        """[N] fresh rows (state of no history) for N distinct accounts not in memory, in one block where
        the free list runs out: a restore adds a million accounts, ~3 us each one at a time. `overwritten`:
        the caller writes the rows' states and bookkeeping whole next (a restore), so they are not reset."""
        reused = [self._free.pop() for _ in range(min(len(self._free), len(account_ids)))]
        block = len(account_ids) - len(reused)
        while self._used + block > self.capacity:
            self._grow(self._used + block - self.capacity)
        rows = np.concatenate(
            [np.asarray(reused, dtype=np.int64), np.arange(self._used, self._used + block, dtype=np.int64)]
        )
        self._used += block
        self.slot_of.update(zip(account_ids, rows.tolist(), strict=True))
        if not overwritten:
            self._reset(rows)
        return rows

    def _allocate(self, account_id: str) -> int:
        if self._free:
            row = self._free.pop()
        else:
            if self._used == self.capacity:
                self._grow()
            row = self._used
            self._used += 1
        self.slot_of[account_id] = row
        return row

    def reserve(self, rows: int) -> None:
        """Room for `rows` more accounts at once, for a restore that knows about how many it reads: no copies
        by doubling on the way. The rows stay untouched until handed out, so an estimate too high costs
        address space, not memory."""
        short = self._used + max(rows - len(self._free), 0) - self.capacity
        if short > 0:
            self._resize(self.capacity + short)

    def _grow(self, at_least: int = 0) -> None:
        # Doubling: a copy of the store now and then, amortised O(1) per new account (or `at_least` rows
        # more at once: a restore's block); stopping at row_limit.
        added = max(self.capacity, at_least)
        if self.row_limit is not None and self.capacity < self.row_limit:
            added = min(added, max(self.row_limit - self.capacity, at_least))
        self._resize(self.capacity + added)

    @torch.inference_mode()
    def _resize(self, capacity: int) -> None:
        """Rows up to `capacity`. Only the rows handed out so far are copied; the new ones are left
        uninitialised (untouched memory is not resident) and reset when handed out (add, rows)."""
        added = capacity - self.capacity
        for key, value in self.states.items():
            grown = value.new_empty((capacity, *value.shape[1:]))
            grown[: self._used] = value[: self._used]
            self.states[key] = grown
        self.partition = np.concatenate([self.partition, np.full(added, NO_POSITION, dtype=np.int64)])
        self.offset = np.concatenate([self.offset, np.full(added, NO_POSITION, dtype=np.int64)])
        self.last_ts_us = np.concatenate([self.last_ts_us, np.full(added, NO_TS, dtype=np.int64)])
        self.recent_ids = np.concatenate(
            [self.recent_ids, np.zeros((added, RECENT_EVENT_IDS), dtype=np.uint64)]
        )
        self.recent_next = np.concatenate([self.recent_next, np.zeros(added, dtype=np.int64)])

    @torch.inference_mode()
    def _reset(self, rows: np.ndarray) -> None:
        if len(rows) == 0:
            return
        index = torch.from_numpy(rows).to(self.device)
        for key, value in self.states.items():
            value[index] = self._init[key]  # [1, ...] broadcast over the new rows
        self.partition[rows] = NO_POSITION
        self.offset[rows] = NO_POSITION
        self.last_ts_us[rows] = NO_TS
        self.recent_ids[rows] = 0
        self.recent_next[rows] = 0

    def remember_ids(self, rows: np.ndarray, hashes: np.ndarray) -> None:
        """Put applied events' id hashes [N] into their accounts' rings, in order (rows [N])."""
        if len(rows) == 0:
            return
        order = np.argsort(rows, kind="stable")  # by account, then arrival
        sorted_rows = rows[order]
        first = np.r_[True, sorted_rows[1:] != sorted_rows[:-1]]
        index = np.arange(len(rows))
        rank = index - np.maximum.accumulate(np.where(first, index, 0))  # k-th event of its account here
        group = np.cumsum(first) - 1
        count = np.bincount(group)[group]  # its account's events here
        # Only each account's last K events of the batch reach its ring: no two writes hit one slot.
        last_k = rank >= count - RECENT_EVENT_IDS
        account_rows, ranks = sorted_rows[last_k], rank[last_k]
        slots = (self.recent_next[account_rows] + ranks) % RECENT_EVENT_IDS
        self.recent_ids[account_rows, slots] = hashes[order][last_k]
        ends = np.flatnonzero(np.r_[sorted_rows[1:] != sorted_rows[:-1], True])  # each account's last
        self.recent_next[sorted_rows[ends]] = (self.recent_next[sorted_rows[ends]] + rank[ends] + 1) % (
            RECENT_EVENT_IDS
        )

    def evict(self, account_id: str) -> None:
        self._free.append(self.slot_of.pop(account_id))

    @torch.inference_mode()
    def gather(self, rows: np.ndarray) -> State:
        """States of `rows` [b] as a batch of b: copies, valid until the next gather.

        The copies go into buffers kept from one call to the next: a fresh tensor per call costs ~3x the copy
        itself in page faults once a batch's states reach megabytes (the Transformer's 64 KiB per account).
        """
        index = torch.from_numpy(rows).to(self.device)
        b = len(rows)
        if b > len(next(iter(self._buffers.values()), ())):
            self._buffers = gather_states(self.states, index)  # big enough for b rows from now on
            return dict(self._buffers)
        return {
            key: torch.index_select(self.states[key], 0, index, out=buffer[:b])
            for key, buffer in self._buffers.items()
        }

    @torch.inference_mode()
    def scatter(self, rows: np.ndarray, part: State) -> None:
        """Write a batch of b states back at `rows` [b]."""
        scatter_states(self.states, torch.from_numpy(rows).to(self.device), part)

    @torch.inference_mode()
    def step(self, rows: np.ndarray, x: torch.Tensor) -> torch.Tensor:
        """Apply events x [N, F] to the accounts at `rows` [N] in order (an account may have several): their
        scores [N], and the new states in place of the old (the detector's step_in_place)."""
        return self.detector.step_in_place(x, self.states, torch.from_numpy(rows).to(self.device))


def rounds_of(rows: np.ndarray) -> list[np.ndarray]:
    """models.contract.rounds_of for numpy rows [N]: the positions of each round, in arrival order."""
    return [positions.numpy() for positions in contract.rounds_of(torch.from_numpy(rows))]
