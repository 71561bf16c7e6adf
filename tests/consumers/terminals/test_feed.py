"""The feed's labels against each reader's clock: a label is refused or kept by its record alone, so every
scorer and the table writer decide alike, and one dated on a day a reader has not reached waits for that day
instead of taking the ring bucket of the terminal's oldest day in its windows. The consumer is a stand-in
over an in-memory log; the feed against the real broker: tests/integration/test_service_labels.py."""

from collections import namedtuple
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
from kafka.structs import TopicPartition

from consumers.scoring.message_limits import MessageLimits
from consumers.scoring.messages import Label, encode_label
from consumers.terminals import feed as feed_module
from consumers.terminals.feed import FeedReader
from consumers.terminals.table import Positions
from pipeline.features import batch
from pipeline.features.stream import StreamingFeaturizer
from pipeline.features.stream_batches import EventBatch, replay_batches

Record = namedtuple("Record", "topic partition offset key value timestamp")
LABELS, DELTAS = TopicPartition("p-labels", 0), TopicPartition("p-terminal-deltas", 0)
SECOND_US, HOUR_US, DAY_US = 1_000_000, 3_600_000_000, 86_400_000_000
DAY = 20_000  # epoch day D of the tests
MIDNIGHT = (DAY + 1) * DAY_US  # the end of day D


class LogConsumer:
    """The feed's consumer over an in-memory log per partition: poll hands out what lies past each unpaused
    partition's position, as KafkaConsumer does; seek, pause and resume as it does."""

    def __init__(self, labels: list[Record]):
        self.log = {LABELS: labels, DELTAS: []}
        self.at = {LABELS: 0, DELTAS: 0}
        self.paused: set[TopicPartition] = set()

    def partitions_for_topic(self, topic):
        return {tp.partition for tp in self.log if tp.topic == topic}

    def assign(self, tps):
        pass

    def poll(self, timeout_ms=0, max_records=500):
        out = {}
        for tp, records in self.log.items():
            room = max_records - sum(len(got) for got in out.values())
            if room > 0 and tp not in self.paused and self.at[tp] < len(records):
                out[tp] = records[self.at[tp] : self.at[tp] + room]
                self.at[tp] += len(out[tp])
        return out

    def position(self, tp):
        return self.at[tp]

    def seek(self, tp, offset):
        self.at[tp] = offset

    def seek_to_beginning(self, *tps):
        for tp in tps:
            self.at[tp] = 0

    def pause(self, *tps):
        self.paused.update(tps)

    def resume(self, *tps):
        self.paused.difference_update(tps)


class Ends:
    """The offsets reader: how far each partition of the log goes."""

    def __init__(self, consumer: LogConsumer):
        self.watermarks = SimpleNamespace(end_offsets=lambda tps: {tp: len(consumer.log[tp]) for tp in tps})


