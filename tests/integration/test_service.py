"""The scoring service against the project's real Kafka broker: exactly one score per good event, with the
values of the scorer itself, dead letters with reasons, and state restored on restart (account states from
the changelog, terminal records from the terminal table), so a restart changes no score.

Parity and restart use ONE transactions partition: the terminal features read a table shared by all
accounts, so their values depend on the global order of events. One partition makes that order the topic's
order, which the reference reproduces; with several partitions the interleaving across partitions is the
consumer's choice and only per-account order is defined.
"""

from __future__ import annotations

import base64
import json
import math
import signal
import subprocess
import time
import urllib.request

import polars as pl
import pytest
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewPartitions
from kafka.partitioner.default import murmur2

from consumers.runtime.metrics import free_port
from consumers.runtime.topics import ensure_topics
from consumers.scoring.messages import encode_transaction, transactions_from_frame
from consumers.scoring.scorer import Scorer
from pipeline.data.generate import GenerateConfig, generate
from pipeline.registry.tracking import load_model
from tests.integration.service_helpers import (
    Running,
    assert_exactly_once,
    assert_same_scores,
    create_topic,
    produce,
    read_committed,
    save_tiny_model,
    wait_for_scores,
)
from tests.integration.service_runs import (
    committed_count,
    serve_until,
    service_configs,
    start_child,
    uninterrupted_scores,
    wait_until,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def frame() -> pl.DataFrame:
    return generate(GenerateConfig(accounts=20, days=12, seed=11)).sort("ts", "event_id")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, frame):
    return save_tiny_model(frame, 8, tmp_path_factory.mktemp("model"), "test-1")


service_cfg = service_configs("svc", max_poll_records=40, poll_timeout_ms=200)


def test_every_event_gets_one_score_equal_to_the_scorers(kafka_bootstrap, service_cfg, frame, model_dir):
    cfg = service_cfg()
    events = transactions_from_frame(frame)
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    produce(
        kafka_bootstrap, cfg.topic("transactions"), [(t.account_id, encode_transaction(t)) for t in events]
    )

    scores, stats = serve_until(cfg, model_dir, kafka_bootstrap, len(events))

    by_event = assert_exactly_once(scores, events)
    reference = Scorer(load_model(model_dir)).score_batch(events)
    assert_same_scores(by_event, reference.records)
    assert {s["model_version"] for s in scores} == {"test-1"}
    assert stats.events_scored == len(events) and stats.dead_lettered == 0
    alert_messages = [json.loads(r.value) for r in read_committed(kafka_bootstrap, cfg.topic("alerts"))]
    alerts = [a["event_id"] for a in alert_messages]
    assert sorted(alerts) == sorted(e for e, s in by_event.items() if s["alert"])
    # Each alert record is its score record plus its reasons: the top inputs and the history term, as the
    # scorer alone gives them (to float rounding: the service's batches are not the reference's).
    assert alert_messages and len(reference.reasons) == len(alert_messages)
    explained = {reference.records[i].event_id: e for i, e in reference.reasons.items()}
    for alert in alert_messages:
        want = explained[alert["event_id"]]
        assert {k: v for k, v in alert.items() if k not in ("reasons", "history", "base_logit")} == by_event[
            alert["event_id"]
        ]
        assert [r["input"] for r in alert["reasons"]] == [r.input for r in want.reasons]
        assert [r["text"] for r in alert["reasons"]] == [r.text for r in want.reasons]
        assert [r["logit"] for r in alert["reasons"]] == pytest.approx(
            [r.logit for r in want.reasons], abs=1e-3
        )
        assert alert["history"]["logit"] == pytest.approx(want.history.logit, abs=1e-3)
    # One state record per account per batch it appeared in; the latest per account is what restores it.
    changelog = read_committed(kafka_bootstrap, cfg.topic("changelog"))
    assert {r.key.decode() for r in changelog} == {t.account_id for t in events}


