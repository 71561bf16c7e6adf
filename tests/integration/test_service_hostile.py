"""Hostile input against the real broker, the acceptance test of docs/operations.md#dead-letters: about
20,000 good events and their labels with every kind of poison of tests/integration/poison_corpus.py mixed in,
served twice: once with the poison, once without it (the same stream minus the poison records).

With the poison, the service must stay up; every poison record must land in `dead-letter` once, with its
reason, its key and its original bytes; every good event must be scored exactly once with a finite score.
And the poison must leave no trace: every account ends in the state the run without it left it in, and
the terminal table is the same, byte for byte.

Three partitions, and each terminal is used from one partition only (its id names the partition): a
terminal's counts then follow one partition's order, which Kafka keeps, and not the interleaving of the
partitions within a batch, which is timing. The labels are on `labels` before the service starts, so both
runs fold them all before their first event.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import random
import time
from hashlib import sha256
from typing import NamedTuple

import numpy as np
import polars as pl
import pytest
import torch
from kafka import KafkaProducer
from kafka.partitioner.default import murmur2

from consumers.runtime.compacted import Reader
from consumers.runtime.metrics import free_port, scrape
from consumers.scoring.account_state import decode_account_record
from consumers.scoring.messages import (
    Label,
    decode_transaction,
    encode_label,
    encode_transaction,
    transactions_from_frame,
)
from consumers.terminals.table import read_table
from models.state_codec import decode_account_state
from pipeline.data.generate import GenerateConfig, generate
from pipeline.features.definitions import terminal_bucket
from pipeline.features.state import ACCOUNT_STATE
from pipeline.registry.tracking import load_model
from tests.integration.poison_corpus import Poison, label_poison, transaction_poison, valid_extremes
from tests.integration.service_helpers import (
    Running,
    assert_exactly_once,
    create_topic,
    prefixed_configs,
    read_committed,
    save_tiny_model,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(600)]

PARTITIONS = 3
DAY_US = 86_400_000_000
# Sums the featurizer adds a batch's amounts into at once (per account and day): their last bits follow the
# batch boundaries, which are timing; every other field of an account's features is exact whatever they are.
BATCH_ROUNDED = {"day_amount"}
# The recurrent state: steps over batches of other sizes round differently in the last bits of float32.
DETECTOR_ATOL = 1e-5


class Entry(NamedTuple):
    key: bytes | None
    value: bytes | None
    poison: Poison | None  # None: a good record


class Outcome(NamedTuple):
    scores: list[dict]
    letters: list  # the dead-letter topic's records
    states: dict[str, bytes]  # account -> its latest changelog record
    terminals: dict[str, bytes]  # terminal -> its terminal table record
    stats: object  # ServeStats
    placed: list[tuple[int, int]]  # (partition, offset) of each entry of the transactions stream
    placed_labels: list[tuple[int, int]]


def partition_of(key: bytes) -> int:
    """The partition kafka-python's default partitioner gives `key`, as a producer sending by key does."""
    return (murmur2(key) & 0x7FFFFFFF) % PARTITIONS


@pytest.fixture(scope="module")
def frame() -> pl.DataFrame:
    frame = generate(GenerateConfig(accounts=350, days=30, seed=13)).sort("ts", "event_id")
    part = {a: str(partition_of(a.encode())) for a in frame["account_id"].unique().to_list()}
    local = pl.col("terminal_id") + "@p" + pl.col("account_id").replace_strict(part, return_dtype=pl.String)
    frame = frame.with_columns(local.alias("terminal_id"))
    assert 19_000 <= frame.height <= 23_000 and frame["is_fraud"].sum() > 100, frame.height
    return frame


def labels_of(frame: pl.DataFrame) -> list[Label]:
    """The fraud labels, at their label_ts, and every 40th genuine event cleared two days after it."""
    fraud = frame.filter(pl.col("is_fraud") & pl.col("label_ts").is_not_null())
    genuine = frame.filter(~pl.col("is_fraud")).gather_every(40)
    return [
        Label(r["event_id"], r["account_id"], r["terminal_id"], True, int(r["label_ts"].timestamp() * 1e6))
        for r in fraud.iter_rows(named=True)
    ] + [
        Label(r["event_id"], r["account_id"], r["terminal_id"], False, int(r["ts"].timestamp() * 1e6) + 2 * DAY_US)
        for r in genuine.iter_rows(named=True)
    ]  # fmt: skip


