"""Streaming form of the features: bounded per-account and per-terminal state, one micro-batch at a time.

For each micro-batch the raw aggregates of `definitions.py` are "what the state says about earlier batches"
plus "what earlier events of this batch add": the in-batch part uses the same sorted-key trick as the batch
form, on a few hundred events instead of the whole dataset. Work per batch is O(N log N) numpy with one dict
look-up per event; no Python loop per event touches the arithmetic. The in-batch sums (stream_windows.py)
add an entity's own values only, and a window's sum the values in that window only, so one account's
extreme amounts never reach another account's features, nor a window they lie outside, not even in the last
bit.

A batch is read first, then folded into the state (`_read` returns the fold): transform_finite leaves out
the events whose feature row is not finite before anything is folded, so they change no state.

Events are applied in arrival order. A late event (older day than its account or terminal has seen) has its
windows end at the newest day seen, and its gap is clipped to 0; the next event's gap runs from the newest
event seen, not from the late one; and it is counted on its own day, in the state and in the windows of the
events after it in its batch (stream_windows.py) alike, so a payment dated years back never reads as today's,
and no feature depends on how the stream is cut into batches. In time order — what the batch form and a
replay see — no event is late and both forms agree exactly.

Terminal state is ORDER-FREE: each event is counted at its terminal on its own day (a ring bucket keeps its
newest day), and max_day is a maximum, so the terminal table is the same whatever order, batching or split
across instances the events are folded in. The scoring service relies on it to merge other instances'
terminal counts (consumers/terminals/deltas.py). Labels touch other fields than events do, so the two folds
commute; a label reports its event once, on the earliest day it was labelled fraud, unless a later label
says not fraud (report_memory.py): the same whatever order the labels of the events a terminal remembers
come in, and beyond its memory the labels that come late are not counted, never counted twice.

Labels are applied at their label_ts: a label given with a batch changes the reports of the events of that
batch with ts >= label_ts and of every later batch (a batch's labels are folded in label_ts order). So a
caller must not pass a label whose label_ts is later than events of later batches
(`stream_batches.replay_batches` splits a history that way).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.features.definitions import (
    DAY_US,
    FEATURE_NAMES,
    SECOND_US,
    WINDOW_DAYS,
    derive_features,
    feature_matrix,
    terminal_hashes,
)
from pipeline.features.record_checks import record_fault, record_faults
from pipeline.features.report_memory import fold_reports
from pipeline.features.state import (
    ACCOUNT_STATE,
    TERMINAL_STATE,
    StateTable,
    add_to_ring,
    encode_tables,
    read_snapshot,
    ring_window_sums,
)
from pipeline.features.stream_batches import (
    EventBatch,
    FeaturizerCheckpoint,
    LabelBatch,
    TerminalOp,
    take_events,
)
from pipeline.features.stream_windows import DAY_SPAN, grouped_cumsum, in_batch_windows


@dataclass(frozen=True)
class _Labels:
    """The labels of a batch that may change terminal state, in label_ts order (all [L]): terminal, label time
    and day, labelled event (LabelBatch.report_keys), verdict."""

    terminals: list[str]
    label_us: np.ndarray
    days: np.ndarray
    events: np.ndarray
    fraud: np.ndarray


def _entity_batch(table: StateTable, keys: Sequence[str], days: np.ndarray):
    """A batch's events as seen by one entity kind (accounts or terminals).

    Returns slots [N] (records in `table`, created for new keys), codes [N] (0.. within this batch),
    order [N] (events by entity, then arrival), key [N] (entity * 2**20 + day, in `order`, non-decreasing,
    so window starts are searchsorted) and day_eff [N] (each event's day, clamped to the newest day its
    entity has seen, so a late event's windows end there).
    """
    slots = table.slots(list(keys))
    _, codes = np.unique(slots, return_inverse=True)
    order = np.argsort(codes, kind="stable")
    state_max_day = table.records["max_day"][slots].astype(np.int64)
    key = np.maximum.accumulate(codes[order] * DAY_SPAN + np.maximum(days[order], state_max_day[order]))
    day_eff = np.empty(len(keys), dtype=np.int64)
    day_eff[order] = key % DAY_SPAN
    return slots, codes, order, key, day_eff


def _newest_so_far(
    ts_us: np.ndarray, state_ts: np.ndarray, codes: np.ndarray, order: np.ndarray
) -> np.ndarray:
    """[N] the latest ts of each event's entity up to and including it, in arrival order: the running
    maximum of ts_us [N] per entity (codes [N], `order` grouping them, as _entity_batch's), starting from
    state_ts [N], the newest the state holds for it.

    Done on ranks, so that entity * ranks + rank cannot overflow whatever the timestamps: one running
    maximum over the whole batch then restarts at each entity, whose keys all lie above the last one's."""
    values, rank = np.unique(np.concatenate([state_ts, ts_us]), return_inverse=True)
    span = len(values)
    group = codes[order].astype(np.int64)
    start = np.maximum(rank[: len(ts_us)], rank[len(ts_us) :])[order]  # this event or the state
    running = np.maximum.accumulate(group * span + start) - group * span
    newest = np.empty(len(ts_us), dtype=np.int64)
    newest[order] = values[running]
    return newest


class StreamingFeaturizer:
    """Keeps per-account and per-terminal state and turns micro-batches of events into features."""

    def __init__(self):
        self.accounts = StateTable(ACCOUNT_STATE)
        self.terminals = StateTable(TERMINAL_STATE)
        # When a list, every change to terminal state is also appended here as an operation that
        # apply_terminal_ops can redo exactly (the service journals them: consumers/terminals/table.py).
        self.terminal_journal: list[TerminalOp] | None = None

    # -- state codec -------------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        return encode_tables({"accounts": self.accounts, "terminals": self.terminals})

    @classmethod
    def from_bytes(cls, data: bytes) -> "StreamingFeaturizer":
        """The featurizer to_bytes wrote. Raises ValueError naming what is wrong: another version or layout
        (state.read_snapshot), or a record holding what no events fold (record_checks.py), which would read
        as garbage ever after."""
        featurizer = cls()
        tables = {"accounts": featurizer.accounts, "terminals": featurizer.terminals}
        snapshot = read_snapshot(data, {name: table.dtype for name, table in tables.items()})
        for name, (keys, records) in snapshot.items():
            bad = np.flatnonzero(record_faults(records))
            if len(bad):
                raise ValueError(
                    f"featurizer state snapshot: the {name} record of {keys[bad[0]][:100]!r} holds "
                    f"{record_fault(records[bad[0]])}, which no events give ({len(bad)} record(s) like it): the "
                    "snapshot is corrupt. Rebuild the state by replaying history."
                )
            slots = tables[name].add(keys)  # may grow the table: its records are read after
            tables[name].records[slots] = records
        return featurizer

    def checkpoint(self, accounts: Sequence[str], terminals: Sequence[str]) -> FeaturizerCheckpoint:
        """What rollback needs to undo any work on these accounts and terminals (a last resort's undo: not
        for every batch)."""
        journal = self.terminal_journal
        return FeaturizerCheckpoint(
            {key: self.accounts.get_bytes(key) for key in accounts},
            {key: self.terminals.get_bytes(key) for key in terminals},
            None if journal is None else len(journal),
        )

    def rollback(self, checkpoint: FeaturizerCheckpoint) -> None:
        """Put the checkpoint's records back as they were: those that did not exist are dropped."""
        for table, records in ((self.accounts, checkpoint.accounts), (self.terminals, checkpoint.terminals)):
            for key, data in records.items():
                if data is not None:
                    table.put_bytes(key, data)
                elif key in table:
                    table.evict(key)
        if checkpoint.journal_length is not None and self.terminal_journal is not None:
            del self.terminal_journal[checkpoint.journal_length :]

    # -- the work ----------------------------------------------------------------------------------------
    def transform(
        self, events: EventBatch, labels: LabelBatch | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Features [N, F] float64 and terminal buckets [N] int64 of a micro-batch; updates the state."""
        raw, hashes, fold = self._read(events, labels)
        fold()
        return feature_matrix(derive_features(raw)), hashes[:, 0]

    def transform_finite(
        self, events: EventBatch, labels: LabelBatch | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, list[str]]]:
        """transform, leaving out the events whose feature row is not finite: features [M, F], buckets [M],
        kept [M] (indices into `events`, in order) and {left-out index: its non-finite features}. A left-out
        event changes no state, and the events kept are featurized as if it had never come; the labels are
        applied either way."""
        kept = np.arange(len(events.ts_us))
        left_out: dict[int, list[str]] = {}
        part = events
        while True:
            with np.errstate(over="ignore", invalid="ignore"):  # what overflows is left out below
                raw, hashes, fold = self._read(part, labels)
                features = feature_matrix(derive_features(raw))
            finite = np.isfinite(features)
            if finite.all():  # each pass leaves out at least one event: at most N passes, one in practice
                fold()
                return features, hashes[:, 0], kept, left_out
            for row in np.flatnonzero(~finite.all(axis=1)).tolist():
                left_out[int(kept[row])] = [FEATURE_NAMES[f] for f in np.flatnonzero(~finite[row]).tolist()]
            kept = kept[finite.all(axis=1)]
            part = take_events(events, kept)

    def raw_aggregates(self, events: EventBatch, labels: LabelBatch | None = None) -> dict[str, np.ndarray]:
        raw, _, fold = self._read(events, labels)
        fold()
        return raw

    def _read(self, events: EventBatch, labels: LabelBatch | None):
        """-> raw aggregates {name: [N]}, terminal hashes [N, 2] and fold(): the batch read against the state,
        and the call that then folds it (and the labels) into the state. New keys get empty records here."""
        ts_us = np.asarray(events.ts_us, dtype=np.int64)
        amounts = np.asarray(events.amounts, dtype=np.float64)
        days = ts_us // DAY_US
        hashes = terminal_hashes(events.terminal_ids)  # [N, 2]: embedding bucket, seen-bit
        raw: dict[str, np.ndarray] = {"amount": amounts, "ts_us": ts_us}
        accounts, fold_accounts = self._account_part(events.account_ids, hashes[:, 1], ts_us, days, amounts)
        terminals, fold_terminals = self._terminal_part(events.terminal_ids, ts_us, days, labels)
        raw.update(accounts)
        raw.update(terminals)

        def fold() -> None:
            fold_accounts()
            fold_terminals()

        return raw, hashes, fold

    def _account_part(self, account_ids, bits, ts_us, days, amounts):
        n = len(ts_us)
        slots, codes, order, key, day_eff = _entity_batch(self.accounts, account_ids, days)
        rec = self.accounts.records  # after _entity_batch: creating records may have grown the array
        first_in_group = np.ones(n, dtype=bool)
        first_in_group[1:] = codes[order][1:] != codes[order][:-1]

        out: dict[str, np.ndarray] = {}
        log_amount = np.log1p(amounts)
        # All-history moments before each event: state + earlier events of this batch (segmented cumsum).
        for name, values, field in (
            ("prev_count", np.ones(n), "count"),
            ("prev_sum_log_amount", log_amount, "sum_log_amount"),
            ("prev_sumsq_log_amount", log_amount * log_amount, "sumsq_log_amount"),
        ):
            inclusive = grouped_cumsum(values[order], first_in_group)
            prev = np.empty(n)
            prev[order] = np.where(first_in_group, 0.0, np.concatenate([[0.0], inclusive[:-1]]))  # exclusive
            out[name] = prev + rec[field][slots]
        newest = _newest_so_far(ts_us, rec["last_ts_us"][slots], codes, order)  # [N] inclusive
        # The gap runs from the newest event before this one (state or batch), not the last to arrive: a
        # late event then changes no later event's gap, as in time order.
        prev_ts = np.empty(n, dtype=np.int64)
        shifted = np.concatenate([[0], newest[order][:-1]])
        prev_ts[order] = np.where(first_in_group, rec["last_ts_us"][slots][order], shifted)
        has_prev = out["prev_count"] > 0
        out["gap_s"] = np.where(has_prev, np.maximum(ts_us - prev_ts, 0) / SECOND_US, 0.0)

        # Terminal seen before: bit in the state's bitset, or an earlier event of this batch with the same bit.
        seen_state = (rec["seen_terminals"][slots, bits // 8] >> (bits % 8)) & 1
        pair = codes * 1024 + bits
        pair_order = np.argsort(pair, kind="stable")
        repeat = np.zeros(n, dtype=bool)
        repeat[pair_order[1:]] = pair[pair_order][1:] == pair[pair_order][:-1]
        out["terminal_seen"] = (seen_state.astype(bool) | repeat).astype(np.int64)

        in_batch = in_batch_windows(key, amounts[order], first_in_group, days[order])
        in_state = ring_window_sums(rec, slots, day_eff, ("day_count", "day_amount"), "day")
        for d, (count, total) in in_batch.items():
            c = np.empty(n, dtype=np.int64)
            s = np.empty(n)
            c[order], s[order] = count, total
            state_count, state_amount = in_state[d]
            out[f"account_count_{d}d"] = c + state_count
            out[f"account_amount_{d}d"] = s + state_amount

        def fold() -> None:  # this batch into the state, after every read above
            rec = self.accounts.records
            last = np.ones(n, dtype=bool)  # last event of each account in this batch, in arrival order
            last[:-1] = codes[order][1:] != codes[order][:-1]
            last_idx = order[last]
            group_slots = slots[last_idx]
            np.add.at(rec["count"], slots, 1)  # unbuffered, one event at a time: each slot its own sums
            np.add.at(rec["sum_log_amount"], slots, log_amount)
            np.add.at(rec["sumsq_log_amount"], slots, log_amount * log_amount)
            rec["last_ts_us"][group_slots] = newest[last_idx]
            rec["max_day"][group_slots] = day_eff[last_idx]
            np.bitwise_or.at(rec["seen_terminals"], (slots, bits // 8), (1 << (bits % 8)).astype(np.uint8))
            # On its own day, as the terminals: a late event lands in its day's bucket, or nowhere if that
            # bucket has moved on to a day >= RING_DAYS newer (outside every window that could count it).
            self._fold_days(rec, slots, days, {"day_count": np.ones(n), "day_amount": amounts}, "day")

        return out, fold

    def _terminal_part(self, terminal_ids, ts_us, days, labels: LabelBatch | None):
        n = len(ts_us)
        table = self.terminals
        folded = self._labels_to_fold(labels)
        label_slots = table.slots(folded.terminals) if folded is not None else None
        slots, _, order, key, day_eff = _entity_batch(table, terminal_ids, days)
        rec = table.records  # only now: creating records for new terminals may have grown the array

        out: dict[str, np.ndarray] = {}
        counts_in_state = ring_window_sums(rec, slots, day_eff, ("day_count",), "day")
        for d, (count, _) in in_batch_windows(key, None, None, days[order]).items():
            c = np.empty(n, dtype=np.int64)
            c[order] = count
            out[f"terminal_count_{d}d"] = c + counts_in_state[d][0]

        reports_in_state = ring_window_sums(rec, slots, day_eff, ("report_count",), "report_day")
        # What the batch's labels change in the report rings, each change known from its label's time on.
        changed_slots, changed_us, changed_day, delta = self._report_changes(label_slots, folded)
        for d in WINDOW_DAYS:
            reports = reports_in_state[d][0]
            if len(delta):
                # Few labels per batch: a [N, K] comparison is cheaper than sorting.
                known = (
                    (changed_slots[None, :] == slots[:, None])
                    & (changed_us[None, :] <= ts_us[:, None])
                    & (changed_day[None, :] > (day_eff - d)[:, None])
                    & (changed_day[None, :] <= day_eff[:, None])
                )
                reports = reports + known.astype(np.int64) @ delta
            out[f"terminal_reports_{d}d"] = reports

        def fold() -> None:
            self._fold_terminal_events(list(terminal_ids), slots, days)  # own days: order-free (module doc)
            if folded is not None:
                self._fold_terminal_reports(
                    folded.terminals, label_slots, folded.days, folded.events, folded.fraud
                )

        return out, fold

    def _report_changes(self, label_slots: np.ndarray | None, folded: "_Labels | None"):
        """What folding `folded` at `label_slots` [L] would change in the report rings, the state left as it
        is: slot, label time, day and +1 or -1 of each change [K] (fold_reports, on copies of the records)."""
        if folded is None:
            return (np.empty(0, dtype=np.int64),) * 4
        touched, local = np.unique(label_slots, return_inverse=True)
        copies = self.terminals.records[touched]  # fancy indexing: a copy
        label, day, delta = fold_reports(copies, local, folded.days, folded.events, folded.fraud).T
        return label_slots[label], folded.label_us[label], day, delta

    def observe_labels(self, labels: LabelBatch) -> None:
        """Apply labels that arrive between batches (label_ts <= every later event's ts)."""
        folded = self._labels_to_fold(labels)
        if folded is None:
            return
        slots = self.terminals.slots(folded.terminals)
        self._fold_terminal_reports(folded.terminals, slots, folded.days, folded.events, folded.fraud)

    # -- terminal state changes, journaled -----------------------------------------------------------------
    def _fold_terminal_events(self, terminals: list[str], slots: np.ndarray, days: np.ndarray) -> None:
        """Count events at their terminals, each on its own day, which also raises max_day. Commutes with
        every other fold: a late event lands in its own day's bucket, or nowhere if that bucket has moved
        on to a day >= RING_DAYS newer (outside every window that could count it)."""
        rec = self.terminals.records
        np.maximum.at(rec["max_day"], slots, days.astype(rec["max_day"].dtype))
        self._fold_days(rec, slots, days, {"day_count": np.ones(len(slots))}, "day")
        if self.terminal_journal is not None:
            self.terminal_journal.append(TerminalOp("events", terminals, days.astype(np.int64)))

    def _fold_terminal_reports(
        self, terminals: list[str], slots: np.ndarray, days: np.ndarray, events: np.ndarray, fraud: np.ndarray
    ) -> None:
        """Fold labels into their terminals' reports (report_memory.py), one at a time in the order given: a
        batch of labels folds as they would one by one."""
        fold_reports(self.terminals.records, slots, days, events, fraud)
        if self.terminal_journal is not None:
            self.terminal_journal.append(
                TerminalOp("reports", terminals, days.astype(np.int64), events, np.asarray(fraud, dtype=bool))
            )

    def take_terminal_journal(self) -> list["TerminalOp"]:
        """The operations journaled since the last take (journaling must be on)."""
        ops, self.terminal_journal = self.terminal_journal, []
        return ops

    def apply_terminal_ops(self, ops: Sequence["TerminalOp"], redo=lambda terminal, op_index: True) -> None:
        """Redo journaled operations, in order, for the terminals `redo(terminal, op_index)` selects. Each
        terminal's records come out bit for bit as when the operations first ran: the folds of one terminal
        never depend on another's. Not journaled again."""
        journal, self.terminal_journal = self.terminal_journal, None
        try:
            for index, op in enumerate(ops):
                keep = [i for i, terminal in enumerate(op.terminals) if redo(terminal, index)]
                if not keep:
                    continue
                terminals = [op.terminals[i] for i in keep]
                slots = self.terminals.slots(terminals)
                if op.kind == "events":
                    self._fold_terminal_events(terminals, slots, op.days[keep])
                else:
                    self._fold_terminal_reports(
                        terminals, slots, op.days[keep], op.events[keep], op.fraud[keep]
                    )
        finally:
            self.terminal_journal = journal

    def _labels_to_fold(self, labels: LabelBatch | None) -> "_Labels | None":
        """The batch's labels that may change terminal state, in label_ts order (stable): every fraud label,
        and each label saying not fraud whose event its terminal remembers or a fraud label of this batch
        reports (the others have nothing to withdraw, and create no terminal). None when there are none."""
        if labels is None or len(labels.terminal_ids) == 0:
            return None
        terminals, slot_of = labels.terminal_ids, self.terminals.slot_of
        fraud = np.asarray(labels.is_fraud, dtype=bool)
        # Most labels say not fraud and have nothing to withdraw: only those at a terminal that holds reports
        # or gets one in this batch are hashed.
        reported_at = {terminals[i] for i in np.flatnonzero(fraud).tolist()}
        index = np.flatnonzero(
            fraud
            | np.fromiter((t in slot_of or t in reported_at for t in terminals), dtype=bool, count=len(fraud))
        )
        keys = labels.report_keys(index.tolist())
        pairs = list(zip((terminals[i] for i in index.tolist()), keys.tolist(), strict=True))
        verdicts = fraud[index].tolist()
        reported = {pair for pair, is_fraud in zip(pairs, verdicts, strict=True) if is_fraud}
        memory = self.terminals.records["reported_event"]
        keep = np.array(
            [
                is_fraud
                or pair in reported
                or (pair[0] in slot_of and bool((memory[slot_of[pair[0]]] == pair[1]).any()))
                for pair, is_fraud in zip(pairs, verdicts, strict=True)
            ],
            dtype=bool,
        )
        index, keys = index[keep], keys[keep]
        if len(index) == 0:
            return None
        label_us = np.asarray(labels.label_ts_us, dtype=np.int64)[index]
        order = np.argsort(label_us, kind="stable")
        index, keys, label_us = index[order], keys[order], label_us[order]
        return _Labels(
            [terminals[i] for i in index.tolist()], label_us, label_us // DAY_US, keys, fraud[index]
        )

    @staticmethod
    def _fold_days(rec, slots, days, values: dict[str, np.ndarray], day_field: str) -> None:
        """Sum values per (slot, day), then add those totals into the day-rings."""
        key = slots * DAY_SPAN + days
        unique_key, inverse = np.unique(key, return_inverse=True)
        totals = {
            name: np.bincount(inverse, weights=v, minlength=len(unique_key)) for name, v in values.items()
        }
        add_to_ring(rec, unique_key // DAY_SPAN, unique_key % DAY_SPAN, totals, day_field)
