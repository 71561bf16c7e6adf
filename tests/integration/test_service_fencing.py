"""A frozen instance is fenced, against the project's real Kafka broker (no mocks).

Instance A runs in a child process and is paused with SIGSTOP while it scores a steady stream, for longer
than its session timeout; instance B, in the same group, takes A's partitions meanwhile. A is then resumed
with SIGCONT: whatever it had open or scores on waking must not land (its transaction timed out and its
producer is fenced; its offsets carry a group generation that has ended). Exactly once must hold: every
event scored once in the committed output, equal to an uninterrupted run, and every account's last
committed state record equal to that run's (docs/operations.md, "Fencing a frozen instance").

Every event gets its own terminal, as in test_service_resilience.py (its docstring says why): scores then
depend on account state only, whichever instance scores them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import polars as pl
import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.errors import CommitFailedError
from kafka.structs import ConsumerGroupMetadata, OffsetAndMetadata, TopicPartition

from consumers.scoring.account_state import decode_account_record
from consumers.scoring.messages import Transaction, encode_transaction, transactions_from_frame
from consumers.scoring.scorer import Scorer
from consumers.service.commit_pipeline import BrokenTransaction, ScoredBatch, TransactionPipeline
from models.state_codec import decode_account_state
from pipeline.bench.broker import REPO_ROOT
from pipeline.data.generate import GenerateConfig, generate
from pipeline.features.state import ACCOUNT_STATE
from pipeline.registry.tracking import load_model
from tests.integration.service_helpers import (
    CHILD,
    TOLERANCE,
    Running,
    ServiceLog,
    assert_exactly_once,
    assert_same_scores,
    create_topic,
    prefixed_configs,
    produce,
    read_committed,
    relevant_lines,
    save_tiny_model,
    thread_stacks,
)
from tests.integration.service_runs import committed_count, group_members, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

# The group drops a silent member after 6 s; the broker aborts its open transaction 5 s after it began (and
# looks for expired ones every 10 s: so B's restore may wait a few seconds behind A's open transaction).
FAST = {"session_timeout_ms": 6000, "transaction_timeout_ms": 5000, "poll_timeout_ms": 200}
PAUSE_S = 16  # past the session timeout, and past the broker's abort of A's transaction


@pytest.fixture(scope="module")
def frame() -> pl.DataFrame:  # ~2100 events, 34 accounts, one terminal per event
    frame = generate(GenerateConfig(accounts=60, days=30, seed=5)).sort("ts", "event_id")
    return frame.with_columns(("T-" + pl.col("event_id").cast(pl.Utf8)).alias("terminal_id"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, frame):
    return save_tiny_model(frame, 20, tmp_path_factory.mktemp("model"), "fence-1")


def trickle(bootstrap: str, topic: str, events: list[Transaction], stop: threading.Event) -> threading.Thread:
    """Produce `events` in small steps on a thread, so both instances are busy whenever A is paused."""

    def run():
        for start in range(0, len(events), 10):
            produce(
                bootstrap, topic, [(t.account_id, encode_transaction(t)) for t in events[start : start + 10]]
            )
            if stop.wait(0.05):
                return

    thread = threading.Thread(target=run, name="trickle", daemon=True)
    thread.start()
    return thread


def assert_states_consistent(bootstrap: str, cfg, model_dir: str, events: list[Transaction]) -> int:
    """Each account's last committed changelog record equals an uninterrupted run's over the same positions."""
    where = {}  # event_id -> (partition, offset) in transactions
    for record in read_committed(bootstrap, cfg.topic("transactions")):
        where[json.loads(record.value)["event_id"]] = (record.partition, record.offset)
    reference = Scorer(load_model(model_dir))
    reference.score(events, [where[t.event_id] for t in events])
    latest = {r.key.decode(): r.value for r in read_committed(bootstrap, cfg.topic("changelog"))}
    assert set(latest) == {t.account_id for t in events}, "an account has no committed state, or a stranger"
    detector = reference.detector
    for account, value in latest.items():
        got = decode_account_record(value, account)
        want = decode_account_record(reference.account_state_bytes(account), account)
        assert (got.partition, got.offset) == (want.partition, want.offset), f"{account}: last applied event"
        assert (got.last_ts_us, got.recent_ids, got.recent_next) == (
            want.last_ts_us, want.recent_ids, want.recent_next
        ), f"{account}: bookkeeping"  # fmt: skip
        got_features, want_features = (np.frombuffer(r.features, dtype=ACCOUNT_STATE)[0] for r in (got, want))
        for name in ACCOUNT_STATE.names:
            assert np.allclose(got_features[name], want_features[name], rtol=0, atol=TOLERANCE), (
                f"{account}: featurizer state {name!r}"
            )
        got_state = decode_account_state(detector, got.detector)
        want_state = decode_account_state(detector, want.detector)
        for key, tensor in want_state.items():
            worst = float((got_state[key] - tensor).abs().max())
            assert worst <= TOLERANCE, f"{account}: detector state {key!r} differs by {worst:.3g}"
    return len(latest)


def failure_report(
    bootstrap: str, cfg, log_path, a: subprocess.Popen, b: Running | None, b_log: ServiceLog
) -> str:
    """What a failed run prints: where each partition stands, B's stats (or its threads' stacks if it does not
    stop), and what A and B logged of their own work and of the group, with A's threads' stacks."""
    out = ["=== per partition of transactions: end offset, group's committed offset, committed scores"]
    try:
        topic = cfg.topic("transactions")
        scores = Counter(r.partition for r in read_committed(bootstrap, cfg.topic("scores")))
        consumer = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed")
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        try:
            tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
            ends = consumer.end_offsets(tps)
            offsets = admin.list_group_offsets({cfg.group_id: tps})[cfg.group_id]
        finally:
            consumer.close()
            admin.close()
        for tp in tps:
            at = offsets.get(tp)
            out.append(
                f"  {tp.partition}: end={ends[tp]} committed={at and at.offset} scores={scores[tp.partition]}"
            )
        out.append(f"  group {cfg.group_id}: {group_members(bootstrap, cfg.group_id)}")
        scored_ids = {json.loads(r.value)["event_id"] for r in read_committed(bootstrap, cfg.topic("scores"))}
        missing: dict[int, list[int]] = {}
        for record in read_committed(bootstrap, topic):
            if json.loads(record.value)["event_id"] not in scored_ids:
                missing.setdefault(record.partition, []).append(record.offset)
        out.append(f"  offsets of {topic} with no committed score: {missing or 'none'}")
    except Exception as error:  # the report must not hide the failure
        missing = {}
        out.append(f"  (could not read them: {error!r})")
    if b is not None:
        b.stop_event.set()
        b.thread.join(30)
        if b.thread.is_alive():
            out.append("=== B did not stop within 30 s; its threads:")
            out.append(
                thread_stacks(("txs-serve-test", "txsentinel-commit", "kafka-io-txsentinel", "txs-terminal"))
            )
        else:
            out.append(f"=== B stopped: stats={b.stats} error={b.error!r}")
    out.append("=== B's log (its own lines, the group's, warnings and errors; the last 60)")
    out.extend(relevant_lines(list(b_log.lines)))
    size = log_path.stat().st_size
    if a.poll() is None:
        a.send_signal(signal.SIGCONT)
        a.send_signal(signal.SIGUSR1)  # its threads' stacks, into its log
        time.sleep(1)
    a_log = log_path.read_text(errors="replace")
    out.append(f"=== A's log (alive: {a.poll() is None}; the last 60 lines of the same kinds)")
    out.extend(relevant_lines(a_log[:size].splitlines()))
    for p in sorted(missing):  # the batches either instance committed from that partition
        out.append(f"=== batches committed from partition {p} (B's, then A's)")
        out.extend(ln[:300] for ln in b_log.lines if "batch committed" in ln and f"{p}: '" in ln)
        out.extend(
            ln[:300] for ln in a_log[:size].splitlines() if "batch committed" in ln and f"{p}: '" in ln
        )
    out.append("=== A's threads")
    out.append(a_log[size:][-8000:])
    return "\n".join(out)


@pytest.mark.timeout(600)
def test_an_instance_frozen_past_its_session_timeout_is_fenced_and_exactly_once_holds(
    kafka_bootstrap, frame, model_dir, tmp_path
):
    with prefixed_configs(kafka_bootstrap, "fence", **FAST) as make, ServiceLog() as b_log:
        cfg = make(max_poll_records=20)
        events = transactions_from_frame(frame)
        n = len(events)
        create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=4)
        first = n // 4
        produce(
            kafka_bootstrap,
            cfg.topic("transactions"),
            [(t.account_id, encode_transaction(t)) for t in events[:first]],
        )
        overrides = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "security"}
        log_path = tmp_path / "a.log"
        stop_trickle = threading.Event()
        b = None
        with open(log_path, "wb") as log_file:
            a = subprocess.Popen(
                [sys.executable, "-c", CHILD, json.dumps(overrides), model_dir, kafka_bootstrap],
                cwd=REPO_ROOT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "TXS_TEST_SERVICE_LOG_LEVEL": "DEBUG"},
                stdout=subprocess.DEVNULL,
                stderr=log_file,
            )
            try:
                topic = cfg.topic("scores")
                wait_until(
                    lambda: committed_count(kafka_bootstrap, topic) >= first // 3, "A scores", 150, None, a
                )
                b = Running(cfg, model_dir, kafka_bootstrap)
                wait_until(
                    lambda: group_members(kafka_bootstrap, cfg.group_id) == ("Stable", 2),
                    "a group of 2",
                    120,
                    b,
                    a,
                )
                feeder = trickle(kafka_bootstrap, cfg.topic("transactions"), events[first:], stop_trickle)
                wait_until(
                    lambda: committed_count(kafka_bootstrap, topic) >= first + (n - first) // 5,
                    "both score",
                    150,
                    b,
                    a,
                )

                a.send_signal(signal.SIGSTOP)  # mid-stream: maybe inside a batch, maybe with a commit open
                paused_at = committed_count(kafka_bootstrap, topic)
                wait_until(
                    lambda: group_members(kafka_bootstrap, cfg.group_id) == ("Stable", 1), "B alone", 60, b
                )
                time.sleep(max(0.0, PAUSE_S - FAST["session_timeout_ms"] / 1000))
                taken_over = committed_count(kafka_bootstrap, topic)
                a.send_signal(signal.SIGCONT)
                print(f"A paused at {paused_at} scores; B alone had {taken_over} committed when A resumed")
                assert taken_over > paused_at, "B scored nothing while A was paused: no takeover exercised"

                feeder.join(300)
                scores = []

                def all_scored():
                    scores[:] = [json.loads(r.value) for r in read_committed(kafka_bootstrap, topic)]
                    return len(scores) >= n

                wait_until(all_scored, f"{n} scores", 300, b, a)
                assert a.poll() is None, "A did not survive its pause"
                b_stats = b.stop()
                b = None
                a.send_signal(signal.SIGTERM)  # a graceful stop: drains and commits what it holds
                assert a.wait(60) == 0, f"A exited with {a.returncode}"
            except BaseException:
                print(failure_report(kafka_bootstrap, cfg, log_path, a, b, b_log))
                raise
            finally:
                stop_trickle.set()
                if a.poll() is None:
                    a.send_signal(signal.SIGCONT)
                    a.kill()
                    a.wait(30)
                if b is not None:
                    b.stop_event.set()
        a_log = log_path.read_text()
        print("A after waking:", *[line for line in a_log.splitlines() if any(
            word in line for word in ("fenced", "aborted", "rejoin", "revoked", "lost", "moved on", "failed")
        )][:20], sep="\n  ")  # fmt: skip

        scores = [json.loads(r.value) for r in read_committed(kafka_bootstrap, cfg.topic("scores"))]
        by_event = assert_exactly_once(scores, events)
        assert_same_scores(by_event, Scorer(load_model(model_dir)).score(events))
        # B was given partitions at least twice (on joining, and A's when A froze) and restored their states
        assert b_stats.rebalances >= 2 and b_stats.restored_states > 0, b_stats
        accounts = assert_states_consistent(kafka_bootstrap, cfg, model_dir, events)
        print(f"{n} events scored once each; {accounts} accounts' states as an uninterrupted run leaves them")


class FrozenBeforeCommit(KafkaProducer):
    """A real transactional producer whose instance freezes (as SIGSTOP does) between joining the offsets to the
    transaction and committing it, for longer than transaction_timeout_ms plus the broker's 10 s scan."""

    def commit_transaction(self):
        time.sleep(14)  # the broker aborts the transaction and bumps the producer's epoch meanwhile
        super().commit_transaction()


