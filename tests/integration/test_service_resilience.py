"""The scoring service under disruption, against the project's real Kafka broker (no mocks):

(a) a rebalance: a second instance of the same group joins mid-stream and later leaves;
(b) the broker restarts mid-stream while the service runs, and the service recovers by itself;
(c) the service process is killed with SIGKILL at random points three times and restarted each time.

Each ends with a read_committed reader of `scores` that must see exactly one score per event, each equal
(<= 1e-5) to a single, uninterrupted Scorer run over the whole stream (the reference).

Why full parity holds with several partitions and several instances: every event here gets its OWN terminal id
(`T-<event_id>`). Terminal features count events across accounts, so they depend on the order in which
events of different partitions are applied (a batch goes partition by partition, the reference in ts order),
and with two instances each one counts only its own partitions' events (consumers/terminals/table.py). With
one event per terminal every terminal feature is that of a never-seen terminal wherever and whenever the
event is scored, so the scores depend on account state only. These tests are therefore about account state
(changelog restore, offsets, transactions), compared on the FULL score; the terminal table's own restore is
tested in test_service_labels.py, and order-exact parity on one partition in test_service.py and
test_service_acceptance.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time

import polars as pl
import pytest
from kafka import KafkaAdminClient

from consumers.scoring.messages import Transaction, encode_transaction, transactions_from_frame
from consumers.scoring.scorer import Scorer
from pipeline.bench.broker import REPO_ROOT
from pipeline.data.generate import GenerateConfig, generate
from pipeline.registry.tracking import load_model
from tests.integration.service_helpers import (
    CHILD,
    Running,
    assert_exactly_once,
    assert_same_scores,
    create_topic,
    prefixed_configs,
    produce,
    read_committed,
    save_tiny_model,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

# Short timeouts so takeovers are quick (as in test_service.py's crash test): the group drops a silent member
# after session_timeout_ms; a killed instance's open transaction is aborted after transaction_timeout_ms.
FAST = {"session_timeout_ms": 6000, "transaction_timeout_ms": 5000, "poll_timeout_ms": 200}


def unique_terminals(frame: pl.DataFrame) -> pl.DataFrame:
    """One terminal per event: terminal features are then the same on every instance (see module docstring)."""
    return frame.with_columns(("T-" + pl.col("event_id").cast(pl.Utf8)).alias("terminal_id"))


@pytest.fixture(scope="module")
def frame() -> pl.DataFrame:  # ~2100 events, 34 accounts
    return unique_terminals(generate(GenerateConfig(accounts=60, days=30, seed=5))).sort("ts", "event_id")


@pytest.fixture(scope="module")
def big_frame() -> pl.DataFrame:  # 23437 events, 393 accounts: 1-2 minutes with three takeovers on 2 cores
    return unique_terminals(generate(GenerateConfig(accounts=400, days=30, seed=7))).sort("ts", "event_id")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, frame):
    return save_tiny_model(frame, 20, tmp_path_factory.mktemp("model"), "res-1")


@pytest.fixture
def service_cfg(kafka_bootstrap):
    with prefixed_configs(kafka_bootstrap, "res", **FAST) as make:
        yield make


def messages(events: list[Transaction]) -> list[tuple[str, bytes]]:
    return [(t.account_id, encode_transaction(t)) for t in events]


def committed_count(bootstrap: str, topic: str) -> int:
    return len(read_committed(bootstrap, topic))


def wait_until(predicate, what: str, timeout_s: float, running: Running | None = None, child=None):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if running is not None and running.error is not None:
            raise running.error
        if child is not None:
            assert child.poll() is None, f"the child service died (rc={child.returncode})"
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for: {what}"
        time.sleep(0.3)


def wait_all_scores(bootstrap, topic, count, running: Running, timeout_s: float) -> list[dict]:
    found: list[dict] = []

    def done():
        found[:] = [json.loads(r.value) for r in read_committed(bootstrap, topic)]
        return len(found) >= count

    wait_until(done, f"{count} scores in {topic}", timeout_s, running=running)
    return found


def group_members(bootstrap: str, group: str) -> tuple[str, int]:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        info = admin.describe_groups([group])[group]
        return info["group_state"], len(info["members"])
    finally:
        admin.close()


@pytest.mark.timeout(420)
def test_a_member_joining_and_leaving_mid_stream_changes_no_score(
    kafka_bootstrap, service_cfg, frame, model_dir
):
    """Rebalance: B joins while A scores, then B leaves (stop_event); full-score parity (unique terminals)."""
    cfg = service_cfg(max_poll_records=20)
    events = transactions_from_frame(frame)
    msgs = messages(events)
    n = len(events)
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=4)
    first, second = n // 3, 2 * n // 3
    produce(kafka_bootstrap, cfg.topic("transactions"), msgs[:first])

    a = Running(cfg, model_dir, kafka_bootstrap)
    wait_until(
        lambda: committed_count(kafka_bootstrap, cfg.topic("scores")) >= n // 6, "A scores a part", 120, a
    )
    b = Running(cfg, model_dir, kafka_bootstrap)
    wait_until(
        lambda: group_members(kafka_bootstrap, cfg.group_id) == ("Stable", 2), "a stable group of 2", 120, a
    )
    produce(kafka_bootstrap, cfg.topic("transactions"), msgs[first:second])
    wait_until(
        lambda: committed_count(kafka_bootstrap, cfg.topic("scores")) >= (first + second) // 2,
        "both score part 2",
        180,
        a,
    )
    assert b.error is None, b.error
    b_stats = b.stop()  # B leaves the group; A takes its partitions back and restores their accounts
    produce(kafka_bootstrap, cfg.topic("transactions"), msgs[second:])
    scores = wait_all_scores(kafka_bootstrap, cfg.topic("scores"), n, a, timeout_s=180)
    a_stats = a.stop()

    by_event = assert_exactly_once(scores, events)
    assert_same_scores(by_event, Scorer(load_model(model_dir)).score(events))
    assert b_stats.events_scored > 0, "the second instance never scored: no rebalance was exercised"
    assert a_stats.rebalances >= 2 and a_stats.restored_states > 0, a_stats
    assert a_stats.events_scored + b_stats.events_scored >= n


@pytest.mark.timeout(420)
def test_the_service_rides_out_a_broker_restart(kafka_broker, kafka_bootstrap, service_cfg, frame, model_dir):
    """The broker stops and starts on the same data under a running service, which must recover on its own."""
    # Small batches, so the service is still working through the first part when the broker goes away.
    cfg = service_cfg(max_poll_records=5)
    events = transactions_from_frame(frame)
    msgs = messages(events)
    n = len(events)
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=3)
    half = n // 2
    produce(kafka_bootstrap, cfg.topic("transactions"), msgs[:half])

    running = Running(cfg, model_dir, kafka_bootstrap)
    wait_until(
        lambda: committed_count(kafka_bootstrap, cfg.topic("scores")) >= n // 8, "a part scored", 120, running
    )
    kafka_broker.restart()  # skips the test if the broker was not started by scripts/kafka.sh
    at_restart = committed_count(kafka_bootstrap, cfg.topic("scores"))
    print(f"broker restarted with {at_restart} of {half} produced events scored")
    assert running.error is None, f"serve() died during the broker restart: {running.error!r}"
    produce(kafka_bootstrap, cfg.topic("transactions"), msgs[half:])
    scores = wait_all_scores(kafka_bootstrap, cfg.topic("scores"), n, running, timeout_s=240)
    assert running.thread.is_alive(), "serve() returned on its own"
    stats = running.stop()
    print(f"after the restart: {stats}")

    by_event = assert_exactly_once(scores, events)
    assert_same_scores(by_event, Scorer(load_model(model_dir)).score(events))


@pytest.mark.timeout(600)
def test_three_kills_lose_nothing_and_score_nothing_twice(
    kafka_bootstrap, service_cfg, big_frame, model_dir, tmp_path
):
    """SIGKILL at random points three times, restarting each time; full-score parity (unique terminals)."""
    cfg = service_cfg(max_poll_records=50)
    events = transactions_from_frame(big_frame)
    n = len(events)
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=3)
    produce(kafka_bootstrap, cfg.topic("transactions"), messages(events))
    overrides = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "security"}
    seed = int(os.environ.get("TXS_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    # Kill once the committed scores pass each target, after a random extra delay (inside a batch or not).
    targets = sorted(rng.uniform(0.1, 0.8) * n for _ in range(3))
    print(f"seed={seed} events={n} kill targets={[int(t) for t in targets]}")

    for i, target in enumerate(targets):
        # Each instance scores something of its own before its kill, even when targets lie close together.
        target = max(target, committed_count(kafka_bootstrap, cfg.topic("scores")) + n // 50)
        log_path = tmp_path / f"child-{i}.log"
        with open(log_path, "wb") as log_file:
            child = subprocess.Popen(
                [sys.executable, "-c", CHILD, json.dumps(overrides), model_dir, kafka_bootstrap],
                cwd=REPO_ROOT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                stdout=subprocess.DEVNULL,
                stderr=log_file,
            )
            try:
                wait_until(
                    lambda t=target: committed_count(kafka_bootstrap, cfg.topic("scores")) >= t,
                    f"child {i} reaches {int(target)} scores",
                    150,
                    child=child,
                )
                time.sleep(rng.uniform(0.0, 0.5))
            except BaseException:
                print(log_path.read_text()[-3000:])
                raise
            finally:
                child.send_signal(signal.SIGKILL)
                child.wait(30)
        print(f"kill {i}: {committed_count(kafka_bootstrap, cfg.topic('scores'))} scores committed")

    last = Running(cfg, model_dir, kafka_bootstrap)
    scores = wait_all_scores(kafka_bootstrap, cfg.topic("scores"), n, last, timeout_s=240)
    stats = last.stop()
    by_event = assert_exactly_once(scores, events)
    assert stats.restored_states > 0
    assert_same_scores(by_event, Scorer(load_model(model_dir)).score(events))
