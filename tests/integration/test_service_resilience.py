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

import os
import random
import signal
import time

import pytest

from consumers.scoring.messages import transactions_from_frame
from tests.integration.service_helpers import (
    Running,
    assert_exactly_once,
    assert_same_scores,
    create_topic,
    produce,
    wait_for_scores,
)
from tests.integration.service_runs import (
    FAST,
    committed_count,
    messages,
    serve_until,
    service_configs,
    start_child,
    uninterrupted_scores,
    unique_terminal_history,
    wait_for_stable_group,
    wait_until,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

service_cfg = service_configs("res", **FAST)


@pytest.fixture(scope="module")
def big_frame():  # 11194 events, 188 accounts: long enough for three kills mid-stream, each after a share
    return unique_terminal_history(accounts=200, seed=7)


@pytest.mark.timeout(420)
def test_a_member_joining_and_leaving_mid_stream_changes_no_score(
    kafka_bootstrap, service_cfg, unique_frame, unique_model
):
    """Rebalance: B joins while A scores, then B leaves (stop_event); full-score parity (unique terminals)."""
    cfg = service_cfg(max_poll_records=20)
    events = transactions_from_frame(unique_frame)
    msgs = messages(events)
    n = len(events)
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=4)
    first, second = n // 3, 2 * n // 3
    produce(kafka_bootstrap, cfg.topic("transactions"), msgs[:first])

    a = Running(cfg, unique_model, kafka_bootstrap)
    wait_until(
        lambda: committed_count(kafka_bootstrap, cfg.topic("scores")) >= n // 6, "A scores a part", 120, a
    )
    b = Running(cfg, unique_model, kafka_bootstrap)
    wait_for_stable_group(kafka_bootstrap, cfg.group_id, 2, a)
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
    scores = wait_for_scores(kafka_bootstrap, cfg.topic("scores"), n, a, timeout_s=180)
    a_stats = a.stop()

    by_event = assert_exactly_once(scores, events)
    assert_same_scores(by_event, uninterrupted_scores(unique_model, events))
    assert b_stats.events_scored > 0, "the second instance never scored: no rebalance was exercised"
    assert a_stats.rebalances >= 2 and a_stats.restored_states > 0, a_stats
    assert a_stats.events_scored + b_stats.events_scored >= n


@pytest.mark.timeout(420)
def test_the_service_rides_out_a_broker_restart(
    kafka_broker, kafka_bootstrap, service_cfg, unique_frame, unique_model
):
    """The broker stops and starts on the same data under a running service, which must recover on its own."""
    # Small batches, so the service is still working through the first part when the broker goes away.
    cfg = service_cfg(max_poll_records=5)
    events = transactions_from_frame(unique_frame)
    msgs = messages(events)
    n = len(events)
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=3)
    half = n // 2
    produce(kafka_bootstrap, cfg.topic("transactions"), msgs[:half])

    running = Running(cfg, unique_model, kafka_bootstrap)
    wait_until(
        lambda: committed_count(kafka_bootstrap, cfg.topic("scores")) >= n // 8, "a part scored", 120, running
    )
    kafka_broker.restart()  # skips the test if the broker was not started by scripts/kafka.sh
    at_restart = committed_count(kafka_bootstrap, cfg.topic("scores"))
    print(f"broker restarted with {at_restart} of {half} produced events scored")
    assert running.error is None, f"serve() died during the broker restart: {running.error!r}"
    produce(kafka_bootstrap, cfg.topic("transactions"), msgs[half:])
    scores = wait_for_scores(kafka_bootstrap, cfg.topic("scores"), n, running, timeout_s=240)
    assert running.thread.is_alive(), "serve() returned on its own"
    stats = running.stop()
    print(f"after the restart: {stats}")

    by_event = assert_exactly_once(scores, events)
    assert_same_scores(by_event, uninterrupted_scores(unique_model, events))


@pytest.mark.timeout(600)
def test_three_kills_lose_nothing_and_score_nothing_twice(
    kafka_bootstrap, service_cfg, big_frame, unique_model, tmp_path
):
    """SIGKILL at random points three times, restarting each time; full-score parity (unique terminals)."""
    cfg = service_cfg(max_poll_records=50)
    events = transactions_from_frame(big_frame)
    n = len(events)
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=3)
    # The last tenth is produced only after the third kill: however fast an instance runs through the rest
    # between reaching its target and its kill, the final instance has events to score on restored states.
    head = n - n // 10
    msgs = messages(events)
    produce(kafka_bootstrap, cfg.topic("transactions"), msgs[:head])
    seed = int(os.environ.get("TXS_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    # Kill once the committed scores pass each target, after a random extra delay (inside a batch or not).
    targets = sorted(rng.uniform(0.1, 0.8) * head for _ in range(3))
    print(f"seed={seed} events={n} kill targets={[int(t) for t in targets]}")

    for i, target in enumerate(targets):
        # Each instance scores something of its own before its kill, even when targets lie close together,
        # up to the events produced so far.
        target = min(max(target, committed_count(kafka_bootstrap, cfg.topic("scores")) + n // 50), head)
        log_path = tmp_path / f"child-{i}.log"
        with open(log_path, "wb") as log_file:
            child = start_child(cfg, unique_model, kafka_bootstrap, stderr=log_file)
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

    produce(kafka_bootstrap, cfg.topic("transactions"), msgs[head:])
    scores, stats = serve_until(cfg, unique_model, kafka_bootstrap, n, timeout_s=240)
    by_event = assert_exactly_once(scores, events)
    assert stats.events_scored > 0 and stats.restored_states > 0, stats
    assert_same_scores(by_event, uninterrupted_scores(unique_model, events))
