"""What terminal state is folded from, read by one consumer: `labels` and `terminal-deltas`, all partitions.

No consumer group: every scorer and the table writer read every partition of both, from the positions the
terminal table records (consumers/terminals/table.py), and `seek` puts a reader back there on start and after
an aborted batch. read_committed: an aborted batch's deltas never count.

Two ways to read (FeedReader.read):
- `to_high_watermark`: both topics up to their high watermarks, waiting out open transactions, as restores
  do (consumers/runtime/compacted.py says why the high watermark);
- otherwise one poll: whatever has arrived. The scorers read this way every `terminal_feed_interval_ms`, so
  a label or another instance's batch counts for the events scored after it arrives: there is no global
  order to keep between a label, or another instance's events, and this instance's events. A poll brings
  at most `poll_records` records, sized by poll_records(); one that comes back full (FeedRead.full) says
  more are waiting, and the table writer and BatchScorer.fold_feed read on.

A label's time is judged the same way by every reader: the scorers and the table writer each read every
label, so what one does with it must not depend on whose clock reads it.
- It is refused when its label_ts is more than max_ts_skew_s after the timestamp of its Kafka record
  (decode_label): the broker's when the topic stamps its records (message.timestamp.type LogAppendTime, as
  the service creates `labels`: consumers/runtime/topics.py), else its producer's, which the broker takes only within message.timestamp.after.max.ms (an hour by
  default) of its own clock. Every reader sees the same record, so every reader refuses it, or none does.
- A fraud label dated on a day this reader's clock has not reached waits (its partition is paused and sought
  back to it), and is folded with the labels after it once the day comes. Folded at once, it would take the day-ring
  bucket (day % RING_DAYS) of the terminal's oldest day in the 30-day windows and push that day's reports out
  of them until midnight, where the batch form, which counts a label from its label_ts on, still has them. A
  waiting partition's position stays at the label, so the table's positions still mean "all before is
  folded". No fraud label is folded ahead of a reader's day, and every reader folds it on its own day. A
  label saying not fraud does not wait: it takes a report back from the day that report counts on and puts
  none on a day to come (pipeline/features/report_memory.py), so when it is folded changes no bucket.
- The wait is bounded by the record: a label_ts at most max_ts_skew_s after its record's timestamp, itself
  at most message.timestamp.after.max.ms after the broker's clock, waits for the reader's next midnight at
  the latest. A label more than a day and max_ts_skew_s after this reader's clock, which only a record
  timestamped a day ahead can carry (forged, or from a broken clock the broker was set to take), is refused
  instead of holding its partition that long: the one verdict a reader's clock gives, never on a record the
  broker takes with its defaults, nor on one it stamps (LogAppendTime): a defence for a topic created
  otherwise.

A position that has left its log (the writer was down longer than the deltas' retention, or labels were
deleted unread) is never skipped unsaid: with `lost_feed_position: fail` (the default) the read raises
PositionLostError naming the partition and the records gone; with `earliest` the reader goes on from the
first record still there, logs an error and counts the records lost (on_lost: the service's
txsentinel_feed_records_lost_total). docs/operations.md says which to choose, and when.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from kafka import KafkaConsumer
from kafka.errors import OffsetOutOfRangeError
from kafka.structs import TopicPartition

from consumers.runtime.compacted import (
    PositionLostError,
    Reader,
    describe_lost,
    group_less_consumer,
    lost_positions,
)
from consumers.scoring.message_limits import DAY_US, MessageError, MessageLimits, format_ts
from consumers.scoring.messages import Label, UnknownFields, decode_label
from consumers.terminals.deltas import decode_deltas
from consumers.terminals.table import Positions, read_table
from pipeline.features.stream import StreamingFeaturizer
from pipeline.features.stream_batches import LabelBatch, TerminalOp

log = logging.getLogger(__name__)

# A label this far (plus max_ts_skew_s) after a reader's clock is refused rather than held: no clock the
# broker takes records from is a day off.
HOLD_AT_MOST_US = DAY_US
# What one poll of the feed brings at most, in terminal events: a delta record holds one scored batch's
# events (up to max_poll_records of them), a label one. Folding an event costs ~10-25 us, so one poll is
# folded in well under a second, and the table writer's flush after it stays bounded (writer.FLUSH_RECORDS).
POLL_TERMINAL_EVENTS = 10_000


@dataclass
class FeedRead:
    labels: list[Label] = field(default_factory=list)
    # (record, why) of labels and deltas that do not decode, or whose fold failed: skipped; the table
    # writer dead-letters them
    bad: list[tuple[object, MessageError]] = field(default_factory=list)
    deltas: list[TerminalOp] = field(default_factory=list)  # of other sessions, to fold in
    # the records the labels and deltas came from, one each (None where a caller built the read by hand)
    label_records: list = field(default_factory=list)
    delta_records: list = field(default_factory=list)
    full: bool = False  # the last poll brought as many records as a poll may: more are likely waiting

    def fold_into(self, featurizer: StreamingFeaturizer) -> None:
        """Apply the deltas and the labels to the featurizer's terminal state (the fold is order-free).

        The last resort: should the fold fail for a reason nobody foresaw, it is rolled back and done one
        record at a time, each under a checkpoint of its terminals; a record that fails alone is rolled
        back and moved to `bad` (the table writer dead-letters it), so no record stops a reader.
        """
        terminals = [t for op in self.deltas for t in op.terminals] + [
            label.terminal_id for label in self.labels
        ]
        checkpoint = featurizer.checkpoint([], list(dict.fromkeys(terminals)))
        try:
            _fold(featurizer, self.deltas, self.labels)
            return
        except Exception:
            featurizer.rollback(checkpoint)
            log.exception("folding labels and terminal deltas failed: folding them one at a time")
        records = {
            "delta": _padded(self.delta_records, len(self.deltas)),
            "label": _padded(self.label_records, len(self.labels)),
        }
        kept: dict[str, list] = {"delta": [], "label": []}
        for kind, items in (("delta", self.deltas), ("label", self.labels)):
            for item, record in zip(items, records[kind], strict=True):
                one = ([item], []) if kind == "delta" else ([], [item])
                terminals = item.terminals if kind == "delta" else [item.terminal_id]
                checkpoint = featurizer.checkpoint([], list(dict.fromkeys(terminals)))
                try:
                    _fold(featurizer, *one)
                    kept[kind].append(item)
                except Exception as error:
                    featurizer.rollback(checkpoint)
                    log.exception("a %s failed to fold alone: skipped", kind)
                    self.bad.append((record, MessageError(f"folding this {kind} failed: {error!r}"[:500])))
        self.deltas, self.labels = kept["delta"], kept["label"]


def _fold(featurizer: StreamingFeaturizer, deltas: list[TerminalOp], labels: list[Label]) -> None:
    featurizer.apply_terminal_ops(deltas)
    if labels:
        featurizer.observe_labels(label_batch(labels))


def _padded(records: list, n: int) -> list:
    return records if len(records) == n else [None] * n


def poll_records(batch_records: int) -> int:
    """Records one poll of the feed may bring, when a scored batch holds at most `batch_records` events."""
    return max(1, POLL_TERMINAL_EVENTS // batch_records)


class FeedReader:
    def __init__(
        self,
        consumer: KafkaConsumer,
        offsets: Reader,
        labels_topic: str,
        deltas_topic: str,
        timeout_s: float,
        limits: MessageLimits | None = None,
        lost_position: str = "fail",
        on_lost: Callable[[int], None] | None = None,
        on_held: Callable[[], None] | None = None,
    ):
        """`consumer`: read_committed, no group, no offset reset, fetches the topics. `offsets`: consumers
        only asked how far partitions go, never fetching between reads: the broker answers a connection's
        requests in order, and behind a fetch waiting for data (up to fetch_max_wait_ms) an end-offsets
        request would wait too. `limits`: what a valid label is (ServeConfig's message settings; default
        MessageLimits()). `lost_position`, `on_lost(records)`: what a position that left its log does;
        `on_held()`: a label starts waiting for its day (module docstring), once per label however often a seek
        has it read again."""
        if lost_position not in ("fail", "earliest"):
            raise ValueError(f"lost_position = {lost_position!r}, expected 'fail' or 'earliest'")
        self.consumer, self.offsets, self.timeout_s = consumer, offsets, timeout_s
        self.limits = MessageLimits() if limits is None else limits
        self.lost_position, self.on_lost, self.on_held = lost_position, on_lost, on_held
        self.records_lost = 0  # skipped under lost_position 'earliest', since the start
        # labels partitions paused at a label dated on a day to come: {partition: (its offset, its day)}
        self.held: dict[TopicPartition, tuple[int, int]] = {}
        # the offset of the last label held per partition: one held again after a seek is not a new hold
        self.held_at: dict[TopicPartition, int] = {}
        self.unknown: UnknownFields | None = None  # counts labels with fields of no known name, when set
        self.poll_records = 500  # records a poll brings at most (its readers set poll_records())
        self.labels_topic, self.deltas_topic = labels_topic, deltas_topic
        self.label_tps = self._partitions(labels_topic)
        self.delta_tps = self._partitions(deltas_topic)
        consumer.assign(self.label_tps + self.delta_tps)

    @classmethod
    def connect(
        cls, bootstrap: str, client_id: str, offsets: Reader, labels_topic: str, deltas_topic: str,
        timeout_s: float, limits: MessageLimits | None = None, lost_position: str = "fail",
        on_lost: Callable[[int], None] | None = None, on_held: Callable[[], None] | None = None, **settings,
    ) -> "FeedReader":  # fmt: skip
        """A reader with a consumer of its own (closed by close())."""
        consumer = group_less_consumer(bootstrap, client_id, **settings)
        return cls(
            consumer, offsets, labels_topic, deltas_topic, timeout_s, limits, lost_position, on_lost, on_held
        )

    def close(self) -> None:
        self.consumer.close()

    def start_from_table(
        self, featurizer: StreamingFeaturizer, reader: Reader, table_topic: str, *, row_limit: int | None
    ) -> list[str]:
        """Replace the featurizer's terminal state with the table's (consumers/terminals/table.read_table) and
        go to the positions it reflects. What comes after them is still to be read. `row_limit`: where the
        new table's records stop doubling (TerminalEviction.row_limit of its holder; None: no cap). Returns
        the keys of the table's records left out (TableRead.left_out)."""
        # A day to come is refused with a day to spare: the table was written on other hosts, by their clocks.
        last_day = self.limits.days(time.time_ns() // 1000)[1] + 1
        table = read_table(
            reader, table_topic, self.labels_topic, self.deltas_topic, self.timeout_s, last_day
        )
        featurizer.terminals = table.terminals
        featurizer.terminals.row_limit = row_limit
        self.seek(table.positions)
        return table.left_out

    def _partitions(self, topic: str) -> list[TopicPartition]:
        partitions = self.consumer.partitions_for_topic(topic)
        if not partitions:
            raise ValueError(f"topic {topic!r} has no partitions (does it exist?)")
        return [TopicPartition(topic, p) for p in sorted(partitions)]

    def seek(self, positions: Positions) -> None:
        """Go to `positions`; a partition without one starts from its beginning. Nothing waits any more: the
        labels are read again from there."""
        if self.held:
            self.consumer.resume(*self.held)
            self.held.clear()
        for tps, offsets in ((self.label_tps, positions.labels), (self.delta_tps, positions.deltas)):
            missing = [tp for tp in tps if tp.partition not in offsets]
            if missing:
                self.consumer.seek_to_beginning(*missing)
            for tp in tps:
                if tp.partition in offsets:
                    self.consumer.seek(tp, offsets[tp.partition])

    def positions(self) -> Positions:
        return Positions(
            labels={tp.partition: self.consumer.position(tp) for tp in self.label_tps},
            deltas={tp.partition: self.consumer.position(tp) for tp in self.delta_tps},
        )

    def read(
        self,
        session: bytes | None = None,
        to_high_watermark: bool = False,
        timeout_s: float | None = None,
    ) -> FeedRead:
        """Labels (bad ones apart) and the deltas of sessions other than `session`, in partition then
        offset order per poll (module docstring: how far it reads). TimeoutError when reading to the high
        watermarks takes over `timeout_s` (default: the reader's)."""
        started = time.monotonic()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self._release(time.time_ns() // 1000)
        end = (
            self.offsets.watermarks.end_offsets(self.label_tps + self.delta_tps) if to_high_watermark else {}
        )
        out = FeedRead()
        self._take(self._poll(0), session, out)  # what has arrived
        # A partition waiting at a label of a day to come is read as far as it goes today.
        while any(self.consumer.position(tp) < o for tp, o in end.items() if tp not in self.held):
            if time.monotonic() - started > timeout_s:
                left = {
                    f"{tp.topic}[{tp.partition}]": o - self.consumer.position(tp) for tp, o in end.items()
                }
                raise TimeoutError(
                    f"reading labels and terminal deltas took over {timeout_s} s with {left} records left; "
                    "a transaction still open there holds the read (the broker aborts a crashed producer's "
                    "after its transaction_timeout_ms); raise restore_timeout_s or check the broker"
                )
            self._take(self._poll(100), session, out)
        return out

    def _poll(self, timeout_ms: int) -> dict:
        try:
            return self.consumer.poll(timeout_ms=timeout_ms, max_records=self.poll_records)
        except OffsetOutOfRangeError as error:
            lost = lost_positions(error, self.offsets.watermarks)
        what = describe_lost(lost)
        if self.lost_position == "fail" or any(position >= first for position, first, _ in lost.values()):
            raise PositionLostError(
                f"reading labels and terminal deltas: {what}. Terminal counts would miss them. Keep "
                "terminal_deltas_retention_ms (and the labels topic's retention) longer than any outage of the "
                "table writer; to accept the loss and go on from the first record still there, start every "
                "instance and the writer once with lost_feed_position: earliest (docs/operations.md). A recreated "
                "topic: point terminal_table_topic at a new topic too"
            )
        for tp, (position, first, _) in lost.items():
            self.consumer.seek(tp, first)
            self.records_lost += first - position
            if self.on_lost is not None:
                self.on_lost(first - position)
        log.error(
            "reading labels and terminal deltas: %s; went on from the log's start (lost_feed_position: earliest)",
            what,
        )
        return {}

    def _take(self, batch: dict, session: bytes | None, out: FeedRead) -> None:
        out.full = sum(len(records) for records in batch.values()) >= self.poll_records
        now_us = time.time_ns() // 1000  # the clock label_ts and the deltas' days are bounded by
        for tp in sorted(batch, key=lambda tp: (tp.topic, tp.partition)):
            if tp.topic == self.labels_topic:
                self._labels(batch[tp], out, now_us)
            else:
                self._deltas(batch[tp], session, out, now_us)

    def _labels(self, records, out: FeedRead, now_us: int) -> None:
        """One partition's records, in offset order: its labels into `out`, up to one dated on a day to come,
        where the partition waits (module docstring)."""
        for record in records:
            try:
                label = self._label(record, now_us)
            except MessageError as error:
                out.bad.append((record, error))
                continue
            except Exception as error:  # the decoder is total; should it not be, one label stops nothing
                log.exception(
                    "the label decoder failed at %s[%d]@%d", record.topic, record.partition, record.offset
                )
                out.bad.append((record, MessageError(f"the label decoder failed: {error!r}"[:300])))
                continue
            if label.is_fraud and label.label_ts_us // DAY_US > now_us // DAY_US:
                self._hold(record, label, now_us)
                return  # the rest of the partition is fetched again once the label's day has come
            out.labels.append(label)
            out.label_records.append(record)

    def _label(self, record, now_us: int) -> Label:
        """The record's label, judged by the record's timestamp (module docstring), or MessageError."""
        if record.value is None:
            raise MessageError("null value (a tombstone): expected a JSON label")
        sent_ms = record.timestamp
        if type(sent_ms) is not int or sent_ms < 0:
            raise MessageError(
                f"the record has no timestamp ({sent_ms!r}): a label is judged by its record's timestamp"
            )
        label = decode_label(record.value, self.limits, now_us, self.unknown, sent_ms * 1000)
        if label.label_ts_us > now_us + self.limits.max_ts_skew_s * 1_000_000 + HOLD_AT_MOST_US:
            raise MessageError(
                f"field 'label_ts': {format_ts(label.label_ts_us)} is more than a day and max_ts_skew_s = "
                f"{self.limits.max_ts_skew_s:g} s after this instance's clock ({format_ts(now_us)}), and its "
                f"record's timestamp ({_shown_ts(sent_ms * 1000)}) is a day ahead too: forged, or from a broken "
                "clock. Held until its day, it would hold every later label of its partition"
            )
        return label

    def _hold(self, record, label: Label, now_us: int) -> None:
        """Pause the record's partition at it until the label's day (module docstring)."""
        tp = TopicPartition(record.topic, record.partition)
        self.consumer.seek(tp, record.offset)
        self.consumer.pause(tp)
        self.held[tp] = (record.offset, label.label_ts_us // DAY_US)
        if self.held_at.get(tp) == record.offset:
            return  # read again after a seek (a scorer's aborted batch): counted and logged the first time
        self.held_at[tp] = record.offset
        if self.on_held is not None:
            self.on_held()
        log.warning(
            "a label dated on a day to come waits for it: %s[%d]@%d label_ts=%s clock=%s terminal=%r; it and "
            "the labels after it on the partition are folded from that day on (folded now, it would push "
            "the terminal's oldest day of reports out of its 30-day windows)",
            record.topic, record.partition, record.offset, format_ts(label.label_ts_us), format_ts(now_us),
            label.terminal_id,
        )  # fmt: skip

    def _release(self, now_us: int) -> None:
        """Fetch again the partitions that wait for a day that has come."""
        due = [tp for tp, (_, day) in self.held.items() if day <= now_us // DAY_US]
        if not due:
            return
        self.consumer.resume(*due)
        for tp in due:
            offset, _ = self.held.pop(tp)
            log.info(
                "labels from %s[%d]@%d on are read again: their day has come", tp.topic, tp.partition, offset
            )

    def _deltas(self, records, session: bytes | None, out: FeedRead, now_us: int) -> None:
        first, last = self.limits.days(now_us)
        days = (first, last + 1)  # the instance that wrote it may run a little ahead of this one's clock
        for record in records:
            if session is not None and record.key == session:
                continue  # this instance folded those events as it scored them
            where = f"{record.topic}[{record.partition}]@{record.offset}"
            try:
                out.deltas.append(decode_deltas(where, record.value or b"", days, self.limits))
                out.delta_records.append(record)
            except MessageError as error:  # its events are missing from the terminal counts from now on
                log.warning("skipped a terminal delta record error=%s", error)
                out.bad.append((record, error))


def _shown_ts(ts_us: int) -> str:
    """format_ts, or the milliseconds since the epoch of a time it cannot print (past year 9999): a record's
    timestamp is any long its producer chose (a label_ts is before 2100, a reader's clock is printable)."""
    try:
        return format_ts(ts_us)
    except (ValueError, OverflowError, OSError):
        return f"{ts_us // 1000} ms since the epoch"


def label_batch(labels: list[Label]) -> LabelBatch:
    n = len(labels)
    return LabelBatch(
        terminal_ids=[label.terminal_id for label in labels],
        label_ts_us=np.fromiter((label.label_ts_us for label in labels), dtype=np.int64, count=n),
        is_fraud=np.fromiter((label.is_fraud for label in labels), dtype=bool, count=n),
        event_ids=[label.event_id for label in labels],
        account_ids=[label.account_id for label in labels],
    )
