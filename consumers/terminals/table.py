"""The global terminal-risk table: every terminal's featurizer record, kept in one compacted Kafka topic.

Terminal state is order-free (pipeline/features/stream.py): the state after any set of events and fraud
labels is the same whatever order, batching or instance they were folded in. Everything here rests on it.

The flow (docs/architecture.md, "Terminal risk across instances"):
- Every scorer instance folds its own events into its terminal state as it scores them and, in the SAME
  transaction as the batch's scores, writes one DELTA record to `terminal-deltas`: the batch's (terminal,
  day) event counts (consumers/terminals/deltas.py). Every terminal_feed_interval_ms it folds in the deltas
  other instances have committed since, and the labels (consumers/terminals/feed.py). So every instance
  counts every event at its terminal: its own at once, the others' about that interval later.
- ONE table writer (consumers/terminals/writer.py; it runs in the instance that owns transactions partition 0)
  folds every delta and every label into its own copy of the state and, every `terminal_table_flush_s`,
  writes the changed terminals and the positions it has read to (deltas and labels) in one transaction
  (paced, so an embedded writer leaves the scorer beside it most of the interpreter).
- A scorer starts, and restarts after an aborted batch, from the table, then folds the deltas and labels
  after the table's positions up to their high watermarks. Because the fold is order-free, that is exactly
  the state of every committed event and label, however many instances wrote them.

Layout. One partition, compacted, no time retention. Keys that start with a NUL byte are reserved:
- terminal records, keyed by terminal_id: a header (magic, state version, feature version) + the
  featurizer's TERMINAL_STATE bytes;
- POSITIONS_KEY: {"labels_topic", "labels": {partition: next offset}, "deltas_topic", "deltas": {...}}, the
  LAST record of every flush, so a read that ends on it holds a whole flush (see read_table).
"""

import json
import logging
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from consumers.runtime.compacted import Reader, read_latest
from consumers.runtime.topics import TABLE_PARTITIONS
from consumers.scoring.message_limits import MessageError
from pipeline.features.definitions import FEATURE_VERSION
from pipeline.features.record_checks import record_fault, record_faults
from pipeline.features.state import MAX_EPOCH_DAY, STATE_VERSION, TERMINAL_STATE, StateTable

log = logging.getLogger(__name__)

POSITIONS_KEY = "\x00positions"
_MAGIC = b"TXT5"
_OLDER_MAGICS = {
    b"TXT4": "before terminals remembered the verdicts of their reported events",
    b"TXT3": "before terminals remembered their reported events",
    b"TXST": "before the terminal journal",
    b"TXT2": "before the terminal table writer",
    b"TXTJ": "before the terminal table writer",
}
_HEADER = struct.Struct("<4sHH")  # magic, state version, feature version
HEADER_SIZE = _HEADER.size


@dataclass
class Positions:
    """Where the table's state stands in the topics it folds: {partition: next offset to read} each. A
    partition left out is read from its beginning."""

    labels: dict[int, int] = field(default_factory=dict)
    deltas: dict[int, int] = field(default_factory=dict)


def pack_header(magic: bytes) -> bytes:
    """A record's header: its magic and the state and feature versions of this txsentinel."""
    return _HEADER.pack(magic, STATE_VERSION, FEATURE_VERSION)


def encode_terminal(record: bytes) -> bytes:
    return pack_header(_MAGIC) + record


def decode_terminal(terminal_id: str, data: bytes) -> bytes:
    """The TERMINAL_STATE bytes of a table value. MessageError when it is not one (garbage: a reader leaves it
    out), ValueError saying what to do when it is one of another version (a deployment to fix)."""
    what = f"terminal table record of {terminal_id[:100]!r}"
    check_header(what, data, _MAGIC, "terminal_table_topic")
    record = data[_HEADER.size :]
    if len(record) != TERMINAL_STATE.itemsize:
        raise MessageError(f"{what} is {len(record)} bytes of state, expected {TERMINAL_STATE.itemsize}")
    return record