def mixed(good: list[tuple[bytes, bytes]], poison: list[Poison], rng: random.Random) -> list[Entry]:
    """The good records in order, each poison record at a random place, or right behind the event it
    replays (found by its event_id)."""
    stream = [Entry(key, value, None) for key, value in good]
    for p in (p for p in poison if p.follows is None):
        stream.insert(rng.randrange(len(stream) + 1), Entry(p.key, p.value, p))
    for p in (p for p in poison if p.follows is not None):
        mark = f'"event_id":"{p.follows}"'.encode()
        at = next(i for i, e in enumerate(stream) if e.poison is None and e.value and mark in e.value)
        stream.insert(at + 1, Entry(p.key, p.value, p))
    return stream


def send_all(bootstrap: str, topic: str, entries: list[Entry]) -> list[tuple[int, int]]:
    """Produce the entries in order, by key; the (partition, offset) of each."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    try:
        futures = [producer.send(topic, key=e.key, value=e.value, partition=_by_hand(e)) for e in entries]
        producer.flush()
        return [(f.get().partition, f.get().offset) for f in futures]
    finally:
        producer.close()


def _by_hand(entry: Entry) -> int | None:
    """The partition a poison record with a shift is sent to; None: by its key."""
    shift = 0 if entry.poison is None else entry.poison.shift
    return (partition_of(entry.key) + shift) % PARTITIONS if shift else None


def serve_stream(bootstrap, cfg, model, stream: list[Entry], label_stream: list[Entry]) -> Outcome:
    """Labels first, then half the stream, the service, the other half while it runs; until every good event
    is scored and every poison transaction dead-lettered, then stopped (its table writer flushes, and
    dead-letters the bad labels, on the way out)."""
    create_topic(bootstrap, cfg.topic("transactions"), partitions=PARTITIONS)
    create_topic(bootstrap, cfg.topic("labels"), partitions=PARTITIONS)
    placed_labels = send_all(bootstrap, cfg.topic("labels"), label_stream)
    half = len(stream) // 2
    placed = send_all(bootstrap, cfg.topic("transactions"), stream[:half])
    running = Running(cfg, model, bootstrap)
    placed += send_all(bootstrap, cfg.topic("transactions"), stream[half:])
    good, bad = sum(e.poison is None for e in stream), sum(e.poison is not None for e in stream)
    deadline = time.monotonic() + 300
    while True:
        assert running.error is None and running.thread.is_alive(), (
            f"hostile input stopped the service: {running.error!r}"
        )
        try:
            scored = scrape(cfg.metrics_port, "txsentinel_events_scored_total")
        except OSError:  # the metrics server is not up yet
            scored = 0
        if scored >= good:
            letters = [json.loads(r.value) for r in read_committed(bootstrap, cfg.topic("dead_letter"))]
            if sum(d["source_topic"] == cfg.topic("transactions") for d in letters) >= bad:
                break
        assert time.monotonic() < deadline, f"{scored} of {good} events scored within 300 s"
        time.sleep(0.5)
    stats = running.stop()
    changelog = read_committed(bootstrap, cfg.topic("changelog"))
    reader = Reader.connect(bootstrap, "hostile-test-table")
    try:
        table = read_table(
            reader, cfg.topic("terminal_table"), cfg.topic("labels"), cfg.topic("terminal_deltas"), 30
        ).terminals
    finally:
        reader.close()
    return Outcome(
        scores=[json.loads(r.value) for r in read_committed(bootstrap, cfg.topic("scores"))],
        letters=read_committed(bootstrap, cfg.topic("dead_letter")),
        states={r.key.decode(): r.value for r in changelog},  # in offset order: the last record wins
        terminals={t: table.get_bytes(t) for t in table},
        stats=stats,
        placed=placed,
        placed_labels=placed_labels,
    )  # fmt: skip


def faulty_model(model_dir: str, fault_bucket: int):
    """The model, with a detector whose step fails for events at `fault_bucket`'s terminal, after it has
    changed the states: a bug nobody foresaw, which only the last resort can get past."""
    model = load_model(model_dir)
    step = model.detector.step_in_place

    def step_in_place(x, table, rows):
        out = step(x, table, rows)
        if (x[:, -1] == fault_bucket).any():  # the terminal bucket column
            raise RuntimeError("injected fault: a detector bug nobody foresaw")
        return out

    model.detector.step_in_place = step_in_place
    return model


def test_poison_of_every_kind_is_dead_lettered_and_leaves_no_trace(kafka_bootstrap, frame, tmp_path):
    started = time.monotonic()
    now_us = time.time_ns() // 1000
    txs = transactions_from_frame(frame)
    buckets = set(terminal_bucket(t.terminal_id for t in txs).tolist())
    fault_terminal = next(
        f"T-FAULT-{i}" for i in range(10_000) if terminal_bucket([f"T-FAULT-{i}"])[0] not in buckets
    )
    base = txs[len(txs) // 3]
    later = [t for t in txs if t.account_id == base.account_id and t.ts_us > base.ts_us][3]
    other = next(t for t in txs if t.account_id != base.account_id)
    poison = transaction_poison(base, later, other, fault_terminal, now_us)
    labels = labels_of(frame)
    bad_labels = label_poison(labels[0], now_us)
    assert len({p.kind for p in poison + bad_labels}) == len(poison) + len(bad_labels) >= 30

    rng = random.Random(7)
    good = [(t.account_id.encode(), encode_transaction(t)) for t in txs]
    for extreme in valid_extremes(txs[0], now_us):  # at the edge of valid: scored like the rest
        good.insert(rng.randrange(len(good)), extreme)
    events = [decode_transaction(value, now_us=now_us) for _, value in good]
    stream = mixed(good, poison, rng)
    label_stream = mixed([(x.account_id.encode(), encode_label(x)) for x in labels], bad_labels, rng)
    clean, clean_labels = (
        [e for e in stream if e.poison is None],
        [e for e in label_stream if e.poison is None],
    )

    model_dir = save_tiny_model(frame, 10, tmp_path / "model", "hostile")
    settings = {"poll_timeout_ms": 200, "max_poll_records": 500, "terminal_table_flush_s": 1.0}
    with prefixed_configs(kafka_bootstrap, "hostile", **settings) as make:
        cfg = make(metrics_port=free_port())
        fault = terminal_bucket([fault_terminal])[0]
        hostile = serve_stream(kafka_bootstrap, cfg, faulty_model(model_dir, fault), stream, label_stream)
    with prefixed_configs(kafka_bootstrap, "hostile-clean", **settings) as make:
        plain = serve_stream(
            kafka_bootstrap, make(metrics_port=free_port()), load_model(model_dir), clean, clean_labels
        )
    print(f"{len(events)} good events, {len(stream) - len(clean)} + {len(bad_labels)} poison records, "
          f"{len(clean_labels)} labels: both runs in {time.monotonic() - started:.0f} s")  # fmt: skip

    # Every good event scored exactly once (the replays too: never twice), with a finite score.
    by_event = assert_exactly_once(hostile.scores, events)
    assert all(math.isfinite(s["score"]) and 0.0 <= s["score"] <= 1.0 for s in by_event.values())
    assert_exactly_once(plain.scores, events)

    # Every poison record in dead-letter once, with its reason, its key and its bytes; no good record there.
    dead = {}
    for record in hostile.letters:
        letter = json.loads(record.value)
        where = (letter["source_topic"], letter["source_partition"], letter["source_offset"])
        assert where not in dead, f"{where} was dead-lettered twice"
        dead[where] = (record.key, letter)
    expected = {
        (topic, *where): entry.poison
        for topic, entries, places in (
            (cfg.topic("transactions"), stream, hostile.placed),
            (cfg.topic("labels"), label_stream, hostile.placed_labels),
        )
        for entry, where in zip(entries, places, strict=True)
        if entry.poison is not None
    }
    assert set(dead) == set(expected), (
        f"not dead-lettered: {sorted(p.kind for w, p in expected.items() if w not in dead)}; "
        f"dead-lettered but good: {[dead[w][1]['reason'] for w in set(dead) - set(expected)]}"
    )
    for where, p in expected.items():
        key, letter = dead[where]
        assert p.reason in letter["reason"], (p.kind, p.what, letter["reason"])
        original = None if letter["value_base64"] is None else base64.b64decode(letter["value_base64"])
        for field, whole, part in (("value", p.value, original), ("key", p.key, key)):
            if letter.get(f"{field}_truncated"):  # too big to carry whole: its start, length and hash
                assert letter[f"{field}_bytes"] == len(whole), p.kind
                assert letter[f"{field}_sha256"] == sha256(whole).hexdigest(), p.kind
                assert part == whole[: len(part)] and len(part) < len(whole), p.kind
        original = p.value if letter.get("value_truncated") else original
        key = p.key if letter.get("key_truncated") else key
        assert (original, key) == (p.value, p.key), f"{p.kind}: not its original bytes and key"
    assert plain.letters == []

    # The poison left no trace: the run without it ends in the same states.
    assert sorted(hostile.states) == sorted(plain.states) == sorted({e.account_id for e in events})
    detector = load_model(model_dir).detector
    worst = max(assert_same_state(a, hostile.states[a], plain.states[a], detector) for a in plain.states)
    identical = sum(same_bytes(a, hostile.states[a], plain.states[a]) for a in plain.states)
    print(f"{identical} of {len(plain.states)} accounts' states identical to the last bit but for the offset; "
          f"recurrent states differ by at most {worst:.2g} (batch boundaries)")  # fmt: skip
    assert hostile.terminals == plain.terminals  # integer counts: exact, whatever the batches

    stats = hostile.stats
    assert stats.replays_dropped == sum(p.reason == "was applied already" for p in poison)
    assert stats.careful_batches >= 1 and stats.events_scored == len(events)
    assert stats.labels_applied >= len(clean_labels)


def same_bytes(account: str, got: bytes, want: bytes) -> bool:
    """The two records are the same bytes but for the source offset."""
    a, b = decode_account_record(got, account), decode_account_record(want, account)
    return dataclasses.replace(a, offset=0) == dataclasses.replace(b, offset=0)


def assert_same_state(account: str, got: bytes, want: bytes, detector) -> float:
    """Two state records of one account hold the same state: the same history (count, days, terminals
    seen, the last ts, the recent event ids) exactly, and the same sums and recurrent state to within
    rounding where the batch boundaries decide it (BATCH_ROUNDED, DETECTOR_ATOL). The largest difference
    of the recurrent state. The source offsets differ: the poison took offsets of its own."""
    a, b = decode_account_record(got, account), decode_account_record(want, account)
    same = ("model", "partition", "last_ts_us", "recent_ids", "recent_next")
    assert [getattr(a, f) for f in same] == [getattr(b, f) for f in same], account
    fa, fb = np.frombuffer(a.features, ACCOUNT_STATE)[0], np.frombuffer(b.features, ACCOUNT_STATE)[0]
    for name in ACCOUNT_STATE.names:
        if name in BATCH_ROUNDED:
            np.testing.assert_allclose(fa[name], fb[name], rtol=1e-12, err_msg=f"{account}: {name}")
        else:
            np.testing.assert_array_equal(fa[name], fb[name], err_msg=f"{account}: {name}")
    sa, sb = decode_account_state(detector, a.detector), decode_account_state(detector, b.detector)
    assert sa.keys() == sb.keys()
    worst = 0.0
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], atol=DETECTOR_ATOL, rtol=0, msg=f"{account}: {name}")
        worst = max(worst, float((sa[name] - sb[name]).abs().max()))
    return worst
