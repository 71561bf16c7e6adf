"""BatchScorer.fold_feed: labels and other instances' deltas are read every terminal_feed_interval_ms, not
before every batch (each read costs a broker round trip). The feed is a stand-in that counts its reads; the
reads against the real broker: tests/integration/test_service_labels.py.

And what a batch writes for hostile input, with a real scorer: dead letters with their reasons, a record
written again under its account's key, and the last resort that scores one event at a time."""

import dataclasses
import json
import struct
import time
import zlib
from collections import namedtuple
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kafka.partitioner.default import DefaultPartitioner, murmur2
from kafka.structs import TopicPartition

from consumers.runtime.key_partition import key_partition
from consumers.runtime.settings import load_serve_config
from consumers.scoring.account_state import decode_account_record
from consumers.scoring.messages import Transaction, encode_transaction, format_ts
from consumers.scoring.scorer import Scorer
from consumers.service import batch_scoring
from consumers.service.batch_scoring import BatchScorer
from consumers.service.dormant import DormantStates
from consumers.terminals.deltas import decode_deltas
from consumers.terminals.feed import FeedRead
from models.registry import build_detector
from pipeline.features.definitions import FEATURE_NAMES
from pipeline.features.spec import FeatureSpec
from pipeline.features.stream import StreamingFeaturizer
from pipeline.features.stream_batches import TerminalOp
from pipeline.registry.artifact import LoadedModel


class CountingFeed:
    def __init__(self):
        self.reads = []

    def read(self, session):
        self.reads.append(session)
        return FeedRead(deltas=[TerminalOp("events", ["t1"], np.array([3], dtype=np.int64))])


def batch_scorer(interval_ms: int) -> tuple[BatchScorer, CountingFeed, StreamingFeaturizer]:
    cfg = load_serve_config(None, overrides={"terminal_feed_interval_ms": interval_ms}, env={})
    featurizer, feed = StreamingFeaturizer(), CountingFeed()
    scorer = SimpleNamespace(featurizer=featurizer)
    batches = BatchScorer(cfg, scorer, feed, "1", True, dormant=None, read_states=None)
    batches.session = b"me/1"
    return batches, feed, featurizer


def test_the_feed_is_read_at_most_once_an_interval_and_what_it_brings_is_folded(monkeypatch):
    batches, feed, featurizer = batch_scorer(interval_ms=250)
    clock = iter([100.0, 100.1, 100.2, 100.26, 100.3])
    monkeypatch.setattr(batch_scoring.time, "monotonic", lambda: next(clock))
    folded = [batches.fold_feed() for _ in range(5)]
    assert folded == [(0, 1), (0, 0), (0, 0), (0, 1), (0, 0)]
    assert feed.reads == [b"me/1", b"me/1"]  # this instance's own deltas are left out by its session
    assert "t1" in featurizer.terminals


def test_an_interval_of_zero_reads_before_every_batch():
    batches, feed, _ = batch_scorer(interval_ms=0)
    assert [batches.fold_feed() for _ in range(3)] == [(0, 1)] * 3 and len(feed.reads) == 3


class FloodFeed:
    """Other instances' deltas, each at 7 terminals never seen before."""

    def __init__(self):
        self.sent = 0

    def read(self, session):
        terminals = [f"flood-{self.sent + i}" for i in range(7)]
        self.sent += len(terminals)
        return FeedRead(deltas=[TerminalOp("events", terminals, np.full(7, 20_000, dtype=np.int64))])


def test_what_the_feed_brings_past_the_cap_goes_as_soon_as_it_is_folded():
    cfg = load_serve_config(
        None, overrides={"terminal_feed_interval_ms": 0, "max_terminals_in_memory": 10}, env={}
    )
    featurizer = StreamingFeaturizer()
    batches = BatchScorer(cfg, SimpleNamespace(featurizer=featurizer), FloodFeed(), "1", True, None, None)
    held = []
    for _ in range(5):
        batches.fold_feed()
        held.append(len(featurizer.terminals))
    assert held == [7, 9, 9, 9, 9] and batches.eviction.capped == 35 - 9


# -- what a batch writes for hostile input, with a real scorer ---------------------------------------------

Record = namedtuple("Record", "topic partition offset key value timestamp")
HOUR_US = 3_600_000_000
MAGIC_AMOUNT = 666.0  # the faulty detector below fails on it: a fault nobody foresaw


