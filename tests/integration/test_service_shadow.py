"""A shadow challenger against the project's real Kafka broker (no mocks): both models step every event in
one transaction, the challenger never alerts, and promoting it (restart with it as the model) continues from
the states it built in shadow, scoring exactly what it would have scored alone; a restart with the challenger
still in shadow restores both models' states."""

from __future__ import annotations

import json

import pytest

from consumers.scoring.messages import Label, encode_label, transactions_from_frame
from consumers.scoring.scorer import Scorer
from consumers.service.shadow import shadow_changelog
from pipeline.evaluation.live_compare import LiveCompareConfig, live_compare
from pipeline.registry.tracking import load_model
from tests.integration.service_helpers import (
    Running,
    assert_exactly_once,
    assert_same_scores,
    create_topic,
    prefixed_configs,
    produce,
    read_committed,
    save_tiny_model,
    wait_for_scores,
)
from tests.integration.service_runs import FAST, messages, serve_until, unique_terminal_history

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture(scope="module")
def frame():
    return unique_terminal_history(accounts=40, seed=5)


@pytest.fixture(scope="module")
def models(tmp_path_factory, frame):
    out = tmp_path_factory.mktemp("models")
    champion = save_tiny_model(frame, 20, out / "champion", "champion-1", seed=0)
    challenger = save_tiny_model(frame, 20, out / "challenger", "challenger-2", seed=1)
    return champion, challenger


@pytest.mark.timeout(420)
def test_promoted_shadow_scores_as_the_challenger_alone(kafka_bootstrap, frame, models):
    champion, challenger = models
    events = transactions_from_frame(frame)
    msgs, n = messages(events), len(events)
    first, second = n // 2, 3 * n // 4
    alone = Scorer(load_model(challenger), reasons=0).score(events)  # the challenger from the start
    served = Scorer(load_model(champion), reasons=0).score(events[:second])
    with prefixed_configs(kafka_bootstrap, "shd", **FAST) as make:
        cfg = make(max_poll_records=50)
        create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=2)

        def serve_both(count: int) -> tuple[list[dict], list[dict]]:
            """Champion and challenger in shadow until both scored `count` events: (scores, shadow scores)."""
            running = Running(cfg, champion, kafka_bootstrap, shadow=challenger)
            wait_for_scores(kafka_bootstrap, cfg.topic("scores"), count, running, timeout_s=180)
            shadow = wait_for_scores(
                kafka_bootstrap, cfg.topic("shadow_scores"), count, running, timeout_s=60
            )
            running.stop()
            served = [json.loads(r.value) for r in read_committed(kafka_bootstrap, cfg.topic("scores"))]
            return served, shadow

        produce(kafka_bootstrap, cfg.topic("transactions"), msgs[:first])
        scores, shadow_scores = serve_both(first)
        assert_same_scores(assert_exactly_once(scores, events[:first]), served[:first])
        by_event = assert_exactly_once(shadow_scores, events[:first])
        assert_same_scores(by_event, alone[:first])
        assert {s["model_version"] for s in shadow_scores} == {"challenger-2"}
        alerts = [json.loads(r.value) for r in read_committed(kafka_bootstrap, cfg.topic("alerts"))]
        assert len(alerts) == sum(r.alert for r in served[:first])  # the champion's alerts only
        assert all(a["model_version"] == "champion-1" for a in alerts)
        fingerprint = Scorer(load_model(challenger), reasons=0).model_fingerprint
        states = read_committed(kafka_bootstrap, shadow_changelog(cfg, fingerprint))
        assert {r.key.decode() for r in states} == {t.account_id for t in events[:first]}

        # A restart with the challenger still in shadow reads both changelogs back: each model goes on
        # from its own states, as if it had never stopped.
        produce(kafka_bootstrap, cfg.topic("transactions"), msgs[first:second])
        scores, shadow_scores = serve_both(second)
        assert_same_scores(assert_exactly_once(scores, events[:second]), served)
        assert_same_scores(assert_exactly_once(shadow_scores, events[:second]), alone[:second])

        # Promotion: the challenger is the model now; it restores the states it built in shadow.
        produce(kafka_bootstrap, cfg.topic("transactions"), msgs[second:])
        _, stats = serve_until(cfg, challenger, kafka_bootstrap, n, timeout_s=180)
        assert stats.restored_states == len({t.account_id for t in events[:second]})
        scores = [json.loads(r.value) for r in read_committed(kafka_bootstrap, cfg.topic("scores"))]
        after = [s for s in scores if s["model_version"] == "challenger-2"]
        assert_same_scores(assert_exactly_once(after, events[second:]), alone[second:])

        # The live comparison joins both score topics with the labels that have arrived.
        fraud = {t.event_id: i % 10 == 0 for i, t in enumerate(events)}  # any labels do: the join is checked
        labels = [
            (
                t.account_id,
                encode_label(
                    Label(t.event_id, t.account_id, t.terminal_id, bool(fraud[t.event_id]), t.ts_us)
                ),
            )
            for t in events
        ]
        produce(kafka_bootstrap, cfg.topic("labels"), labels)
        table = live_compare(cfg, kafka_bootstrap, LiveCompareConfig(since_days=1, k=5, log_to_mlflow=False))
        served, shadow = table.rows(named=True)
        assert (served["role"], served["events"], shadow["role"], shadow["events"]) == (
            "served",
            n,
            "shadow",
            second,
        )
        assert shadow["model_version"] == "challenger-2"
        assert shadow["frauds"] == sum(fraud[t.event_id] for t in events[:second]) > 0
        assert 0 <= shadow["ap"] <= 1 and 0 <= shadow["cp_at_5"] <= 1
