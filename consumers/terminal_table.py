"""The global terminal-risk table: the featurizer's per-terminal records, kept in a compacted Kafka topic.

Layout. One compacted topic (`terminal_table_topic`, ONE partition, no time retention) holds three kinds of
record. Keys that start with a NUL byte are reserved: no real terminal id has one.
- Terminal records, keyed by terminal_id. The value is a header (magic, state version, feature version,
  stamp) + the featurizer's TERMINAL_STATE bytes (30-day rings of transaction and fraud-report counts) as
  they stood after batch number `stamp`.
- Journal records, keyed JOURNAL_PREFIX + batch seq + writer. The value is one batch's terminal operations,
  in the order they ran: events counted at their terminals on their effective days, and fraud reports on
  their label days (pipeline.features.stream.TerminalOp).
- POSITIONS_KEY holds the positions of the `labels` topic that the table reflects, and the batch's seq:
  {"topic": ..., "offsets": {partition: next offset to read}, "seq": ...}.

Writes (TerminalTable.batch_records), in the SAME Kafka transaction as the batch's scores, account states and
consumer offsets, so terminal counts, label reports and account states move together, all or nothing:
- the batch's journal record, unless every terminal it changed is snapshotted in the same batch;
- the records of the terminals that have been DIRTY (changed since their last record) longest, stamped
  with the batch's seq. There are enough that each change reaches a record within about
  `terminal_snapshot_batches` batches, and a terminal nobody touches is never rewritten;
- tombstones for the journal records that no dirty terminal needs any more;
- the label positions.
A batch of 500 events touches ~400 terminals. Writing each one's record took ~0.85 sends per event, nearly
as many as the scores. Now a batch costs a few dozen sends.

Reads (TerminalTable.restore). On start an instance reads the whole topic (read_committed, up to its high
watermark, consumers/compacted.py; last record per key wins). It loads the terminal records, then redoes the journal, in batch order,
for each terminal whose stamp is older than the journal record. A terminal with no record redoes every
journal record from its first. Redone folds are the same calls on the same arguments, and one terminal's
folds never depend on another's, so the state comes back bit for bit. The instance then reads `labels` from
the recorded positions (from the beginning when there are none): a label is applied exactly once across
restarts and crashes. An aborted batch restores the table the same way, which discards its half-applied
terminal counts and labels.

Several instances: NOT exact. Every instance reads all labels, so fraud-report counts are complete in each
one, but each instance adds to the terminal transaction counts only the events of ITS OWN partitions, and the
topic is last-writer-wins per key: with N instances a terminal's counts are one instance's partial view
(plus whatever it restored), and the label positions record is also last-writer-wins. The design is exact for
one instance (or one partition). The service says so when it owns only some partitions: a warning at each
assignment and the gauge txsentinel_terminal_counts_partial.

The planned step up (not built):
1. Count each event on its own day (a ring bucket keeps its newest day and drops older ones). The terminal
   state is then the same whatever order events are folded in; only a late event's own windows still end
   at the newest day seen. Batch features are unchanged: in time order no event is late.
2. In each batch's transaction an instance writes one delta record per input partition of the batch: that
   partition's (terminal, day, count) increments. They go to a `terminal-deltas` topic, to the same
   partition number. Each batch, before scoring, the instance reads the deltas of the partitions it does
   not own and folds them in. Another instance's events then reach its counts one batch cycle later.
3. One table writer (DESIGN.md's terminal-risk consumer) folds every delta and every label. It writes this
   compacted table, with the delta and label positions the table reflects, in one transaction per write.
   A scorer restores from the table, then replays deltas and labels from those positions. Thanks to step
   1, the result is exact.

"""

import json
import logging
import math
import struct
import time
from collections import deque

import numpy as np

from consumers.compacted import Reader, read_latest
from pipeline.features.definitions import FEATURE_VERSION
from pipeline.features.state import STATE_VERSION, TERMINAL_STATE, StateTable
from pipeline.features.stream import StreamingFeaturizer, TerminalOp

log = logging.getLogger(__name__)

POSITIONS_KEY = "\x00labels-positions"
JOURNAL_PREFIX = "\x00journal/"  # + 20-digit seq + "/" + writer tag; NUL: no terminal id starts with one
TABLE_PARTITIONS = 1  # small and read whole by every instance: one partition keeps it simple and ordered
MIN_SNAPSHOTS_PER_BATCH = 8
_MAGIC = b"TXT2"  # a stamped terminal record
_UNSTAMPED_MAGIC = b"TXST"  # terminal records of txsentinel before the journal
_JOURNAL_MAGIC = b"TXTJ"
_HEADER = struct.Struct("<4sHHq")  # magic, state version, feature version, stamp (or journal seq)


