"""Hostile input against the real broker: a few thousand good events and their labels, with poison of every
kind docs/operations.md lists mixed in (transactions and labels; decoder, bounds, keys, replays, and a fault
nobody foresaw, injected into the detector). The service must stay up, every poison record must land in
`dead-letter` once with its reason, and every good event must be scored exactly once with a finite score.

Three partitions: what is checked is per record (dead letters by source offset, scores by event id), not the
scores' values, so the interleaving across partitions does not matter.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time

import polars as pl
import pytest
from kafka import KafkaProducer

from consumers.scoring.messages import (
    Label,
    Transaction,
    encode_label,
    encode_transaction,
    format_ts,
    transactions_from_frame,
)
from pipeline.data.generate import GenerateConfig, generate
from pipeline.features.definitions import terminal_bucket
from pipeline.registry.tracking import load_model
from tests.integration.service_helpers import (
    Running,
    assert_exactly_once,
    create_topic,
    prefixed_configs,
    read_committed,
    save_tiny_model,
    wait_for_scores,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(600)]

PARTITIONS = 3
HOUR_US = 3_600_000_000


@pytest.fixture(scope="module")
def frame() -> pl.DataFrame:
    frame = generate(GenerateConfig(accounts=100, days=20, seed=13)).sort("ts", "event_id")
    assert 2_000 <= frame.height <= 6_000 and frame["is_fraud"].sum() > 20, frame.height
    return frame


@pytest.fixture
def cfg(kafka_bootstrap):
    settings = {"poll_timeout_ms": 200, "max_poll_records": 200, "terminal_table_flush_s": 1.0}
    with prefixed_configs(kafka_bootstrap, "hostile", **settings) as make:
        yield make()


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


def poison_transactions(good: list[Transaction], fault_terminal: str, now_us: int) -> list[tuple]:
    """(key, value, the reason's words) of every kind of hostile transaction, each valid but for its fault."""
    base = json.loads(encode_transaction(good[0]))
    a = good[0].account_id
    key = a.encode()

    def body(**changes) -> bytes:
        return json.dumps({**base, **changes}).encode()

    return [
        (key, b'{"event_id":' * 3_000 + b"1" + b"}" * 3_000, "JSON nested 3000 deep"),
        (key, body(amount=12.5).replace(b"12.5", b"7" * 5_000), "Exceeds the limit (4300 digits)"),
        (key, body(amount=10**400), "is above max_amount"),  # an integer beyond any float
        (key, body(amount=1.7e308), "is above max_amount"),  # near the float maximum
        (key, body(amount=math.nan), "not a finite amount"),
        (key, body(amount=-0.01), "not a finite amount"),
        (key, body(amount=True), "expected a number"),
        (key, body(amount="12.5"), "expected a number"),
        (b"A\\ud800", body(account_id="A\ud800"), "a lone surrogate, which UTF-8 cannot encode"),
        (key, body(terminal_id="T\u202e9"), "holds U+202E, not printable"),  # right-to-left override
        (key, body(event_id="E\x00"), "holds U+0000, not printable"),
        (key, body(event_id="E" * 300), "300 characters; the limit is 256"),
        (key, body(event_id="   "), "expected a non-empty string"),
        (key, body(ts="2090-01-01T00:00:00Z"), "in the future"),
        (key, body(ts=format_ts(now_us + 2 * HOUR_US)), "s in the future: more than max_ts_skew_s"),
        (key, body(ts="1999-12-31T23:59:59Z"), "is outside 2000..2099"),
        (key, body(ts="0001-01-01T00:00:00+01:00"), "is outside 2000..2099"),
        (key, body(ts="2026-01-02 10:00:00"), "has no UTC offset"),
        (key, json.dumps(base).encode("utf-16"), "not valid UTF-8 JSON"),
        (key, b"\xff\xfe\xfd", "not valid UTF-8 JSON"),
        (key, b"[1, 2]", "expected a JSON object"),
        (key, body(colour="red"), "unknown field(s): colour"),
        (key, body(pad="x" * 70_000), "the limit is 65536"),
        (key, None, "null value"),
        (good[1].account_id.encode(), encode_transaction(good[0]), "is not the body's account_id"),
        (None, encode_transaction(good[0]), "record key missing"),
        (b"\xff\xfe", encode_transaction(good[0]), "is not the body's account_id"),  # a key not UTF-8
        # the last resort: valid, but the detector fails on it (one on a known account, one on a new one)
        (
            key,
            encode_transaction(good[0]._replace(event_id="F1", terminal_id=fault_terminal)),
            "scoring failed",
        ),
        (
            b"A-F",
            encode_transaction(Transaction("F2", "A-F", good[0].ts_us, 5.0, fault_terminal)),
            "scoring failed",
        ),
    ]


def poison_labels(good: Label, now_us: int) -> list[tuple]:
    data = json.loads(encode_label(good))
    return [
        (b"k", b'{"label_ts":' * 3_000, "JSON nested 3000 deep"),
        (b"k", encode_label(dataclasses.replace(good, label_ts_us=now_us + 48 * HOUR_US)), "in the future"),
        (b"k", json.dumps({**data, "terminal_id": "T\udfff"}).encode(), "lone surrogate"),
        (b"k", json.dumps({**data, "is_fraud": "yes"}).encode(), "expected true or false"),
        (b"k", b"{not json", "not valid UTF-8 JSON"),
    ]


def send_all(bootstrap: str, topic: str, messages: list[tuple]) -> list[tuple[int, int]]:
    """Produce (key, value, ...) in order; the (partition, offset) of each."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    try:
        futures = [producer.send(topic, key=m[0], value=m[1]) for m in messages]
        producer.flush()
        return [(f.get().partition, f.get().offset) for f in futures]
    finally:
        producer.close()


def test_poison_of_every_kind_goes_to_dead_letter_and_every_good_event_is_scored_once(
    kafka_bootstrap, cfg, frame, tmp_path
):
    now_us = time.time_ns() // 1000
    good = transactions_from_frame(frame)
    buckets = set(terminal_bucket(t.terminal_id for t in good).tolist())
    fault_terminal = next(
        f"T-FAULT-{i}" for i in range(10_000) if terminal_bucket([f"T-FAULT-{i}"])[0] not in buckets
    )
    poison = poison_transactions(good, fault_terminal, now_us)
    assert len(poison) >= 20

    # The stream: good events keyed by account, the poison scattered through it, and a producer's retry of
    # some good events right behind them (the same event at another offset: dead-lettered as a replay).
    rng = random.Random(7)
    stream = [(t.account_id.encode(), encode_transaction(t), None) for t in good]
    for key, value, why in poison:
        stream.insert(rng.randrange(len(stream) + 1), (key, value, why))
    retried = rng.sample(range(len(good)), 5)
    for event in (good[i] for i in retried):
        at = next(i for i, m in enumerate(stream) if m[1] == encode_transaction(event))
        stream.insert(at + 1, (event.account_id.encode(), encode_transaction(event), "was applied already"))
    fraud = frame.filter(pl.col("is_fraud") & pl.col("label_ts").is_not_null())
    labels = [
        Label(r["event_id"], r["account_id"], r["terminal_id"], True, int(r["label_ts"].timestamp() * 1e6))
        for r in fraud.iter_rows(named=True)
    ]
    label_stream = [(label.account_id.encode(), encode_label(label), None) for label in labels]
    for key, value, why in poison_labels(labels[0], now_us):
        label_stream.insert(rng.randrange(len(label_stream) + 1), (key, value, why))

    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=PARTITIONS)
    create_topic(kafka_bootstrap, cfg.topic("labels"), partitions=PARTITIONS)
    half = len(stream) // 2
    placed = send_all(kafka_bootstrap, cfg.topic("transactions"), stream[:half])
    placed_labels = send_all(kafka_bootstrap, cfg.topic("labels"), label_stream)

    model_dir = save_tiny_model(frame, 10, tmp_path / "model", "hostile")
    running = Running(cfg, faulty_model(model_dir, terminal_bucket([fault_terminal])[0]), kafka_bootstrap)
    placed += send_all(kafka_bootstrap, cfg.topic("transactions"), stream[half:])  # while it runs
    scores = wait_for_scores(kafka_bootstrap, cfg.topic("scores"), len(good), running, timeout_s=400)
    assert running.thread.is_alive() and running.error is None, "hostile input stopped the service"
    stats = running.stop()  # the table writer dead-letters the bad labels as it flushes on the way out

    by_event = assert_exactly_once(scores, good)  # the retries too: never scored twice
    assert all(math.isfinite(s["score"]) and 0.0 <= s["score"] <= 1.0 for s in by_event.values())

    letters = [json.loads(r.value) for r in read_committed(kafka_bootstrap, cfg.topic("dead_letter"))]
    dead = {(d["source_topic"], d["source_partition"], d["source_offset"]): d for d in letters}
    assert len(dead) == len(letters), "a record was dead-lettered twice"
    expected = {
        (cfg.topic("transactions"), *where): why
        for (_, _, why), where in zip(stream, placed, strict=True)
        if why is not None
    }
    expected |= {
        (cfg.topic("labels"), *where): why
        for (_, _, why), where in zip(label_stream, placed_labels, strict=True)
        if why is not None
    }
    assert set(dead) == set(expected), "a poison record was not dead-lettered, or a good one was"
    for where, why in expected.items():
        assert why in dead[where]["reason"], (where, why, dead[where]["reason"])
    assert len(set(why for why in expected.values())) >= 20  # kinds, not copies

    assert stats.replays_dropped == len(retried) and stats.careful_batches >= 1
    assert stats.events_scored == len(good) and stats.labels_applied >= len(labels)