def tiny_scorer() -> Scorer:
    n = len(FEATURE_NAMES)
    torch.manual_seed(0)
    detector = build_detector("lstm", {"num_features": n, "d_model": 8, "num_layers": 1, "dropout": 0.0})
    return Scorer(LoadedModel(detector=detector, spec=FeatureSpec(mean=(0.0,) * n, std=(1.0,) * n)))


def make_faulty(scorer: Scorer) -> None:
    """The store's step fails AFTER it has stepped (the states are changed) when an event's log amount
    feature is MAGIC_AMOUNT's: the rollback must undo the featurizer and the detector alike."""
    step = scorer.store.step

    def faulty(rows, x):
        logits = step(rows, x)
        if torch.isclose(x[:, 0].double(), torch.tensor(np.log1p(MAGIC_AMOUNT))).any():
            raise IndexError("a fault nobody foresaw")
        return logits

    scorer.store.step = faulty


class EmptyFeed:
    def read(self, session):
        return FeedRead()


def hostile_batch_scorer(scorer: Scorer, partitions: int | None = None, **settings) -> BatchScorer:
    cfg = load_serve_config(None, overrides={"topic_prefix": "p-", **settings}, env={})
    batches = BatchScorer(
        cfg, scorer, EmptyFeed(), "1", True, DormantStates(1_000), read_states=lambda wanted: {},
        partitions=partitions,
    )  # fmt: skip
    batches.session = b"me/1"
    scorer.featurizer.terminal_journal = []  # as the service's terminal restore leaves it
    return batches


def tx_value(event_id: str, account: str, ts_us: int, amount: float = 10.0, terminal: str = "T1") -> bytes:
    return encode_transaction(Transaction(event_id, account, ts_us, amount, terminal))


def polled(
    values: list[tuple[bytes | None, bytes | None]], offsets: list[int] | None = None, partition: int = 0
) -> dict:
    tp = TopicPartition("p-transactions", partition)
    offsets = range(len(values)) if offsets is None else offsets
    return {
        tp: [
            Record(tp.topic, partition, o, key, value, 0)
            for o, (key, value) in zip(offsets, values, strict=True)
        ]
    }


def dead_letters(out) -> dict[int, str]:
    return {
        json.loads(value)["source_offset"]: json.loads(value)["reason"]
        for topic, _, value, _ in out.records
        if topic == "p-dead-letter"
    }


def test_hostile_records_become_dead_letters_with_their_reasons_and_the_rest_is_scored():
    now = time.time_ns() // 1000
    start = now - 10 * HOUR_US
    batch = polled(
        [
            (b"A1", tx_value("E1", "A1", start)),
            (b"A2", tx_value("E2", "A2", start + 1)),
            (b"A9", tx_value("E3", "A1", start + 2)),  # key of another account
            (None, tx_value("E4", "A1", start + 3)),  # no key
            (b"A1", tx_value("E1", "A1", start + 4)),  # E1 again at another offset: a producer's retry
            (b"A1", tx_value("E5", "A1", now + 2 * HOUR_US)),  # from the future
            (b"A1", tx_value("E6", "A1", start + 5, amount=1e12)),  # above max_amount
            (b"A1", b'{"event_id":' * 5_000),  # nested beyond any parser's patience
            (b"\xff\xfe", None),  # a tombstone, with a key that is not UTF-8
            (b"A2", tx_value("E7", "A2", start + 6)),
        ]
    )
    out = hostile_batch_scorer(tiny_scorer()).score(batch)
    reasons = dead_letters(out)
    assert sorted(reasons) == [2, 3, 4, 5, 6, 7, 8]
    assert "record key b'A9' is not the body's account_id 'A1'" in reasons[2]
    assert "record key missing" in reasons[3]
    assert "event_id 'E1' was applied already to account 'A1'" in reasons[4]
    assert "in the future" in reasons[5] and "above max_amount" in reasons[6]
    assert "JSON nested 5000 deep" in reasons[7] and "null value" in reasons[8]
    scored = [json.loads(v)["event_id"] for t, _, v, _ in out.records if t == "p-scores"]
    assert scored == ["E1", "E2", "E7"]
    assert (out.scored, out.dead_lettered, out.replays_dropped, out.events) == (3, 7, 1, 10)
    assert {k for t, k, _, _ in out.records if t == "p-account-state-changelog"} == {"A1", "A2"}