def encode_terminal(record: bytes, stamp: int) -> bytes:
    """A table value: the TERMINAL_STATE bytes as they were after batch `stamp`."""
    return _HEADER.pack(_MAGIC, STATE_VERSION, FEATURE_VERSION, stamp) + record


def decode_terminal(terminal_id: str, data: bytes) -> tuple[int, bytes]:
    """(stamp, TERMINAL_STATE bytes) of a table value; ValueError saying what to do when it is not one."""
    what = f"terminal table record of {terminal_id!r}"
    stamp = _check_header(what, data, _MAGIC)
    record = data[_HEADER.size :]
    if len(record) != TERMINAL_STATE.itemsize:
        raise ValueError(f"{what} is {len(record)} bytes of state, expected {TERMINAL_STATE.itemsize}")
    return stamp, record


def journal_key(seq: int, writer: str) -> str:
    return f"{JOURNAL_PREFIX}{seq:020d}/{writer}"


def encode_journal(seq: int, ops: list[TerminalOp]) -> bytes:
    """A journal value: batch `seq`'s terminal operations, in the order they ran."""
    body = [[op.kind, op.terminals, op.days.tolist()] for op in ops]
    header = _HEADER.pack(_JOURNAL_MAGIC, STATE_VERSION, FEATURE_VERSION, seq)
    return header + json.dumps(body, separators=(",", ":")).encode()


def decode_journal(key: str, data: bytes) -> tuple[int, list[TerminalOp]]:
    seq = _check_header(f"terminal journal record {key!r}", data, _JOURNAL_MAGIC)
    body = json.loads(data[_HEADER.size :])
    return seq, [
        TerminalOp(kind, terminals, np.asarray(days, dtype=np.int64)) for kind, terminals, days in body
    ]


def _check_header(what: str, data: bytes, magic: bytes) -> int:
    if data[:4] == _UNSTAMPED_MAGIC:
        raise ValueError(
            f"{what} was written by a txsentinel from before the terminal journal: point terminal_table_topic "
            "at a new topic (and replay, or accept terminal counts that start from zero)"
        )
    if len(data) < _HEADER.size or data[:4] != magic:
        raise ValueError(
            f"{what}: not a {'journal' if magic == _JOURNAL_MAGIC else 'terminal'} record (bad magic)"
        )
    _, state_version, feature_version, stamp = _HEADER.unpack_from(data)
    if (state_version, feature_version) != (STATE_VERSION, FEATURE_VERSION):
        raise ValueError(
            f"{what} has state version {state_version}, feature version {feature_version}; this txsentinel "
            f"writes {STATE_VERSION}, {FEATURE_VERSION}. Point terminal_table_topic at a new topic and replay, "
            "or serve the version that wrote it"
        )
    return stamp


def encode_positions(topic: str, offsets: dict[int, int], seq: int) -> bytes:
    labels = {"topic": topic, "offsets": {str(p): o for p, o in sorted(offsets.items())}}
    return json.dumps({**labels, "seq": seq}).encode()


def decode_positions(data: bytes, labels_topic: str) -> tuple[dict[int, int], int]:
    """(label positions, seq of the batch that wrote them)."""
    value = json.loads(data)
    if value["topic"] != labels_topic:
        raise ValueError(
            f"the terminal table reflects labels topic {value['topic']!r}, this service reads {labels_topic!r}: "
            "point terminal_table_topic at a new topic for the new labels topic"
        )
    return {int(p): int(o) for p, o in value["offsets"].items()}, int(value.get("seq", -1))


