"""The accounts a Scorer holds in memory: their state records out and in, eviction, the changed set.

Per account, state lives in two places, the featurizer's account record and a row of the batched detector
store, and leaves as one versioned byte record (account_state.py) for the service's changelog: produced for
each changed account after a batch (take_changed, account_states_bytes), read back on a restore
(restore_account), and let go when its partition leaves or memory is full (evict). A checkpoint of some
accounts and terminals puts them back as they were (rollback): the service's last resort scores events one
at a time under one.

What an account costs in memory is fixed per detector (a state's size never depends on history length):
state_bytes_per_account measures it, so a cap in bytes is a cap on the number of accounts held
(states_within).
"""

import dataclasses
import logging
from collections.abc import KeysView, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from consumers.scoring.account_state import (
    RECENT_EVENT_IDS,
    AccountRecord,
    CorruptRecordError,
    bad_account_records,
    decode_account_record,
    decode_account_records,
    encode_account_records,
    events_folded,
)
from models.state_codec import StateRecordError, decode_account_state, decode_state_rows, encode_state_rows
from pipeline.features.state import ACCOUNT_STATE
from pipeline.features.stream_batches import FeaturizerCheckpoint

# Beside its state: the account's id and its entries in the dicts that find its store row, its featurizer
# record and its dormant place (tracemalloc: ~390 bytes an account with 13-character ids).
ACCOUNT_OVERHEAD_BYTES = 400
# The store's numpy bookkeeping per row: partition, offset, newest ts, the recent-ids ring and its next slot.
STORE_ROW_BYTES = 8 * (4 + RECENT_EVENT_IDS)
RESTORE_CHUNK = 65_536  # accounts decoded at once by restore_accounts: bounds the copies it makes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScorerCheckpoint:
    """Some accounts and terminals as they were (Scorer.checkpoint), for rollback."""

    records: dict[str, bytes]  # accounts held then: their whole state record
    absent: set[str]  # accounts not held then
    changed: set[str]  # of these accounts, those changed and not yet taken
    featurizer: FeaturizerCheckpoint  # the terminals' records and the journal
    stats: object  # the scorer's ScorerStats
    shadow: dict[str, bytes] = dataclasses.field(default_factory=dict)  # the shadow's records of `records`