def test_a_record_under_another_key_is_written_again_under_its_accounts_key_when_so_set():
    now = time.time_ns() // 1000
    value = tx_value("E1", "A1", now - HOUR_US)
    out = hostile_batch_scorer(tiny_scorer(), key_mismatch="rekey").score(polled([(b"A9", value)]))
    assert out.records == [("p-transactions", "A1", value, None)]  # to the partition A1's key picks
    assert (out.rekeyed, out.scored, out.dead_lettered) == (1, 0, 0)
    assert out.offsets  # the original's offset is consumed with the batch


def test_a_record_off_its_keys_partition_is_refused_by_the_producers_rule_and_a_rekeyed_one_sent_home():
    now = time.time_ns() // 1000
    value = tx_value("E1", "A1", now - HOUR_US)
    home = (murmur2(b"A1") & 0x7FFFFFFF) % 4
    away = (home + 1) % 4
    out = hostile_batch_scorer(tiny_scorer(), partitions=4).score(polled([(b"A1", value)], partition=away))
    assert (out.scored, out.dead_lettered) == (0, 1)
    assert (
        f"record on partition {away}, but its key b'A1' belongs on partition {home}" in dead_letters(out)[0]
    )
    out = hostile_batch_scorer(tiny_scorer(), partitions=4).score(polled([(b"A1", value)], partition=home))
    assert (out.scored, out.dead_lettered) == (1, 0)

    rekeying = hostile_batch_scorer(tiny_scorer(), partitions=4, key_mismatch="rekey")
    out = rekeying.score(polled([(b"A9", value)], partition=away))  # another key: to A1's partition
    assert out.records == [("p-transactions", "A1", value, home)] and out.rekeyed == 1
    # Its own key, elsewhere: never sent again, which could only loop between instances of other rules.
    out = rekeying.score(polled([(b"A1", value)], partition=away))
    assert (out.rekeyed, out.dead_lettered) == (0, 1) and "Send it by its key" in dead_letters(out)[0]

    crc32_home = zlib.crc32(b"A1") % 4
    crc32 = hostile_batch_scorer(tiny_scorer(), partitions=4, producer_partitioner="crc32")
    assert crc32.score(polled([(b"A1", value)], partition=crc32_home)).scored == 1
    unchecked = hostile_batch_scorer(tiny_scorer(), partitions=4, producer_partitioner="unchecked")
    assert unchecked.score(polled([(b"A1", value)], partition=away)).scored == 1
    with pytest.raises(ValueError, match="'p-transactions' has 0 partitions"):
        hostile_batch_scorer(tiny_scorer(), partitions=0)


def test_a_dormant_accounts_corrupt_record_read_back_is_left_out_and_its_event_scored_from_no_history():
    now = time.time_ns() // 1000
    first, second = tx_value("E1", "A1", now - 2 * HOUR_US), tx_value("E2", "A1", now - HOUR_US)
    source = hostile_batch_scorer(tiny_scorer())
    source.score(polled([(b"A1", first)]))
    record = decode_account_record(source.scorer.account_state_bytes("A1"))
    corrupt = dataclasses.replace(record, detector=record.detector[:-4] + struct.pack("<f", float("nan")))

    batches = hostile_batch_scorer(tiny_scorer())
    batches.read_states = lambda wanted: {"A1": corrupt.to_bytes()}
    batches.dormant.restored({"A1": (0, 0)}, [], 0)  # A1 is dormant: its record is read back first
    out = batches.score(polled([(b"A1", second)], offsets=[1]))
    assert (out.reloaded, out.states_discarded, out.scored, out.dead_lettered) == (1, 1, 1, 0)
    fresh = hostile_batch_scorer(tiny_scorer()).score(polled([(b"A1", second)], offsets=[1]))
    assert [v for t, _, v, _ in out.records if t == "p-scores"] == [
        v for t, _, v, _ in fresh.records if t == "p-scores"
    ]  # scored as an account with no history


def test_the_murmur2_rule_is_the_kafka_clients_default_partitioner():
    partitions = set(range(7))
    cluster = SimpleNamespace(
        topics=lambda: {"t"},
        partitions_for_topic=lambda t: partitions,
        available_partitions_for_topic=lambda t: [],
    )
    home = key_partition("murmur2", len(partitions))
    for key in [b"A1", b"account-000042", "k\u00e9y".encode(), b"\x00\xff" * 40]:
        assert home(key) == DefaultPartitioner().partition("t", key, key, None, None, cluster)