class TerminalTable:
    """One instance's side of the table: what each batch writes, and the restore that reads it back.

    Bookkeeping: the DIRTY terminals, whose state has changed since their record in the topic was taken, in
    the order they became dirty, each with the batch before its first change (the journal it needs starts
    after that); the snapshots take them from the front. And the journal records not yet tombstoned. A
    terminal nobody touches is clean and costs nothing. Turns the featurizer's journal on.
    """

    def __init__(self, featurizer: StreamingFeaturizer, snapshot_batches: int, writer: str):
        self.featurizer = featurizer
        self.snapshot_batches = snapshot_batches
        self.writer = writer
        self._reset()

    def _reset(self) -> None:
        self.featurizer.terminal_journal = []
        self.needs_from: dict[str, int] = {}  # dirty terminal -> the batch before its first change
        self.dirty: deque[str] = deque()  # the same terminals, in the order they became dirty
        self.live_journal: deque[str] = deque()  # journal keys, oldest first
        self.seq = 0  # the next batch's

    def _mark_dirty(self, terminal: str, seq: int) -> None:
        if terminal not in self.needs_from:
            self.needs_from[terminal] = seq - 1
            self.dirty.append(terminal)

    def batch_records(
        self, labels_topic: str, label_positions: dict[int, int]
    ) -> list[tuple[str, bytes | None]]:
        """(key, value) to write in this batch's transaction, after its events are featurized: its journal
        record, snapshots of the longest-dirty terminals, tombstones for the journal records no dirty
        terminal needs, and the label positions; None values are tombstones."""
        seq, self.seq = self.seq, self.seq + 1
        ops = self.featurizer.take_terminal_journal()
        out: list[tuple[str, bytes | None]] = []
        for op in ops:
            for terminal in op.terminals:
                self._mark_dirty(terminal, seq)
        wanted = max(MIN_SNAPSHOTS_PER_BATCH, math.ceil(len(self.dirty) / self.snapshot_batches))
        for _ in range(min(wanted, len(self.dirty))):
            terminal = self.dirty.popleft()
            del self.needs_from[terminal]  # its record now holds every change: clean
            out.append((terminal, encode_terminal(self.featurizer.terminals.get_bytes(terminal), seq)))
        needed_after = self.needs_from[self.dirty[0]] if self.dirty else seq
        while self.live_journal and _journal_seq(self.live_journal[0]) <= needed_after:
            out.append((self.live_journal.popleft(), None))
        if ops and seq > needed_after:  # some terminal it changed is still dirty: the journal needs it
            key = journal_key(seq, self.writer)
            out.append((key, encode_journal(seq, ops)))
            self.live_journal.append(key)
        out.append((POSITIONS_KEY, encode_positions(labels_topic, label_positions, seq)))
        return out

    def restore(self, latest: dict[str, bytes | None], labels_topic: str) -> dict[int, int]:
        """Load the table's records (last value per key) into the featurizer, redo the journal for every
        terminal whose record is older, and return the label positions the table reflects."""
        self._reset()
        positions_value = latest.pop(POSITIONS_KEY, None)
        positions, last_seq = (
            ({}, -1) if positions_value is None else decode_positions(positions_value, labels_topic)
        )
        table = StateTable(TERMINAL_STATE)
        stamps: dict[str, int] = {}
        journal = []
        for key, value in latest.items():
            if value is None:
                continue  # a tombstone: a journal record no longer needed, or a deleted terminal
            if key.startswith(JOURNAL_PREFIX):
                journal.append((*decode_journal(key, value), key))
            else:
                stamps[key], record = decode_terminal(key, value)
                table.put_bytes(key, record)
        self.featurizer.terminals = table
        journal.sort(key=lambda entry: entry[0])
        op_seqs = [seq for seq, ops, _ in journal for _ in ops]
        ops = [op for _, entry_ops, _ in journal for op in entry_ops]

        def redo(terminal: str, index: int) -> bool:
            seq = op_seqs[index]
            if seq <= stamps.get(terminal, -1):  # no record: every operation is redone
                return False
            self._mark_dirty(terminal, seq)  # ops come in batch order: the dirty order is kept
            return True

        self.featurizer.apply_terminal_ops(ops, redo)
        self.live_journal = deque(key for _, _, key in journal)
        self.seq = max([last_seq, *(seq for seq, _, _ in journal), *stamps.values()]) + 1
        return positions


def _journal_seq(key: str) -> int:
    return int(key[len(JOURNAL_PREFIX) :].split("/", 1)[0])


def restore_table(
    reader: Reader, topic: str, table: TerminalTable, labels_topic: str, timeout_s: float
) -> tuple[dict[int, int], int]:
    """Replace the featurizer's terminal table with the topic's; returns (label positions, terminals).

    `reader` (consumers/compacted.py) is assigned the table partition and unassigned afterwards. Raises
    TimeoutError past `timeout_s`.
    """
    started = time.monotonic()
    latest, _ = read_latest(reader, topic, list(range(TABLE_PARTITIONS)), timeout_s)
    journal = sum(key.startswith(JOURNAL_PREFIX) and value is not None for key, value in latest.items())
    positions = table.restore(latest, labels_topic)
    terminals = len(table.featurizer.terminals)
    log.info(
        "terminal table restored topic=%s terminals=%d journal_records=%d label_positions=%s seconds=%.3f",
        topic, terminals, journal, positions, time.monotonic() - started,
    )  # fmt: skip
    return positions, terminals