def check_header(what: str, data: bytes, magic: bytes, topic_setting: str) -> None:
    """Refuse a record that is not `magic` (MessageError: garbage, which readers of a feed may skip), or of
    another state or feature version (ValueError: a deployment to fix), saying what to do."""
    if data[:4] in _OLDER_MAGICS:
        raise ValueError(
            f"{what} was written by a txsentinel from {_OLDER_MAGICS[data[:4]]}: point {topic_setting} at a "
            "new topic (and replay, or accept terminal counts that start from zero)"
        )
    if len(data) < _HEADER.size or data[:4] != magic:
        raise MessageError(f"{what}: not a txsentinel {magic.decode()} record (bad magic)")
    _, state_version, feature_version = _HEADER.unpack_from(data)
    if (state_version, feature_version) != (STATE_VERSION, FEATURE_VERSION):
        raise ValueError(
            f"{what} has state version {state_version}, feature version {feature_version}; this txsentinel "
            f"writes {STATE_VERSION}, {FEATURE_VERSION}. Point {topic_setting} at a new topic and replay, "
            "or serve the version that wrote it"
        )


def encode_positions(positions: Positions, labels_topic: str, deltas_topic: str) -> bytes:
    def offsets(of: dict[int, int]) -> dict[str, int]:
        return {str(p): o for p, o in sorted(of.items())}

    return json.dumps(
        {
            "labels_topic": labels_topic,
            "labels": offsets(positions.labels),
            "deltas_topic": deltas_topic,
            "deltas": offsets(positions.deltas),
        }
    ).encode()


def decode_positions(data: bytes, labels_topic: str, deltas_topic: str) -> Positions:
    """The positions record's Positions. MessageError when it is not one (garbage), ValueError saying what to
    do when it reflects other topics than this service reads (a deployment to fix)."""
    value = _positions_json(data)
    for kind, expected in (("labels", labels_topic), ("deltas", deltas_topic)):
        if value[f"{kind}_topic"] != expected:
            raise ValueError(
                f"the terminal table reflects {kind} topic {value[f'{kind}_topic'][:300]!r}, this service "
                f"reads {expected!r}: point terminal_table_topic at a new topic for the new {kind} topic"
            )
    return Positions(labels=value["labels"], deltas=value["deltas"])