def test_bad_input_goes_to_dead_letter_with_its_reason_and_the_rest_is_scored(
    kafka_bootstrap, service_cfg, frame, model_dir
):
    port = free_port()
    cfg = service_cfg(metrics_port=port, metrics_host="127.0.0.1")
    events = transactions_from_frame(frame.head(150))
    good = json.loads(encode_transaction(events[0]))
    bad = {
        b"{not json": "not valid UTF-8 JSON",
        b"\xff\xfe": "not valid UTF-8 JSON",
        b"[1, 2]": "expected a JSON object",
        json.dumps(
            {k: v for k, v in good.items() if k != "amount"}
        ).encode(): "missing required field(s): amount",
        json.dumps({**good, "amount": math.nan}).encode(): "not a finite amount",
        json.dumps({**good, "amount": -3.0}).encode(): "not a finite amount",
        json.dumps(good)
        .encode()
        .replace(b'"amount"', b'"amount": 1, "amount"', 1): "'amount' appears more than once",
        json.dumps({**good, "ts": "yesterday"}).encode(): "is not an ISO-8601 timestamp",
        json.dumps({**good, "ts": "2026-03-01T12:00:00"}).encode(): "has no UTC offset",
        None: "null value",
    }
    messages = [(t.account_id, encode_transaction(t)) for t in events]
    for i, value in enumerate(bad):  # spread through the stream, several batches apart
        messages.insert(15 * i + 3, (f"bad-{i}", value))
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=3)
    produce(kafka_bootstrap, cfg.topic("transactions"), messages)

    running = Running(cfg, model_dir, kafka_bootstrap)
    scores = wait_for_scores(kafka_bootstrap, cfg.topic("scores"), len(events), running)
    dead = [json.loads(r.value) for r in read_committed(kafka_bootstrap, cfg.topic("dead_letter"))]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    assert running.thread.is_alive() and running.error is None, "bad input stopped the service"
    stats = running.stop()

    assert_exactly_once(scores, events)
    assert len(dead) == len(bad) and stats.dead_lettered == len(bad)
    reasons = sorted(d["reason"] for d in dead)
    for expected in bad.values():
        assert any(expected in r for r in reasons), f"no dead letter says {expected!r}: {reasons}"
    for d in dead:
        assert d["source_topic"] == cfg.topic("transactions") and d["source_offset"] >= 0
    originals = {base64.b64decode(d["value_base64"]) for d in dead if d["value_base64"] is not None}
    assert originals == {v for v in bad if v is not None}, "a dead letter lost the original bytes"
    # Scores are keyed by account and land where the default partitioner puts that key (3 partitions here).
    for r in read_committed(kafka_bootstrap, cfg.topic("scores")):
        assert r.key.decode() == json.loads(r.value)["account_id"]
        assert r.partition == (murmur2(r.key) & 0x7FFFFFFF) % 3
    assert f"txsentinel_events_dead_lettered_total {len(bad)}" in metrics
    assert f"txsentinel_events_scored_total {len(events)}" in metrics
    # Every input record counted in a batch, every score's latency observed, nothing left behind.
    assert f"txsentinel_batch_events_sum {len(messages)}" in metrics
    assert f'txsentinel_latency_seconds_bucket{{le="+Inf"}} {len(events)}' in metrics
    assert "txsentinel_consumer_lag 0.0\n" in metrics  # prometheus_client writes every value as a float


def test_a_restarted_service_resumes_from_committed_offsets_and_changelog_state(
    kafka_bootstrap, service_cfg, frame, model_dir
):
    cfg = service_cfg(max_poll_records=10)
    events = transactions_from_frame(frame)
    messages = [(t.account_id, encode_transaction(t)) for t in events]
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    # The stream arrives in two parts, so the first instance surely stops before its end: it may finish
    # the first part in the time the test takes to notice a third of the scores.
    split = len(events) * 2 // 3
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[:split])

    # Stopped at a third: the batch in flight commits; the rest waits for the next instance.
    serve_until(cfg, model_dir, kafka_bootstrap, len(events) // 3)
    done = len(read_committed(kafka_bootstrap, cfg.topic("scores")))
    assert len(events) // 3 <= done <= split, f"the first instance scored {done} of {split} events"
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[split:])

    scores, stats = serve_until(cfg, model_dir, kafka_bootstrap, len(events))
    by_event = assert_exactly_once(scores, events)
    assert stats.restored_states > 0 and stats.events_scored == len(events) - done

    # Reference: an uninterrupted run. The second instance restores the account records from the changelog
    # and the terminal records from the terminal table, so the restart changes no score.
    assert_same_scores(by_event, uninterrupted_scores(model_dir, events))