def records(labels: list[Label], sent_us: list[int]) -> list[Record]:
    return [
        Record(LABELS.topic, 0, offset, label.account_id.encode(), encode_label(label), sent // 1000)
        for offset, (label, sent) in enumerate(zip(labels, sent_us, strict=True))
    ]


def reader(log: list[Record], held: list | None = None) -> FeedReader:
    consumer = LogConsumer(log)
    on_held = None if held is None else lambda: held.append(1)
    return FeedReader(
        consumer, Ends(consumer), LABELS.topic, DELTAS.topic, 5.0, MessageLimits(), on_held=on_held
    )


@pytest.fixture
def clock(monkeypatch):
    """The readers' clock, in microseconds: set clock.now."""
    at = SimpleNamespace(now=0)
    fake = SimpleNamespace(time_ns=lambda: at.now * 1000, monotonic=feed_module.time.monotonic)
    monkeypatch.setattr(feed_module, "time", fake)
    return at


# -- a label dated on the next day -------------------------------------------------------------------------


def busy_terminal() -> pl.DataFrame:
    """Terminal T: an event every day at noon from D-29 to D, the first one reported fraud that day."""
    days = range(DAY - 29, DAY + 1)
    return pl.DataFrame(
        {
            "event_id": [f"E{d}" for d in days],
            "account_id": [f"A{d % 7}" for d in days],
            "ts": [d * DAY_US + 12 * HOUR_US for d in days],
            "amount": [20.0] * 30,
            "terminal_id": ["T"] * 30,
            "is_fraud": [d == DAY - 29 for d in days],
            "label_ts": [(d * DAY_US + 13 * HOUR_US) if d == DAY - 29 else None for d in days],
        }
    ).with_columns(pl.col("ts", "label_ts").cast(pl.Datetime("us", "UTC")))


def reports_30d(featurizer: StreamingFeaturizer, account: str, ts_us: int) -> int:
    """terminal_reports_30d of one more event at T (folded into the featurizer, as the service does)."""
    raw = featurizer.raw_aggregates(EventBatch([account], ["T"], np.array([ts_us]), np.array([20.0])))
    return int(raw["terminal_reports_30d"][0])


def test_a_label_dated_tomorrow_waits_for_midnight_and_the_windows_keep_their_oldest_day(clock):
    """At 23:30 on day D a fraud label arrives dated 00:10 tomorrow (its producer's clock runs 40 minutes
    ahead, within max_ts_skew_s). Folded at once it would take the ring bucket of day D-29 ((D+1) % 30) and
    the rest of day D's events would miss D-29's report, which the batch form counts for them. It waits
    until the reader's clock reaches its day, then counts from there on, as in the batch form."""
    history = busy_terminal()
    featurizer = StreamingFeaturizer()
    for events, labels in replay_batches(history, 7):
        featurizer.transform(events, labels)
    ahead = Label(f"E{DAY}", f"A{DAY % 7}", "T", True, MIDNIGHT + 10 * 60 * SECOND_US)
    held = []
    feed = reader(records([ahead], [MIDNIGHT - 30 * 60 * SECOND_US]), held)

    late_today, tomorrow = MIDNIGHT - 15 * 60 * SECOND_US, MIDNIGHT + 20 * 60 * SECOND_US
    clock.now = MIDNIGHT - 30 * 60 * SECOND_US  # 23:30 on day D
    first = feed.read(to_high_watermark=True)
    first.fold_into(featurizer)
    stream_today = reports_30d(featurizer, "V1", late_today)
    clock.now = MIDNIGHT + 5 * 60 * SECOND_US  # 00:05 tomorrow: its day has come
    then = feed.read()
    then.fold_into(featurizer)
    stream_tomorrow = reports_30d(featurizer, "V2", tomorrow)

    labelled = history.with_columns(
        is_fraud=pl.col("is_fraud") | (pl.col("event_id") == ahead.event_id),
        label_ts=pl.when(pl.col("event_id") == ahead.event_id)
        .then(pl.lit(ahead.label_ts_us).cast(pl.Datetime("us", "UTC")))
        .otherwise(pl.col("label_ts")),
    )
    later = pl.DataFrame(
        {
            "event_id": ["V1", "V2"],
            "account_id": ["V1", "V2"],
            "ts": [late_today, tomorrow],
            "amount": [20.0, 20.0],
            "terminal_id": ["T", "T"],
            "is_fraud": [False, False],
            "label_ts": [None, None],
        }
    ).with_columns(pl.col("ts", "label_ts").cast(pl.Datetime("us", "UTC")))
    batch_form = batch.raw_aggregates(pl.concat([labelled, later]).sort("ts", "event_id"))
    # D-29's report still in day D's windows; tomorrow, the label in and D-29 out
    assert (stream_today, stream_tomorrow) == tuple(batch_form["terminal_reports_30d"][-2:]) == (1, 1)
    assert first.labels == [] and first.bad == [] and then.labels == [ahead] and held == [1]
    assert feed.positions().labels == {0: 1}  # and, while it waited, the positions stayed before it


def test_a_held_partition_keeps_its_earlier_labels_and_its_later_ones_wait_with_it(clock):
    clock.now = MIDNIGHT - HOUR_US // 2
    today = [Label(f"E{i}", "A1", "T1", True, clock.now - HOUR_US) for i in range(2)]
    not_fraud = Label("E8", "A1", "T2", False, MIDNIGHT + 10 * 60 * SECOND_US)  # a withdrawal: no wait
    ahead = Label("E9", "A1", "T2", True, MIDNIGHT + 10 * 60 * SECOND_US)
    log = records([today[0], not_fraud, ahead, today[1]], [clock.now] * 4)
    feed = reader(log)

    got = feed.read(to_high_watermark=True)  # no wait for the held partition: read as far as it goes today
    assert got.labels == [today[0], not_fraud] and feed.positions().labels == {0: 2}
    assert feed.read().labels == []  # still waiting: nothing fetched again

    clock.now = MIDNIGHT
    got = feed.read(to_high_watermark=True)
    assert got.labels == [ahead, today[1]] and got.label_records == log[2:]
    assert feed.positions().labels == {0: 4} and feed.held == {}


def test_a_held_label_read_again_after_a_seek_is_counted_once(clock):
    # A scorer's aborted batch seeks the feed back: the same label is held again, and is still one hold.
    clock.now = MIDNIGHT - HOUR_US // 2
    ahead = Label("E9", "A1", "T2", True, MIDNIGHT + 10 * 60 * SECOND_US)
    held = []
    feed = reader(records([ahead], [clock.now]), held)
    for _ in range(3):
        assert feed.read().labels == [] and feed.held
        feed.seek(Positions(labels={0: 0}, deltas={0: 0}))
    assert held == [1]


# -- every reader decides alike ----------------------------------------------------------------------------


@pytest.mark.parametrize("after_sent_s", [3600, 3600.5])
def test_readers_with_clocks_a_second_apart_decide_alike_at_the_bound(clock, after_sent_s):
    """A label max_ts_skew_s (an hour) or a little more after its record's timestamp, read by a scorer and by
    the table writer a second apart: judged by each one's clock, the scorer would refuse what the writer
    folds in, and their terminal counts would differ for good. Judged by the record, both fold it or both
    refuse it."""
    sent = DAY * DAY_US + 10 * HOUR_US
    label = Label("E1", "A1", "T1", True, sent + int(after_sent_s * SECOND_US))
    log = records([label], [sent])
    verdicts, states = [], []
    for clock.now in (sent + SECOND_US // 4, sent + 5 * SECOND_US // 4):  # the scorer's clock, the writer's
        featurizer = StreamingFeaturizer()
        got = reader(log).read(to_high_watermark=True)
        got.fold_into(featurizer)
        verdicts.append(([str(why) for _, why in got.bad], got.labels))
        states.append(featurizer.terminals.get_bytes("T1") if "T1" in featurizer.terminals else None)
    assert verdicts[0] == verdicts[1] and states[0] == states[1]
    if after_sent_s > 3600:
        assert "3600 s after the timestamp of its record" in verdicts[0][0][0]
    else:
        assert verdicts[0] == ([], [label]) and states[0] is not None


def test_a_label_a_day_ahead_of_the_clock_is_refused_rather_than_held_for_days(clock):
    """Only a record timestamped more than a day ahead carries one (forged, or a broken clock the broker
    was set to take): held, it would hold every later label of its partition."""
    clock.now = DAY * DAY_US + 12 * HOUR_US
    forged = clock.now + 3 * DAY_US
    log = records(
        [Label("E1", "A1", "T1", True, forged), Label("E2", "A1", "T1", True, clock.now)], [forged, clock.now]
    )
    held = []
    got = reader(log, held).read(to_high_watermark=True)
    assert [label.event_id for label in got.labels] == ["E2"] and held == []
    assert [record.offset for record, _ in got.bad] == [0]
    assert "more than a day and max_ts_skew_s = 3600 s after this instance's clock" in str(got.bad[0][1])


def test_a_label_refused_for_a_record_timestamped_past_year_9999_names_its_timestamp(clock):
    # The refusal's reason, not a failure of the decoder: datetime cannot print a year past 9999.
    clock.now = DAY * DAY_US + 12 * HOUR_US
    sent_ms = 253_402_300_800_000  # 10000-01-01T00:00:00Z
    log = records([Label("E1", "A1", "T1", True, clock.now + 3 * DAY_US)], [sent_ms * 1000])
    got = reader(log).read(to_high_watermark=True)
    assert got.labels == [] and [record.offset for record, _ in got.bad] == [0]
    why = str(got.bad[0][1])
    assert "more than a day and max_ts_skew_s" in why and f"{sent_ms} ms since the epoch" in why, why


def test_a_label_record_without_a_timestamp_is_refused():
    label = Label("E1", "A1", "T1", True, DAY * DAY_US)
    log = [Record(LABELS.topic, 0, 0, b"A1", encode_label(label), -1)]
    got = reader(log).read(to_high_watermark=True)
    assert got.labels == [] and "the record has no timestamp (-1)" in str(got.bad[0][1])