@pytest.mark.timeout(120)
def test_a_commit_whose_transaction_the_broker_aborted_meanwhile_is_never_taken_for_committed(
    kafka_bootstrap, topic_factory
):
    # On waking, the held records go out under the old epoch and fail; kafka-python 3.0.12 then bumps the epoch
    # inside the transaction, and commit_transaction() returns as if it had committed (or, with records still
    # held, never returns). Taken for committed, the batch's events would be lost; here it is refused.
    topic = topic_factory("frozen-commit", partitions=2)
    producer = FrozenBeforeCommit(
        bootstrap_servers=kafka_bootstrap,
        transactional_id=f"frozen-{topic}",
        transaction_timeout_ms=2000,
        linger_ms=60_000,  # held until the commit flushes them, as the service's producer_linger_ms does
    )
    producer.init_transactions()
    pipeline = TransactionPipeline(producer, commit_timeout_s=60)
    batch = ScoredBatch({}, seq=1, records=[(topic, None, b"a", 0), (topic, None, b"b", 1)])
    batch.offsets = {TopicPartition(topic, 0): OffsetAndMetadata(1, "", -1)}
    try:
        pipeline.publish(batch, f"group-{topic}")
        with pytest.raises(BrokenTransaction, match="seq=1"):
            pipeline.settle()
        assert pipeline.take_failed() is batch
    finally:
        producer.close(timeout=0)
        pipeline.close()
    assert read_committed(kafka_bootstrap, topic) == [], "records of a transaction taken for broken landed"