def _served_in_two_runs(kafka_bootstrap, cfg, frame, model_dir):
    """(events, scores, first run's stats, second run's): the first half of `frame` served, the service
    stopped, then the rest served by a new instance, on one partition."""
    events = transactions_from_frame(frame)
    messages = [(t.account_id, encode_transaction(t)) for t in events]
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    split = len(events) // 2
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[:split])
    _, first_stats = serve_until(cfg, model_dir, kafka_bootstrap, split)
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[split:])
    scores, second_stats = serve_until(cfg, model_dir, kafka_bootstrap, len(events))
    return events, scores, first_stats, second_stats


def test_dormant_accounts_leave_memory_and_come_back_exactly_across_a_restart(
    kafka_bootstrap, service_cfg, frame, model_dir
):
    """Memory for 5 of the 20 accounts: the others wait in the changelog and are read back when they
    return, during the run and after a restart, which loads only the 5 written last; no score changes."""
    cfg = service_cfg(max_poll_records=10, max_states_in_memory=5)
    events, scores, first_stats, second_stats = _served_in_two_runs(kafka_bootstrap, cfg, frame, model_dir)

    assert_same_scores(assert_exactly_once(scores, events), uninterrupted_scores(model_dir, events))
    for stats in (first_stats, second_stats):
        assert stats.states_evicted > 0 and stats.states_reloaded > 0
    assert second_stats.restored_states == 5  # the rest of the 20 stayed dormant until they returned


def test_accounts_past_max_accounts_kept_are_deleted_from_the_changelog_and_a_restart_agrees(
    kafka_bootstrap, service_cfg, frame, model_dir
):
    """Memory for 2 accounts, 4 kept in all: the least recently written of the 20 are let go with a
    tombstone each in their batch's transaction, across a restart. Exactly one score per event; the
    changelog holds as many tombstones as the service counted, and its live accounts are bounded; the
    accounts never let go score as in an uninterrupted run."""
    cfg = service_cfg(max_poll_records=10, max_states_in_memory=2, max_accounts_kept=4)
    events, scores, first_stats, second_stats = _served_in_two_runs(kafka_bootstrap, cfg, frame, model_dir)

    by_event = assert_exactly_once(scores, events)
    assert first_stats.accounts_let_go > 0 and second_stats.accounts_let_go > 0
    live: dict[str, bytes] = {}
    let_go, tombstones = set(), 0
    for record in read_committed(kafka_bootstrap, cfg.topic("changelog")):
        account = record.key.decode()
        if record.value is None:
            tombstones += 1
            let_go.add(account)
            live.pop(account, None)
        else:
            live[account] = record.value
    assert tombstones == first_stats.accounts_let_go + second_stats.accounts_let_go
    assert len(live) <= 4 + cfg.max_poll_records  # the bound, and one batch's new accounts past it
    kept = [r for r in uninterrupted_scores(model_dir, events) if r.account_id not in let_go]
    assert kept, "every account was let go: the bound is too low for this test to compare"
    assert_same_scores(by_event, kept)


