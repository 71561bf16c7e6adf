"""Labels and the global terminal-risk table against the real broker: labels change the terminal features
exactly as `Scorer.replay` applies them, the table (with its label positions) survives a restart, and bad
labels go to dead-letter.

One transactions partition (see test_service.py): the terminal table is shared by all accounts, so its
values depend on the global order of events, which one partition makes the topic's order.
"""

from __future__ import annotations

import json

import polars as pl
import pytest

from consumers.messages import Label, encode_label, encode_transaction, transactions_from_frame
from consumers.scorer import Scorer
from consumers.terminal_table import TerminalTable
from pipeline.artifact import load_model
from pipeline.features.stream import StreamingFeaturizer
from tests.integration import test_service
from tests.integration.service_helpers import (
    Running,
    assert_exactly_once,
    create_topic,
    produce,
    read_committed,
    wait_for_scores,
)

# The same fixtures as test_service.py: its history, its tiny model, its per-test topic prefix.
frame, model_dir, service_cfg = test_service.frame, test_service.model_dir, test_service.service_cfg

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(180)]

TOLERANCE = 1e-5


def with_labels(history: pl.DataFrame, split: int) -> tuple[pl.DataFrame, list[Label]]:
    """Fraud labels for every terminal seen after `split`, all known at the ts of event `split`.

    Returns the frame with is_fraud/label_ts set to exactly those labels (what replay applies) and the
    labels to produce, plus two not-fraud labels (which change nothing).
    """
    label_us = history["ts"].dt.epoch("us")[split]
    assert history["ts"].dt.epoch("us")[split - 1] < label_us, "pick a split between two timestamps"
    rest = history[split:]
    first_of_terminal = rest.unique("terminal_id", keep="first", maintain_order=True)
    fraud_ids = set(first_of_terminal["event_id"].to_list())
    labels = [
        Label(r["event_id"], r["account_id"], r["terminal_id"], True, label_us)
        for r in first_of_terminal.iter_rows(named=True)
    ]
    labels += [
        Label(r["event_id"], r["account_id"], r["terminal_id"], False, label_us)
        for r in history[:2].iter_rows(named=True)
    ]
    labelled = history.with_columns(
        is_fraud=pl.col("event_id").is_in(list(fraud_ids)),
        label_ts=pl.when(pl.col("event_id").is_in(list(fraud_ids)))
        .then(pl.lit(label_us).cast(pl.Datetime("us", "UTC")).cast(history["ts"].dtype))
        .otherwise(None),
    )
    return labelled, labels


def split_at_new_ts(history: pl.DataFrame, near: int) -> int:
    ts = history["ts"].to_list()
    while ts[near - 1] == ts[near]:
        near += 1
    return near


def replay_scores(model_uri: str, history: pl.DataFrame) -> dict[str, float]:
    out = Scorer(load_model(model_uri)).replay(history, batch_events=500)
    return dict(zip(out["event_id"].to_list(), out["score"].to_list(), strict=True))


def assert_scores_equal(by_event: dict[str, dict], reference: dict[str, float]) -> None:
    worst = max(abs(by_event[e]["score"] - s) for e, s in reference.items())
    assert worst <= TOLERANCE, f"service scores differ from Scorer.replay's by up to {worst:.3g}"