@pytest.mark.timeout(120)
def test_the_offsets_of_a_batch_the_group_refused_never_commit_with_the_next_batch(
    kafka_bootstrap, topic_factory
):
    # kafka-python 3.0.12 keeps the offsets of a refused TxnOffsetCommit after the abort and sent them with the
    # next transaction's: the refused batch's offsets committed without its scores (events lost under load, when
    # a rebalance moved the generation on during a commit).
    topic = topic_factory("refused-offsets", partitions=2)
    group_id, p0, p1 = f"group-{topic}", TopicPartition(topic, 0), TopicPartition(topic, 1)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=f"refused-{topic}")
    producer.init_transactions()
    pipeline = TransactionPipeline(producer, commit_timeout_s=60)
    try:
        refused = ScoredBatch({}, seq=1, records=[(topic, None, b"a", 0)])
        refused.offsets = {p0: OffsetAndMetadata(10, "", -1)}
        pipeline.publish(refused, ConsumerGroupMetadata(group_id, generation_id=5, member_id="gone"))
        with pytest.raises(CommitFailedError):
            pipeline.settle()
        pipeline.take_failed()
        pipeline.abort()
        following = ScoredBatch({}, seq=2, records=[(topic, None, b"b", 1)])
        following.offsets = {p1: OffsetAndMetadata(7, "", -1)}
        pipeline.publish(following, group_id)
        assert pipeline.settle() is not None
    finally:
        producer.close(timeout=5)
        pipeline.close()
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        committed = admin.list_group_offsets({group_id: [p0, p1]})[group_id]
    finally:
        admin.close()
    never = committed.get(p0, OffsetAndMetadata(-1, "", -1)).offset
    assert never == -1, f"the refused batch's offset committed with the next batch: {committed}"
    assert committed[p1].offset == 7