def test_partitions_added_while_serving_go_to_dead_letter_and_the_others_are_served_on(
    kafka_bootstrap, service_cfg, frame, model_dir
):
    """No changelog partition holds the states of a partition added to `transactions` while the service
    runs: its records are dead-lettered, each with the reason, and the partitions the service started with
    are served on, exactly once."""
    cfg = service_cfg(metadata_max_age_ms=500)
    events = transactions_from_frame(frame)
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    split = len(events) // 2
    sent = [(t.account_id, encode_transaction(t)) for t in events]  # by key, whatever the partition count
    produce(kafka_bootstrap, cfg.topic("transactions"), sent[:split])
    running = Running(cfg, model_dir, kafka_bootstrap)
    wait_for_scores(kafka_bootstrap, cfg.topic("scores"), split, running)
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        admin.create_partitions({cfg.topic("transactions"): NewPartitions(total_count=2)})
    finally:
        admin.close()
    produce(kafka_bootstrap, cfg.topic("transactions"), sent[split:])
    on_new = {t.event_id for t in events[split:] if (murmur2(t.account_id.encode()) & 0x7FFFFFFF) % 2 == 1}
    assert 0 < len(on_new) < len(events) - split

    wait_until(
        lambda: committed_count(kafka_bootstrap, cfg.topic("dead_letter")) >= len(on_new),
        "the records of the added partition in dead-letter",
        60,
        running,
    )
    scores = wait_for_scores(kafka_bootstrap, cfg.topic("scores"), len(events) - len(on_new), running)
    dead = [json.loads(r.value) for r in read_committed(kafka_bootstrap, cfg.topic("dead_letter"))]
    stats = running.stop()

    assert_exactly_once(scores, [t for t in events if t.event_id not in on_new])
    dead_ids = {json.loads(base64.b64decode(d["value_base64"]))["event_id"] for d in dead}
    assert dead_ids == on_new and len(dead) == len(on_new) == stats.dead_lettered
    assert {d["source_partition"] for d in dead} == {1}
    assert all("beyond the 1 partitions" in d["reason"] for d in dead)


def test_a_stable_instance_id_aborts_the_transaction_a_crashed_predecessor_left_open(
    kafka_bootstrap, service_cfg, frame, model_dir
):
    """The predecessor died with a transaction open on the changelog. Its successor, with the same
    instance_id, aborts it on start; otherwise the changelog restore would wait behind it until
    transaction_timeout_ms (30 s, the default) ran out."""
    cfg = service_cfg(instance_id="scorer-0")
    assert cfg.transaction_timeout_ms == 30_000
    events = transactions_from_frame(frame.head(200))
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    ensure_topics(cfg, kafka_bootstrap)
    predecessor = KafkaProducer(
        bootstrap_servers=kafka_bootstrap, transactional_id=f"{cfg.transactional_id_prefix}-scorer-0"
    )
    predecessor.init_transactions()
    predecessor.begin_transaction()
    predecessor.send(cfg.topic("changelog"), key=b"ghost", value=b"never committed", partition=0)
    predecessor.flush()
    predecessor.close()  # gone without commit or abort: its transaction stays open on the broker
    produce(
        kafka_bootstrap, cfg.topic("transactions"), [(t.account_id, encode_transaction(t)) for t in events]
    )

    started = time.monotonic()
    scores, stats = serve_until(cfg, model_dir, kafka_bootstrap, len(events), timeout_s=40)
    assert time.monotonic() - started < 40 and stats.restore_s < 10
    assert_exactly_once(scores, events)
    assert b"ghost" not in {r.key for r in read_committed(kafka_bootstrap, cfg.topic("changelog"))}


def test_a_killed_service_loses_nothing_and_scores_nothing_twice(
    kafka_bootstrap, service_cfg, frame, model_dir
):
    # Short timeouts, or the test waits minutes: the group waits session_timeout_ms (45 s by default) for the
    # dead member before handing its partition on, and its open transaction holds back read_committed
    # readers (and the next instance's restore) until transaction_timeout_ms (30 s) aborts it.
    cfg = service_cfg(max_poll_records=5, transaction_timeout_ms=5000, session_timeout_ms=6000)
    events = transactions_from_frame(frame)
    messages = [(t.account_id, encode_transaction(t)) for t in events]
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    split = len(events) * 2 // 3
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[:split])

    child = start_child(cfg, model_dir, kafka_bootstrap, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while len(read_committed(kafka_bootstrap, cfg.topic("scores"))) < len(events) // 3:
            assert child.poll() is None, f"the child service died: {child.stderr.read().decode()[-3000:]}"
            assert time.monotonic() < deadline, "the child service scored too little within 90 s"
            time.sleep(0.2)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        child.stderr.close()
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[split:])

    scores, stats = serve_until(cfg, model_dir, kafka_bootstrap, len(events))
    by_event = assert_exactly_once(scores, events)
    done = len(events) - stats.events_scored  # what the killed instance committed; it scored a prefix
    assert stats.restored_states > 0 and done >= len(events) // 3

    # The killed instance's terminal records were committed with its scores: as if never interrupted.
    assert_same_scores(by_event, uninterrupted_scores(model_dir, events))