def test_an_unknown_producer_partitioner_is_refused_with_the_rules_there_are():
    with pytest.raises(ValueError, match=r"producer_partitioner = 'fnv'.*'murmur2'.*'crc32'.*'unchecked'"):
        load_serve_config(None, overrides={"producer_partitioner": "fnv"}, env={})


def test_a_batch_at_more_new_terminals_than_the_cap_is_scored_whole_and_leaves_the_mark_held():
    start = time.time_ns() // 1000 - 10 * HOUR_US
    values = [
        (f"A{i}".encode(), tx_value(f"E{i}", f"A{i}", start + i, terminal=f"T-{i:02d}")) for i in range(30)
    ]
    scorer = tiny_scorer()
    batches = hostile_batch_scorer(scorer, max_terminals_in_memory=10)
    out = batches.score(polled(values))
    assert (out.scored, out.dead_lettered) == (30, 0)
    assert len(scorer.featurizer.terminals) == 9 and batches.eviction.capped == 21
    # The batch's delta still counts every event, for the other instances and the table writer.
    (delta,) = [value for topic, _, value, _ in out.records if topic == "p-terminal-deltas"]
    assert sorted(decode_deltas("test", delta).terminals) == [f"T-{i:02d}" for i in range(30)]


def test_carefully_the_event_that_fails_alone_is_dead_lettered_and_the_rest_goes_on_as_if_it_never_came():
    now = time.time_ns() // 1000
    start = now - 10 * HOUR_US
    events = [("E1", "A1", 10.0), ("E2", "A2", 20.0), ("E3", "A1", MAGIC_AMOUNT), ("E4", "A1", 30.0)]
    events += [("E5", "A3", MAGIC_AMOUNT), ("E6", "A2", 40.0)]
    values = [(a.encode(), tx_value(e, a, start + i, m)) for i, (e, a, m) in enumerate(events)]

    faulty = tiny_scorer()
    make_faulty(faulty)
    with pytest.raises(IndexError, match="nobody foresaw"):
        hostile_batch_scorer(faulty).score(polled(values))  # the whole batch fails; the service rewinds

    faulty = tiny_scorer()
    make_faulty(faulty)
    out = hostile_batch_scorer(faulty).score(polled(values), careful=True)
    assert out.careful and dead_letters(out) == {
        2: "scoring failed: IndexError('a fault nobody foresaw')",
        4: "scoring failed: IndexError('a fault nobody foresaw')",
    }
    clean = tiny_scorer()  # never saw the two; one event at a time too (a batched step rounds otherwise)
    kept = [i for i in range(len(values)) if i not in (2, 4)]
    expected = hostile_batch_scorer(clean).score(polled([values[i] for i in kept], kept), careful=True)

    def outputs(batch_out, topic):
        return [(k, v) for t, k, v, _ in batch_out.records if t == topic]

    assert outputs(out, "p-scores") == outputs(expected, "p-scores")
    states = dict(outputs(out, "p-account-state-changelog"))  # the latest record of each account
    assert states == dict(outputs(expected, "p-account-state-changelog"))
    assert "A3" not in faulty.accounts_in_memory  # the failed event's new account is gone with it
    assert faulty.featurizer.terminals.get_bytes("T1") == clean.featurizer.terminals.get_bytes("T1")
    assert (out.scored, out.dead_lettered) == (4, 2)


def test_an_event_ahead_of_the_clock_is_featurized_as_of_the_clock(monkeypatch):
    # At 23:30 UTC an event stamped 00:20 tomorrow (clock skew, within max_ts_skew_s) at a busy terminal:
    # were it counted on tomorrow, every other event at that terminal until midnight would read its
    # windows as ending tomorrow. It scores as if stamped at today's last microsecond, and keeps its own ts
    # in the output.
    clock = 20_000 * 86_400_000_000 + 23 * HOUR_US + HOUR_US // 2
    monkeypatch.setattr(
        batch_scoring, "time", SimpleNamespace(time_ns=lambda: clock * 1000, monotonic=time.monotonic)
    )
    busy = [(f"A{i}".encode(), tx_value(f"E{i}", f"A{i}", clock - HOUR_US + i)) for i in range(20)]
    victim = (b"V", tx_value("EV", "V", clock + 60_000_000))

    def scores(stamped_us: int) -> dict[str, dict]:
        batches = hostile_batch_scorer(tiny_scorer())
        outs = [batches.score(polled(busy))]
        outs.append(batches.score(polled([(b"P", tx_value("EP", "P", stamped_us))], [20])))
        outs.append(batches.score(polled([victim], [21])))
        records = [json.loads(v) for out in outs for t, _, v, _ in out.records if t == "p-scores"]
        return {record["event_id"]: record for record in records}

    ahead = clock + 50 * 60_000_000  # 00:20 tomorrow
    last_of_today = clock + HOUR_US // 2 - 1
    skewed, today = scores(ahead), scores(last_of_today)
    assert skewed["EV"]["score"] == today["EV"]["score"]
    assert skewed["EP"]["score"] == today["EP"]["score"]
    assert skewed["EP"]["ts"] == format_ts(ahead)  # its own ts, 00:20 tomorrow