class HeldAccounts:
    """The per-account part of the Scorer (consumers/scoring/scorer.py, whose __init__ builds the detector,
    store, featurizer, model fingerprint and changed set used here)."""

    @property
    def accounts_in_memory(self) -> KeysView[str]:
        return self.store.accounts()

    @property
    def state_bytes_per_account(self) -> int:
        """Bytes of memory one held account takes: its detector state (the store row, e.g. ~1 KB for the
        default LSTM, ~64 KB for the softmax Transformer's window), its featurizer record, the store's
        bookkeeping and ACCOUNT_OVERHEAD_BYTES."""
        shadow = 0 if self.shadow is None else self.shadow.store.row_bytes + STORE_ROW_BYTES
        return (
            self.store.row_bytes + ACCOUNT_STATE.itemsize + STORE_ROW_BYTES + ACCOUNT_OVERHEAD_BYTES + shadow
        )

    def states_within(self, max_states: int, max_bytes: int) -> int:
        """How many account states memory holds under both caps (max_states_in_memory,
        max_state_bytes_in_memory); ValueError when the byte cap holds none."""
        per_account = self.state_bytes_per_account
        fit = max_bytes // per_account
        if fit < 1:
            raise ValueError(
                f"max_state_bytes_in_memory = {max_bytes} holds no account state: one takes {per_account} "
                f"bytes with this {self.detector.name!r} model; raise it to a multiple of that"
            )
        return min(max_states, fit)

    def take_changed(self) -> set[str]:
        """The changed accounts, forgetting them: call when their state records have been produced."""
        changed, self._changed = self._changed, set()
        return changed

    def accounts_in_partition(self, partition: int) -> list[str]:
        """Accounts in memory whose last applied event came from `partition` (to evict on revocation)."""
        held = self.store.partition
        return [account for account, row in self.store.slot_of.items() if held[row] == partition]

    def account_state_bytes(self, account_id: str) -> bytes:
        """The account's whole serving state as one versioned record (account_state.AccountRecord)."""
        return self.account_states_bytes([account_id])[0]

    @torch.inference_mode()
    def account_states_bytes(self, account_ids: Sequence[str]) -> list[bytes]:
        """account_state_bytes of each account, with one gather and one encode for all of them.

        The service writes a record per changed account per poll: one at a time, the gather and the
        encode cost ~0.5 ms an account, more than scoring its event.
        """
        if not account_ids:
            return []
        rows = np.array([self._row(a) for a in account_ids], dtype=np.int64)
        features = self.feature_records(account_ids)
        store = self.store
        return encode_account_records(
            features,
            encode_state_rows(self.detector, store.gather(rows)),  # [N, bytes]
            self.model_fingerprint,
            store.partition[rows],
            store.offset[rows],
            store.last_ts_us[rows],
            store.recent_ids[rows],
            store.recent_next[rows],
        )

    def feature_records(self, account_ids: Sequence[str]) -> np.ndarray:
        """[N] the featurizer's records of the accounts (ACCOUNT_STATE), for their state records."""
        table = self.featurizer.accounts
        missing = [a for a in account_ids if a not in table]
        if missing:  # in the store but never featurized: no events applied yet
            table.slots(missing)
        return table.records[[table.slot_of[a] for a in account_ids]]

    def shadow_states_bytes(self, account_ids: Sequence[str]) -> list[bytes]:
        """The shadow challenger's state record of each account (consumers/scoring/shadow.py)."""
        return self.shadow.states_bytes(account_ids, self.feature_records(account_ids))

    @torch.inference_mode()
    def restore_account(self, account_id: str, data: bytes) -> None:
        """Load an account's state record (from account_state_bytes), replacing what memory holds for it.

        Raises ValueError, changing nothing, when the record was written by another model, detector,
        config or txsentinel version; the message says which and what to do.
        """
        record = decode_account_record(data, account_id)
        try:
            state = decode_account_state(self.detector, record.detector, events_folded(record.features))
        except StateRecordError as error:
            if not error.corrupt:
                raise ValueError(f"account state record of {account_id!r}: {error.reason}") from None
            if record.model == self.model_fingerprint:
                raise CorruptRecordError(f"account state record of {account_id!r}: {error.reason}") from None
            # The bounds are these weights': a state of other weights may well break them, and is theirs.
            raise self._other_weights(account_id, record) from None
        if record.model != self.model_fingerprint:
            raise self._other_weights(account_id, record)
        if self.shadow is not None:
            self.shadow.evict(account_id)  # its shadow state went with the old record: restored after this
        row = self.store.rows([account_id])[0]
        self.store.scatter(np.array([row]), state)
        self.store.partition[row] = record.partition
        self.store.offset[row] = record.offset
        self.store.last_ts_us[row] = record.last_ts_us
        self.store.recent_ids[row] = np.frombuffer(record.recent_ids, dtype="<u8")
        self.store.recent_next[row] = record.recent_next
        self.featurizer.accounts.put_bytes(account_id, record.features)
        self._changed.discard(account_id)  # memory now equals the record

    def _other_weights(self, account_id: str, record: AccountRecord) -> ValueError:
        return ValueError(
            f"account state record of {account_id!r} was written by another {self.detector.name!r} model "
            f"with the same config (model fingerprint {record.model.hex()}, this one is "
            f"{self.model_fingerprint.hex()}): other weights, e.g. a retrained model; its recurrent state "
            "means nothing to these weights. Serve the model that wrote it, or rebuild the account's "
            "state by replaying its history through this model"
        )

    def reserve_accounts(self, n: int) -> None:
        """Room for about n more account states in one step (StateStore.reserve), before a restore."""
        self.store.reserve(n)

    @torch.inference_mode()
    def restore_accounts(self, account_ids: Sequence[str], values: Sequence[bytes]) -> list[tuple[str, str]]:
        """restore_account of many accounts (distinct ids) with one decode and one scatter for all of them:
        a restore of a million accounts one at a time costs ~40 us each in Python alone.

        Corrupt records (CorruptRecordError) are left out, and so are their accounts (evicted, should memory
        hold an older state of theirs: they start again from no history); returns (account, why) of each.
        Raises ValueError as restore_account does for a record of another model or version, naming the
        first; the accounts before it in a chunk of RESTORE_CHUNK may already be restored.
        """
        corrupt: list[tuple[str, str]] = []
        for start in range(0, len(account_ids), RESTORE_CHUNK):
            ids = list(account_ids[start : start + RESTORE_CHUNK])
            chunk = values[start : start + RESTORE_CHUNK]
            records = decode_account_records(chunk)
            if records is None:  # older versions or several lengths: one at a time
                for account, value in zip(ids, chunk, strict=True):
                    corrupt += self._restore_or_name(account, value)
                continue
            foreign = np.flatnonzero(records["header"]["model"] != self.model_fingerprint)
            refused = sorted({*bad_account_records(records).tolist(), *foreign.tolist()})
            for at in refused:  # raises for another model or version; names a corrupt one
                corrupt += self._restore_or_name(ids[at], chunk[at])
            keep = np.setdiff1d(np.arange(len(ids)), refused)
            while len(keep):  # one decode, and one more when some rows are corrupt
                try:
                    most = events_folded(records["features"][keep])
                    state = decode_state_rows(self.detector, records["detector"][keep], most)  # [n, ...]
                except StateRecordError as error:  # -> the accounts' names; corrupt ones are left out
                    for at in keep[list(error.rows)].tolist():
                        corrupt += self._restore_or_name(ids[at], chunk[at])  # raises unless corrupt
                    keep = np.delete(keep, list(error.rows))
                    continue
                self._scatter_records([ids[i] for i in keep.tolist()], records[keep], state)
                break
        return corrupt

    def _restore_or_name(self, account_id: str, data: bytes) -> list[tuple[str, str]]:
        """restore_account; [] when it restored, [(account, why)] when the record is corrupt (the account
        let go, logged at ERROR); raises ValueError for a record of another model or version."""
        try:
            self.restore_account(account_id, data)
            return []
        except CorruptRecordError as error:
            if account_id in self.store:
                self.evict(account_id, discard_changes=True)
            log.error("account state record refused, the account starts again from no history: %s", error)
            return [(account_id, str(error))]

    def _scatter_records(self, ids: list[str], records: np.ndarray, state: dict) -> None:
        """Records [n] of decode_account_records and their decoded detector state into memory."""
        if not ids:
            return
        header = records["header"]
        if self.shadow is not None:
            for account in ids:
                self.shadow.evict(account)  # as in restore_account
        rows = _rows(self.store.slot_of, partial(self.store.add, overwritten=True), ids)
        self.store.scatter(rows, state)  # with the bookkeeping below: every field of the rows
        self.store.partition[rows] = header["partition"]
        self.store.offset[rows] = header["offset"]
        self.store.last_ts_us[rows] = header["last_ts_us"]
        self.store.recent_ids[rows] = records["recent_ids"]
        self.store.recent_next[rows] = header["recent_next"]
        table = self.featurizer.accounts
        slots = _rows(table.slot_of, table.add, ids)  # first: it may grow table.records
        table.records[slots] = records["features"]
        self._changed.difference_update(ids)  # memory now equals the records

    def evict(self, account_id: str, discard_changes: bool = False) -> None:
        """Forget an account (its record can restore it later).

        Refuses an account with changes not yet taken (take_changed) unless discard_changes: its state
        record would otherwise never reach the changelog.
        """
        self._row(account_id)
        if account_id in self._changed and not discard_changes:
            raise ValueError(
                f"account {account_id!r} has applied events whose state was not taken yet: produce its "
                "record (take_changed, account_state_bytes) before evicting, or pass discard_changes=True "
                "when those events will be redelivered (e.g. an aborted transaction)"
            )
        self.store.evict(account_id)
        if self.shadow is not None:
            self.shadow.evict(account_id)
        if account_id in self.featurizer.accounts:
            self.featurizer.accounts.evict(account_id)
        self._changed.discard(account_id)

    def _row(self, account_id: str) -> int:
        row = self.store.slot_of.get(account_id)
        if row is None:
            raise KeyError(
                f"account {account_id!r} is not in memory: score one of its events or restore_account it first"
            )
        return row

    def checkpoint(self, account_ids: Sequence[str], terminal_ids: Sequence[str]) -> ScorerCheckpoint:
        """These accounts and terminals as they are now, for rollback. It costs each account's state record:
        for a last resort that scores events one at a time, not for every batch."""
        accounts = list(dict.fromkeys(account_ids))
        held = [a for a in accounts if a in self.store]
        shadowed = [a for a in held if self.shadow is not None and a in self.shadow.store]
        return ScorerCheckpoint(
            records=dict(zip(held, self.account_states_bytes(held), strict=True)),
            absent={a for a in accounts if a not in self.store},
            changed=self._changed.intersection(accounts),
            featurizer=self.featurizer.checkpoint([], list(dict.fromkeys(terminal_ids))),
            stats=dataclasses.replace(self.stats),
            shadow=dict(zip(shadowed, self.shadow_states_bytes(shadowed), strict=True)) if shadowed else {},
        )

    def rollback(self, checkpoint: ScorerCheckpoint) -> None:
        """Put the checkpoint's accounts and terminals back as they were, whatever happened since."""
        for account in checkpoint.absent:
            if account in self.store:
                self.evict(account, discard_changes=True)
        for account, data in checkpoint.records.items():
            self.restore_account(account, data)
        if checkpoint.shadow:
            self.shadow.restore(list(checkpoint.shadow), list(checkpoint.shadow.values()), self.store)
        self._changed -= checkpoint.absent | set(checkpoint.records)
        self._changed |= checkpoint.changed
        self.featurizer.rollback(checkpoint.featurizer)
        self.stats = checkpoint.stats


def _rows(slot_of: dict[str, int], add, ids: list[str]) -> np.ndarray:
    """[N] rows of distinct `ids`: those held keep theirs, the others get new ones from `add` in one block."""
    found = list(map(slot_of.get, ids))
    if None not in found:
        return np.asarray(found, dtype=np.int64)
    new = [i for i, row in enumerate(found) if row is None]
    rows = np.asarray([-1 if row is None else row for row in found], dtype=np.int64)
    rows[new] = add([ids[i] for i in new])
    return rows
