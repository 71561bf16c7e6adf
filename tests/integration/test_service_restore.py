"""Restores that stay cheap, against the project's real Kafka broker (no mocks):

(a) a member joins: the group's cooperative sticky assignor moves only some partitions to it; the first
    member keeps the others and their states in memory, reading no changelog record, and the newcomer reads
    only the changelog partitions that moved;
(b) a batch's commit fails: only that batch's accounts leave memory and come back from their last committed
    records; no changelog partition is read again, and every event is still scored exactly once, with the
    scores (and so the states) of an uninterrupted run.

Scores are compared in full with one terminal per event (see test_service_resilience.py for why that makes
them independent of how partitions interleave).
"""

from __future__ import annotations

import itertools
import json

import pytest
from kafka.errors import KafkaConnectionError

from consumers.scoring.account_state import decode_account_record
from consumers.scoring.messages import transactions_from_frame
from consumers.service.commit_pipeline import TransactionPipeline
from tests.integration.service_helpers import (
    Running,
    assert_exactly_once,
    assert_same_scores,
    create_topic,
    produce,
    read_committed,
    wait_for_scores,
)
from tests.integration.service_runs import (
    FAST,
    committed_count,
    messages,
    service_configs,
    uninterrupted_scores,
    wait_for_stable_group,
    wait_until,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

service_cfg = service_configs("rst", **FAST)


@pytest.mark.timeout(420)
def test_partitions_that_stay_keep_their_states_and_only_moved_ones_are_read(
    kafka_bootstrap, service_cfg, unique_frame, unique_model
):
    cfg = service_cfg(max_poll_records=20)
    events = transactions_from_frame(unique_frame)
    msgs, n = messages(events), len(events)
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=4)
    half = n // 2
    produce(kafka_bootstrap, cfg.topic("transactions"), msgs[:half])
    a = Running(cfg, unique_model, kafka_bootstrap)
    wait_for_scores(
        kafka_bootstrap, cfg.topic("scores"), half, a, timeout_s=180
    )  # every partition has states
    b = Running(cfg, unique_model, kafka_bootstrap)
    wait_for_stable_group(kafka_bootstrap, cfg.group_id, 2, a)
    produce(kafka_bootstrap, cfg.topic("transactions"), msgs[half:])
    scores = wait_for_scores(kafka_bootstrap, cfg.topic("scores"), n, a, timeout_s=240)
    b_stats, a_stats = b.stop(), a.stop()

    by_event = assert_exactly_once(scores, events)
    assert_same_scores(by_event, uninterrupted_scores(unique_model, events))
    assert b_stats.events_scored > 0, "the second member never scored: no partition moved"
    assert a_stats.rebalances >= 1 and a_stats.changelog_records_read == 0, a_stats  # kept, not reread
    changelog = read_committed(kafka_bootstrap, cfg.topic("changelog"))
    assert 0 < b_stats.changelog_records_read < len(changelog), b_stats  # only the partitions that moved
    assert b_stats.restored_states > 0


@pytest.mark.timeout(300)
def test_an_aborted_batch_reloads_only_its_accounts_and_scores_stay_exactly_once(
    kafka_bootstrap, service_cfg, unique_frame, unique_model, monkeypatch
):
    cfg = service_cfg(max_poll_records=40)
    events = transactions_from_frame(unique_frame)
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    produce(kafka_bootstrap, cfg.topic("transactions"), messages(events))
    commit, calls = TransactionPipeline._commit, itertools.count()

    def fails_once(self, offsets, group_metadata):  # the fourth batch's commit: the broker went away
        if next(calls) == 3:
            raise KafkaConnectionError("injected: connection lost during the commit")
        return commit(self, offsets, group_metadata)

    monkeypatch.setattr(TransactionPipeline, "_commit", fails_once)
    running = Running(cfg, unique_model, kafka_bootstrap)
    wait_until(
        lambda: committed_count(kafka_bootstrap, cfg.topic("scores")) >= len(events), "all", 180, running
    )
    stats = running.stop()

    scores = [json.loads(r.value) for r in read_committed(kafka_bootstrap, cfg.topic("scores"))]
    by_event = assert_exactly_once(scores, events)
    assert_same_scores(by_event, uninterrupted_scores(unique_model, events))
    assert stats.aborted_batches == 1, stats
    # Two batches of at most 40 events were undone (the failed one and the one scored meanwhile): their
    # accounts left memory and came back from their records; no partition was read again.
    assert 0 < stats.states_rewound <= 80 and stats.states_reloaded >= 1, stats
    assert stats.changelog_records_read == 0 and stats.restored_states == 0, stats
    # Every account's last state record is that of its last event (offsets: one partition, topic order).
    last = {t.account_id: i for i, t in enumerate(events)}
    changelog = {r.key.decode(): r.value for r in read_committed(kafka_bootstrap, cfg.topic("changelog"))}
    assert {a: decode_account_record(v, a).offset for a, v in changelog.items()} == last