def fitted_hybrid_scorer(threshold: float) -> Scorer:
    from tests.models.test_hybrid import fitted_hybrid  # trees fitted over a tiny base's scores

    n = len(FEATURE_NAMES)
    spec = FeatureSpec(mean=(0.0,) * n, std=(1.0,) * n)
    return Scorer(
        LoadedModel(detector=fitted_hybrid(terminal_buckets=spec.terminal_buckets).float(), spec=spec),
        threshold,
    )


def alert_messages(out) -> list[dict]:
    return [json.loads(v) for t, _, v, _ in out.records if t == "p-alerts"]


def test_a_fitted_hybrids_alerts_go_out_with_their_reasons_and_nothing_is_dead_lettered():
    start = time.time_ns() // 1000 - 10 * HOUR_US
    values = [(b"A%d" % (i % 3), tx_value(f"E{i}", f"A{i % 3}", start + i, 10.0 + 7 * i)) for i in range(12)]
    scorer = fitted_hybrid_scorer(threshold=0.0)  # every event alerts
    out = hostile_batch_scorer(scorer).score(polled(values))
    assert dead_letters(out) == {} and (out.scored, out.alerts, out.careful) == (12, 12, 0)
    alerts = alert_messages(out)
    assert [a["event_id"] for a in alerts] == [f"E{i}" for i in range(12)]
    assert all("reasons" in a and a["history"]["input"] == "history" for a in alerts)
    assert scorer.stats.reasons_failed == 0


def test_an_explainer_that_raises_costs_no_alert_and_no_dead_letter():
    start = time.time_ns() // 1000 - 10 * HOUR_US
    values = [(b"A%d" % (i % 3), tx_value(f"E{i}", f"A{i % 3}", start + i)) for i in range(6)]
    scorer = tiny_scorer()
    scorer.threshold = 0.0  # every event alerts

    def broken(*args):
        raise RuntimeError("a fault nobody foresaw, in the reasons")

    scorer.explainer.explain = broken
    out = hostile_batch_scorer(scorer).score(polled(values))
    assert dead_letters(out) == {} and (out.scored, out.alerts, out.careful) == (6, 6, 0)
    alerts = alert_messages(out)
    assert [a["event_id"] for a in alerts] == [f"E{i}" for i in range(6)]
    assert not any("reasons" in a for a in alerts)
    assert scorer.stats.reasons_failed == 6


def test_past_max_accounts_kept_a_batch_deletes_the_oldest_dormant_accounts_and_one_returning_starts_anew():
    now = time.time_ns() // 1000
    first = polled([(b"N1", tx_value("E1", "N1", now - 2 * HOUR_US))])
    then = polled([(b"D0", tx_value("E2", "D0", now - HOUR_US))], offsets=[1])
    batches = hostile_batch_scorer(tiny_scorer())
    batches.dormant = DormantStates(capacity=2, max_accounts=4)
    batches.dormant.restored({f"D{i}": (i % 2, i) for i in range(6)}, [], 0)  # dormant, oldest first

    def read_states(wanted):
        assert not {"D0", "D1"} & set(wanted), "an account let go is never read back"
        return {}

    batches.read_states = read_states
    out = batches.score(first)
    tombstones = [(topic, key, partition) for topic, key, value, partition in out.records if value is None]
    cl = batches.changelog
    assert (
        tombstones == [(cl, "D0", 0), (cl, "D1", 1)] and out.accounts_let_go == 2
    )  # 6 -> 4, in its transaction
    back = batches.score(then)
    reference = hostile_batch_scorer(tiny_scorer())  # the same events, D0 never seen
    reference.score(first)
    fresh = reference.score(then)
    assert back.reloaded == 0 and [v for t, _, v, _ in back.records if t == "p-scores"] == [
        v for t, _, v, _ in fresh.records if t == "p-scores"
    ]  # scored as an account with no history