def test_labels_change_terminal_features_like_replay(kafka_bootstrap, service_cfg, frame, model_dir):
    cfg = service_cfg()
    events = transactions_from_frame(frame)
    split = split_at_new_ts(frame, len(events) // 3)
    labelled, labels = with_labels(frame, split)
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    produce(
        kafka_bootstrap,
        cfg.topic("transactions"),
        [(t.account_id, encode_transaction(t)) for t in events[:split]],
    )

    running = Running(cfg, model_dir, kafka_bootstrap)
    wait_for_scores(kafka_bootstrap, cfg.topic("scores"), split, running)
    # The labels are committed before the later events: the batch that reads those events applies them first.
    produce(kafka_bootstrap, cfg.topic("labels"), [(label.event_id, encode_label(label)) for label in labels])
    produce(
        kafka_bootstrap,
        cfg.topic("transactions"),
        [(t.account_id, encode_transaction(t)) for t in events[split:]],
    )
    scores = wait_for_scores(kafka_bootstrap, cfg.topic("scores"), len(events), running)
    stats = running.stop()

    by_event = assert_exactly_once(scores, events)
    assert stats.labels_applied == len(labels) and stats.dead_lettered == 0
    with_reports = replay_scores(model_dir, labelled)
    assert_scores_equal(by_event, with_reports)
    without = replay_scores(model_dir, frame.with_columns(is_fraud=pl.lit(False)))
    moved = max(abs(with_reports[t.event_id] - without[t.event_id]) for t in events[split:])
    assert moved > 1e-4, "the labels did not change any score: the test would not see them ignored"
    # The table, committed with the scores, reads back as every terminal and the label positions.
    table = {r.key.decode(): r.value for r in read_committed(kafka_bootstrap, cfg.topic("terminal_table"))}
    restored = StreamingFeaturizer()
    positions = TerminalTable(restored, 100, "reader").restore(table, cfg.topic("labels"))
    assert set(restored.terminals) == set(frame["terminal_id"].to_list())
    assert positions == {0: len(labels)}


def test_a_restarted_service_restores_the_terminal_table_and_label_positions(
    kafka_bootstrap, service_cfg, frame, model_dir
):
    cfg = service_cfg(max_poll_records=10)
    events = transactions_from_frame(frame)
    messages = [(t.account_id, encode_transaction(t)) for t in events]
    split = split_at_new_ts(frame, len(events) // 3)
    labelled, labels = with_labels(frame, split)
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[:split])

    first = Running(cfg, model_dir, kafka_bootstrap)
    wait_for_scores(kafka_bootstrap, cfg.topic("scores"), split, first)
    produce(kafka_bootstrap, cfg.topic("labels"), [(label.event_id, encode_label(label)) for label in labels])
    more = split + (len(events) - split) // 3
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[split:more])
    wait_for_scores(kafka_bootstrap, cfg.topic("scores"), split + 1, first)  # past the labels
    first_stats = first.stop()
    done = len(read_committed(kafka_bootstrap, cfg.topic("scores")))
    assert split < done <= more and first_stats.labels_applied == len(labels)
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[more:])

    second = Running(cfg, model_dir, kafka_bootstrap)
    scores = wait_for_scores(kafka_bootstrap, cfg.topic("scores"), len(events), second)
    stats = second.stop()
    by_event = assert_exactly_once(scores, events)
    # Restored, not re-read: the labels' positions came back with the terminal records they are counted in.
    assert stats.restored_terminals > 0 and stats.labels_applied == 0
    assert stats.events_scored == len(events) - done
    # An uninterrupted run, terminal features included.
    assert_scores_equal(by_event, replay_scores(model_dir, labelled))


def test_a_bad_label_goes_to_dead_letter_and_good_ones_apply(kafka_bootstrap, service_cfg, frame, model_dir):
    cfg = service_cfg()
    events = transactions_from_frame(frame.head(40))
    good = Label(events[0].event_id, events[0].account_id, events[0].terminal_id, True, events[0].ts_us)
    good_json = json.loads(encode_label(good))
    bad = {
        b"{not json": "not valid UTF-8 JSON",
        json.dumps({**good_json, "is_fraud": "yes"}).encode(): "expected true or false",
        json.dumps(
            {k: v for k, v in good_json.items() if k != "label_ts"}
        ).encode(): "missing required field",
        None: "null value",
    }
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    create_topic(kafka_bootstrap, cfg.topic("labels"), partitions=2)
    produce(kafka_bootstrap, cfg.topic("labels"), [("k", encode_label(good))] + [("k", v) for v in bad])
    produce(
        kafka_bootstrap, cfg.topic("transactions"), [(t.account_id, encode_transaction(t)) for t in events]
    )

    running = Running(cfg, model_dir, kafka_bootstrap)
    wait_for_scores(kafka_bootstrap, cfg.topic("scores"), len(events), running)
    dead = [json.loads(r.value) for r in read_committed(kafka_bootstrap, cfg.topic("dead_letter"))]
    assert running.thread.is_alive() and running.error is None, "a bad label stopped the service"
    stats = running.stop()

    assert len(dead) == len(bad) and stats.dead_lettered == len(bad) and stats.labels_applied == 1
    for expected in bad.values():
        assert any(expected in d["reason"] for d in dead), f"no dead letter says {expected!r}: {dead}"
    assert {d["source_topic"] for d in dead} == {cfg.topic("labels")}
