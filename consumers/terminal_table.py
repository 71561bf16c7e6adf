"""The global terminal-risk table: the featurizer's per-terminal records, kept in a compacted Kafka topic.

Layout. One compacted topic (`terminal_table_topic`, ONE partition, no time retention), keyed by terminal_id;
the value is a versioned terminal record: header (magic, state version, feature version) + the featurizer's
TERMINAL_STATE bytes (30-day rings of transaction counts and fraud-report counts). One reserved key,
POSITIONS_KEY (it starts with a NUL byte, which no real terminal id has), holds the positions of the
`labels` topic that the table reflects: {"topic": ..., "offsets": {partition: next offset to read}}.

Writes. The service produces the records of the terminals a batch touched (its events' terminals and its
fraud labels' terminals) and the new label positions in the SAME Kafka transaction as the batch's scores,
account states and consumer offsets: terminal counts, label reports and account states move together, all
or nothing, so one instance's table is exactly-once.

Reads. On start an instance reads the whole topic (read_committed, up to its end offset; last record per key
wins) into its featurizer, then reads `labels` from the recorded positions (from the beginning when there
are none): a label is applied to the table exactly once across restarts and crashes. An aborted batch
restores the table the same way (the batch's half-applied terminal counts and labels are discarded).

Several instances: NOT exact. Every instance reads all labels, so fraud-report counts are complete in each
one, but each instance adds to the terminal transaction counts only the events of ITS OWN partitions, and the
topic is last-writer-wins per key: with N instances a terminal's counts are one instance's partial view
(plus whatever it restored), and the label positions record is also last-writer-wins. The design is exact for
one instance (or one partition). The service says so when it owns only some partitions: a warning at each
assignment and the gauge txsentinel_terminal_counts_partial.

The planned step up (not built), which also cuts the ~0.85 terminal records an event costs today:
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

A smaller step, for the sends alone, with the single-instance semantics unchanged:
- Each batch writes one JOURNAL record to this topic. Its key is a NUL byte, then "journal/<seq>", and its value lists
  the batch's terminal operations: (terminal, effective day) per event and (terminal, report day) per
  fraud label. It also writes the full records of the next few terminals, round robin, each stamped with
  the batch's seq.
- Restore reads the table, then applies each journal record to the terminals whose stamp is older than
  that record. The operations are the featurizer's own fold calls, so the result is exact bit for bit.
- Journal keys older than the oldest stamp get tombstones.
That takes a batch of 500 from ~430 sends to ~20. Restore replays at most one round-robin cycle.
"""

import json
import logging
import struct
import time

from kafka import KafkaConsumer

from consumers.compacted import read_latest
from pipeline.features.definitions import FEATURE_VERSION
from pipeline.features.state import STATE_VERSION, TERMINAL_STATE, StateTable
from pipeline.features.stream import StreamingFeaturizer

log = logging.getLogger(__name__)

POSITIONS_KEY = "\x00labels-positions"
TABLE_PARTITIONS = 1  # small and read whole by every instance: one partition keeps it simple and ordered
TABLE_CONFIG = {"cleanup.policy": "compact", "retention.ms": "-1"}
_MAGIC = b"TXST"
_HEADER = struct.Struct("<4sHH")  # magic, state version, feature version


def encode_terminal(record: bytes) -> bytes:
    return _HEADER.pack(_MAGIC, STATE_VERSION, FEATURE_VERSION) + record


def decode_terminal(terminal_id: str, data: bytes) -> bytes:
    """The TERMINAL_STATE bytes of a table value; ValueError saying what to do when it is not one."""
    if len(data) < _HEADER.size or data[:4] != _MAGIC:
        raise ValueError(f"terminal table record of {terminal_id!r}: not a terminal record (bad magic)")
    _, state_version, feature_version = _HEADER.unpack_from(data)
    if (state_version, feature_version) != (STATE_VERSION, FEATURE_VERSION):
        raise ValueError(
            f"terminal table record of {terminal_id!r} has state version {state_version}, feature version "
            f"{feature_version}; this txsentinel writes {STATE_VERSION}, {FEATURE_VERSION}. Point "
            "terminal_table_topic at a new topic and replay, or serve the version that wrote it"
        )
    record = data[_HEADER.size :]
    if len(record) != TERMINAL_STATE.itemsize:
        raise ValueError(
            f"terminal table record of {terminal_id!r} is {len(record)} bytes, expected {TERMINAL_STATE.itemsize}"
        )
    return record


def encode_positions(topic: str, offsets: dict[int, int]) -> bytes:
    return json.dumps({"topic": topic, "offsets": {str(p): o for p, o in sorted(offsets.items())}}).encode()


def decode_positions(data: bytes, labels_topic: str) -> dict[int, int]:
    value = json.loads(data)
    if value["topic"] != labels_topic:
        raise ValueError(
            f"the terminal table reflects labels topic {value['topic']!r}, this service reads {labels_topic!r}: "
            "point terminal_table_topic at a new topic for the new labels topic"
        )
    return {int(p): int(o) for p, o in value["offsets"].items()}


def changed_records(featurizer: StreamingFeaturizer, terminals: set[str]) -> list[tuple[str, bytes]]:
    """(terminal_id, table value) of each terminal in memory among `terminals`, sorted by id."""
    out = []
    for terminal in sorted(terminals):
        record = featurizer.terminals.get_bytes(terminal)
        if record is not None:  # a terminal of dropped duplicates only, never featurized here
            out.append((terminal, encode_terminal(record)))
    return out


def restore_table(
    reader: KafkaConsumer, topic: str, featurizer: StreamingFeaturizer, labels_topic: str, timeout_s: float
) -> tuple[dict[int, int], int]:
    """Replace the featurizer's terminal table with the topic's; returns (label positions, terminals).

    `reader` is a group-less consumer (read_committed); it is assigned the table partition and unassigned
    afterwards. Raises TimeoutError past `timeout_s`.
    """
    started = time.monotonic()
    latest, _ = read_latest(reader, topic, list(range(TABLE_PARTITIONS)), timeout_s)
    positions_value = latest.pop(POSITIONS_KEY, None)
    table = StateTable(TERMINAL_STATE)
    for terminal, value in latest.items():
        if value is not None:  # a tombstone: the terminal was deleted
            table.put_bytes(terminal, decode_terminal(terminal, value))
    featurizer.terminals = table
    positions = {} if positions_value is None else decode_positions(positions_value, labels_topic)
    log.info(
        "terminal table restored topic=%s terminals=%d label_positions=%s seconds=%.3f",
        topic, len(table), positions, time.monotonic() - started,
    )  # fmt: skip
    return positions, len(table)