def _positions_json(data: bytes) -> dict:
    """The positions record's JSON, its offsets as {partition: offset} of ints >= 0; MessageError otherwise."""
    try:
        value = json.loads(data)
        ok = isinstance(value, dict) and all(isinstance(value.get(f"{k}_topic"), str) for k in _KINDS)
        if ok:
            value.update({kind: _offsets(value.get(kind)) for kind in _KINDS})
    except (ValueError, RecursionError, TypeError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        ok = False
    if not ok:
        raise MessageError(
            f"the terminal table's positions record is not one (expected {{labels_topic, labels: {{partition: "
            f"offset}}, deltas_topic, deltas: {{...}}}}): {bytes(data[:80])!r}"
        )
    return value


_KINDS = ("labels", "deltas")


def _offsets(value: object) -> dict[int, int]:
    """{partition: offset} from the record's {"partition": offset}; TypeError when it is not that."""
    if not isinstance(value, dict):
        raise TypeError
    out = {}
    for partition, offset in value.items():
        if not (
            partition.isascii()
            and partition.isdecimal()
            and len(partition) <= 9
            and type(offset) is int
            and offset >= 0
        ):
            raise TypeError
        out[int(partition)] = offset
    return out


def flush_records(
    terminals: StateTable, changed: Iterable[str], positions: Positions, labels_topic: str, deltas_topic: str
) -> list[tuple[str, bytes]]:
    """One flush of the writer, in send order: the changed terminals' records, then the positions (last)."""
    out = [(t, encode_terminal(terminals.get_bytes(t))) for t in sorted(changed)]
    out.append((POSITIONS_KEY, encode_positions(positions, labels_topic, deltas_topic)))
    return out


def _report_garbage(topic: str, garbage: list[tuple[str, MessageError]]) -> None:
    """Name the first of the terminal records that are not records at all (left out of the table), at ERROR."""
    if garbage:
        log.error(
            "terminal table records refused, their counts start again from the deltas and labels: topic=%s "
            "terminals=%d first: %s (the next flush of each such terminal writes a sound one)",
            topic, len(garbage), garbage[0][1],
        )  # fmt: skip


def _let_corrupt_records_go(topic: str, table: StateTable, last_day: int) -> list[str]:
    """Leave out the terminal records that no events and labels give (a day past the stream's range, a
    negative count, a day in another day's bucket: pipeline/features/record_checks.py; a day after
    `last_day`, the last a ts or label_ts may fall on now), naming the first at ERROR: restored, one would
    read as garbage ever after, a day past the range spills into the windows of the other terminals of a
    batch, and a day to come makes every other terminal look idle (consumers/terminals/idle.py). Every
    holder reads the same table, so every one leaves the same terminals out: their counts start again from
    the deltas and labels after the table's positions."""
    keys = list(table.slot_of)
    records = table.records[np.fromiter(table.slot_of.values(), dtype=np.int64, count=len(keys))]
    bad = np.flatnonzero(record_faults(records, last_day)).tolist()
    if bad:
        reason = record_fault(records[bad[0]], last_day)
        log.error(
            "terminal table records refused, their counts start again from the deltas and labels: topic=%s "
            "terminals=%d first=%r: %s, which no events or labels give (a corrupt record; the next flush of "
            "each such terminal writes a sound one)",
            topic, len(bad), keys[bad[0]], reason,
        )  # fmt: skip
        for i in bad:
            table.evict(keys[i])
    return [keys[i] for i in bad]


class TableRead(NamedTuple):
    terminals: StateTable
    positions: Positions
    # Keys of the records read and not held (not terminal records, corrupt, or all of them when the positions
    # record is not one): the writer deletes them, so that every later reader holds what the earlier ones do.
    left_out: list[str]


def read_table(
    reader: Reader,
    topic: str,
    labels_topic: str,
    deltas_topic: str,
    timeout_s: float,
    last_day: int = MAX_EPOCH_DAY,
) -> TableRead:
    """The table's terminal records and positions, as one flush left them. A record holding a day after
    `last_day` (the last a ts may fall on now: MessageLimits.days, plus a day for the clocks of the hosts)
    is left out as corrupt.

    Read up to the high watermark (consumers/runtime/compacted.py), and on until the last record read is a
    positions record: a flush still being written when the read began is taken whole or not at all.
    `reader` is assigned the table partition and unassigned afterwards; TimeoutError past `timeout_s`.
    """
    started = time.monotonic()
    latest, read = read_latest(
        reader, topic, list(range(TABLE_PARTITIONS)), timeout_s, last_key=POSITIONS_KEY
    )
    positions_value = latest.pop(POSITIONS_KEY, None)
    try:
        positions = (
            Positions()
            if positions_value is None
            else decode_positions(positions_value, labels_topic, deltas_topic)
        )
    except MessageError as error:
        # Without its positions the records cannot be joined to the deltas and labels after them: read as
        # no table, every terminal's counts are rebuilt from the deltas and labels the topics still hold.
        log.error(
            "terminal table read as empty: topic=%s %s. Terminal counts older than the deltas' retention "
            "(terminal_deltas_retention_ms) are lost", topic, error,
        )  # fmt: skip
        left_out = [key for key, value in latest.items() if value is not None]
        return TableRead(StateTable(TERMINAL_STATE), Positions(), left_out)
    # Records for what was read and no more: doubling up to it could leave nearly as many again unused.
    table = StateTable(TERMINAL_STATE, capacity=max(1024, len(latest)))
    garbage: list[tuple[str, MessageError]] = []
    for key, value in latest.items():
        if value is None:  # a tombstone (a terminal deleted by hand)
            continue
        try:
            table.put_bytes(key, decode_terminal(key, value))
        except MessageError as error:
            garbage.append((key, error))
    _report_garbage(topic, garbage)
    corrupt = _let_corrupt_records_go(topic, table, last_day)
    log.info(
        "terminal table read topic=%s records=%d terminals=%d positions=%s seconds=%.3f",
        topic, read, len(table), positions, time.monotonic() - started,
    )  # fmt: skip
    return TableRead(table, positions, [key for key, _ in garbage] + corrupt)
