"""Issue 4's acceptance sizes against the real broker: 20,000 events for 500 accounts, with 1,000 generated
bad messages of every kind mixed in, through one service.

Every good event must come back scored exactly once, equal (<= 1e-5) to the detector's PARALLEL forward over
each account's whole history (batch features from pipeline.features, normalised by the model's spec): the
serving path against the training path, not against the scorer it is built on. Every bad message must land
in `dead-letter` with its reason and its original bytes, and the service must still be running.

One partition: terminal features count events across accounts, so they depend on the global event order,
which one partition keeps. No labels are streamed, so the reference frame has none either.
"""

import base64
import json
import math
import random

import numpy as np
import polars as pl
import pytest
import torch

from consumers.scoring.message_limits import MAX_MESSAGE_BYTES
from consumers.scoring.messages import encode_transaction, transactions_from_frame
from pipeline.data.generate import GenerateConfig, generate
from pipeline.features import TERMINAL_BUCKET_COLUMN, compute_features
from pipeline.registry.tracking import load_model
from tests.integration.service_helpers import (
    Running,
    assert_exactly_once,
    create_topic,
    prefixed_configs,
    produce,
    read_committed,
    save_tiny_model,
    wait_for_scores,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(600)]

EVENTS, ACCOUNTS, BAD = 20_000, 500, 1_000


@pytest.fixture(scope="module")
def frame() -> pl.DataFrame:
    frame = generate(GenerateConfig(accounts=ACCOUNTS + 50, days=60, seed=21)).sort("ts", "event_id")
    earliest = frame.unique("account_id", keep="first", maintain_order=True).head(ACCOUNTS)["account_id"]
    frame = frame.filter(pl.col("account_id").is_in(earliest.implode())).head(EVENTS)
    assert frame.height == EVENTS and frame["account_id"].n_unique() == ACCOUNTS
    return frame.with_columns(is_fraud=pl.lit(False))  # no labels reach the service, none in the reference


def bad_messages(good: dict, count: int, seed: int = 0) -> list[tuple[bytes | None, str]]:
    """`count` bad messages, cycling through every kind the service must refuse: (value, expected reason)."""
    rng = random.Random(seed)
    text = json.dumps(good)
    kinds = [
        lambda: (text[: rng.randrange(1, len(text) - 1)].encode(), "not valid UTF-8 JSON"),  # truncated
        lambda: (bytes(rng.randrange(128, 256) for _ in range(rng.randrange(1, 40))), "not valid UTF-8 JSON"),
        lambda: (json.dumps([good]).encode(), "expected a JSON object"),
        lambda: (json.dumps(rng.random()).encode(), "expected a JSON object"),
        *[
            (lambda f=field: (json.dumps({k: v for k, v in good.items() if k != f}).encode(), "missing"))
            for field in ("event_id", "account_id", "ts", "amount", "terminal_id")
        ],
        lambda: (json.dumps({**good, "amount": str(good["amount"])}).encode(), "expected a number"),
        lambda: (json.dumps({**good, "amount": True}).encode(), "expected a number"),
        lambda: (json.dumps({**good, "event_id": rng.randrange(10**6)}).encode(), "non-empty string"),
        lambda: (json.dumps({**good, "account_id": "   "}).encode(), "non-empty string"),
        lambda: (json.dumps({**good, "amount": math.nan}).encode(), "not a finite amount"),
        lambda: (json.dumps({**good, "amount": math.inf}).encode(), "not a finite amount"),
        lambda: (json.dumps({**good, "amount": -rng.uniform(0.01, 1e6)}).encode(), "not a finite amount"),
        lambda: (json.dumps({**good, "ts": "2026-03-01 12:00:00"}).encode(), "has no UTC offset"),
        lambda: (json.dumps({**good, "ts": "not a time"}).encode(), "is not an ISO-8601 timestamp"),
        lambda: (json.dumps({**good, "ts": "1970-01-01T00:00:00Z"}).encode(), "is outside"),
        lambda: (json.dumps({**good, "ts": 1772366400}).encode(), "expected an ISO-8601 timestamp string"),
        lambda: (json.dumps({**good, "channel": 7}).encode(), "expected a string"),
        lambda: (
            json.dumps(good).encode().replace(b'"event_id"', b'"event_id": "E-other", "event_id"', 1),
            "appears more than once",
        ),
        lambda: (json.dumps({**good, "pad": "x" * MAX_MESSAGE_BYTES}).encode(), "the limit is"),
        lambda: (None, "null value"),
    ]
    return [kinds[i % len(kinds)]() for i in range(count)]


def parallel_scores(model_dir: str, frame: pl.DataFrame) -> dict[str, float]:
    """event_id -> sigmoid(detector.forward) over each account's whole history: the training path."""
    model = load_model(model_dir)
    features = compute_features(frame)
    out = {}
    for (_,), rows in features.group_by(["account_id"], maintain_order=True):
        buckets = rows[TERMINAL_BUCKET_COLUMN].to_numpy()[:, None].astype(np.float32)
        x = torch.from_numpy(np.concatenate([model.spec.matrix(rows), buckets], axis=1))  # [T, F + 1]
        with torch.inference_mode():
            logits, _ = model.detector(x[None])
        out.update(zip(rows["event_id"], torch.sigmoid(logits[0].double()).tolist(), strict=True))
    return out


@pytest.fixture
def cfg(kafka_bootstrap):
    with prefixed_configs(kafka_bootstrap, "accept", poll_timeout_ms=200) as make:
        yield make()


def test_20k_events_of_500_accounts_with_1000_bad_messages(kafka_bootstrap, cfg, frame, tmp_path):
    model_dir = save_tiny_model(frame, 20, tmp_path / "model", "acceptance")
    events = transactions_from_frame(frame)
    good = [(t.account_id, encode_transaction(t)) for t in events]
    bad = bad_messages(json.loads(good[0][1]), BAD)
    rng = random.Random(1)
    stream = list(good)
    for i, (value, _) in enumerate(bad):  # scattered through the stream, kept in generation order
        stream.insert(rng.randrange(len(stream) + 1), (f"bad-{i}", value))
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    produce(kafka_bootstrap, cfg.topic("transactions"), stream)

    running = Running(cfg, model_dir, kafka_bootstrap)
    scores = wait_for_scores(kafka_bootstrap, cfg.topic("scores"), EVENTS, running, timeout_s=400)
    dead = [json.loads(r.value) for r in read_committed(kafka_bootstrap, cfg.topic("dead_letter"))]
    assert running.thread.is_alive() and running.error is None, "bad input stopped the service"
    stats = running.stop()

    by_event = assert_exactly_once(scores, events)
    reference = parallel_scores(model_dir, frame)
    worst = max(abs(by_event[e]["score"] - p) for e, p in reference.items())
    assert worst <= 1e-5, f"service scores differ from the parallel forward by up to {worst:.3g}"
    assert stats.events_scored == EVENTS and stats.dead_lettered == BAD

    assert len(dead) == BAD
    sent = sorted((v for v, _ in bad if v is not None))
    assert sorted(base64.b64decode(d["value_base64"]) for d in dead if d["value_base64"]) == sent
    reasons = [d["reason"] for d in dead]
    for _, expected in bad:
        assert any(expected in r for r in reasons), f"no dead letter says {expected!r}"
    by_value = {base64.b64decode(d["value_base64"]) if d["value_base64"] else None: d for d in dead}
    for value, expected in bad:  # each message's own reason, not just some message's
        assert expected in by_value[value]["reason"], (value[:80] if value else value, by_value[value])
