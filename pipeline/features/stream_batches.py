"""What the streaming featurizer takes and gives, batch by batch: events, labels, terminal changes and
checkpoints (all plain arrays), and a dataset cut into time-ordered micro-batches with their labels.
"""

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl


@dataclass(frozen=True)
class EventBatch:
    """A micro-batch of events in arrival order (all [N])."""

    account_ids: Sequence[str]
    terminal_ids: Sequence[str]
    ts_us: np.ndarray  # int64 microseconds since the epoch, UTC
    amounts: np.ndarray  # float64


def event_id_hash(event_id: str) -> int:
    """A stable 64-bit hash of an event id, never 0 (an empty slot wherever ids are remembered)."""
    return int.from_bytes(hashlib.blake2b(event_id.encode(), digest_size=8).digest(), "little") or 1


def event_id_hashes(event_ids: Sequence[str]) -> np.ndarray:
    """[N] uint64 event_id_hash of each id."""
    return np.fromiter(map(event_id_hash, event_ids), dtype=np.uint64, count=len(event_ids))


@dataclass(frozen=True)
class TerminalOp:
    """One change to terminal state, as journaled: events counted at their terminals on their effective
    days ("events"), or labels on their label days ("reports", with each labelled event's key,
    LabelBatch.report_keys, in `events` and each verdict in `fraud`, in the order they were folded);
    terminals and days [K]."""

    kind: str
    terminals: list[str]
    days: np.ndarray
    events: np.ndarray | None = None  # [K] uint64, reports only
    fraud: np.ndarray | None = None  # [K] bool, reports only

    def __post_init__(self) -> None:
        if self.kind == "reports" and (self.events is None or self.fraud is None):
            raise ValueError(
                "a reports op needs the key of each labelled event (LabelBatch.report_keys) and its verdict"
            )


@dataclass(frozen=True)
class FeaturizerCheckpoint:
    """Some accounts' and terminals' records as they were ({key: bytes, None: not held}), and how long the
    terminal journal was: what rollback puts back."""

    accounts: dict[str, bytes | None]
    terminals: dict[str, bytes | None]
    journal_length: int | None


@dataclass(frozen=True)
class LabelBatch:
    """Label events (all [L]): a fraud label reports its event at its terminal, one saying not fraud takes
    back the report of an event labelled fraud before (report_memory.py). `event_ids` and `account_ids`: the
    labelled events, each an event_id of its account (as replays are told apart): a label repeated for the
    same event is counted once."""

    terminal_ids: Sequence[str]
    label_ts_us: np.ndarray
    is_fraud: np.ndarray
    event_ids: Sequence[str]
    account_ids: Sequence[str]

    def report_keys(self, index: Sequence[int]) -> np.ndarray:
        """[K] uint64: the labelled event of each label at `index`, its account's and its own id hashed
        together (ids hold no NUL: the decoders refuse what does not print)."""
        return event_id_hashes([f"{self.account_ids[i]}\x00{self.event_ids[i]}" for i in index])


def take_events(events: EventBatch, index: np.ndarray) -> EventBatch:
    """The events at `index` [M] (increasing positions), in that order; all of them: the batch itself."""
    if len(index) == len(events.ts_us):
        return events
    picked = index.tolist()
    return EventBatch(
        [events.account_ids[i] for i in picked],
        [events.terminal_ids[i] for i in picked],
        np.asarray(events.ts_us)[index],
        np.asarray(events.amounts)[index],
    )


def replay_batches(
    frame: pl.DataFrame, batch_events: int = 500
) -> Iterator[tuple[EventBatch, LabelBatch | None]]:
    """Split a dataset (canonical columns, any order) into time-ordered micro-batches with their labels.

    Each fraud label travels with the first batch whose last event has ts >= label_ts, so it is known to
    exactly the events with ts >= label_ts — the batch form's definition.
    """
    frame = frame.sort("ts", "event_id")
    ts_us = frame["ts"].dt.epoch("us").to_numpy()
    accounts = frame["account_id"].to_list()
    terminals = frame["terminal_id"].to_list()
    amounts = frame["amount"].to_numpy()
    labelled = "is_fraud" in frame.columns and "label_ts" in frame.columns
    if labelled:
        fraud = frame.filter(pl.col("is_fraud") & pl.col("label_ts").is_not_null()).sort("label_ts")
        label_us = fraud["label_ts"].dt.epoch("us").to_numpy()
        label_terminals = fraud["terminal_id"].to_list()
        label_events = fraud["event_id"].to_list()
        label_accounts = fraud["account_id"].to_list()
    cursor = 0
    for start in range(0, len(ts_us), batch_events):
        stop = min(start + batch_events, len(ts_us))
        labels = None
        if labelled:
            end = int(np.searchsorted(label_us, ts_us[stop - 1], side="right"))
            if end > cursor:
                labels = LabelBatch(
                    label_terminals[cursor:end],
                    label_us[cursor:end],
                    np.ones(end - cursor, bool),
                    label_events[cursor:end],
                    label_accounts[cursor:end],
                )
            cursor = end
        yield (
            EventBatch(accounts[start:stop], terminals[start:stop], ts_us[start:stop], amounts[start:stop]),
            labels,
        )
