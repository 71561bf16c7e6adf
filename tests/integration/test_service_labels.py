"""Labels and the global terminal-risk table against the real broker: labels change the terminal features
exactly as `Scorer.replay` applies them, the table (with its label positions) survives a restart, bad
labels go to dead-letter, two instances on different partitions count every event at its terminal, and a
flood of new terminal ids leaves the scorer and the table writer within max_terminals_in_memory.

Score parity uses one transactions partition (see test_service.py): terminal features depend on the global
order of events, which one partition makes the topic's order. The two-instance test checks the terminal
STATE, which is order-free, and the scores of a later instance that starts from it.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from consumers.runtime.compacted import Reader
from consumers.runtime.metrics import free_port, scrape
from consumers.runtime.topics import ensure_topics
from consumers.scoring.messages import (
    Label,
    Transaction,
    encode_label,
    encode_transaction,
    transactions_from_frame,
)
from consumers.scoring.scorer import Scorer
from consumers.terminals import feed as feed_module
from consumers.terminals.deltas import decode_deltas
from consumers.terminals.feed import FeedReader, label_batch
from consumers.terminals.table import POSITIONS_KEY, Positions, encode_terminal, pack_header, read_table
from pipeline.data.generate import GenerateConfig, generate
from pipeline.features.stream import StreamingFeaturizer
from pipeline.features.stream_batches import EventBatch, replay_batches
from pipeline.registry.tracking import load_model
from tests.integration import test_service
from tests.integration.service_helpers import (
    Running,
    assert_exactly_once,
    create_topic,
    produce,
    read_committed,
    wait_for_metric,
    wait_for_scores,
)
from tests.integration.service_runs import committed_count, serve_until, wait_for_stable_group, wait_until

# The same fixtures as test_service.py: its history, its tiny model, its per-test topic prefix.
frame, model_dir, service_cfg = test_service.frame, test_service.model_dir, test_service.service_cfg

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(180)]

TOLERANCE = 1e-5
HOUR_US = 3_600_000_000
DAY_US = 24 * HOUR_US


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


def table_of(bootstrap: str, cfg):
    reader = Reader.connect(bootstrap, "test-table")
    try:
        return read_table(
            reader, cfg.topic("terminal_table"), cfg.topic("labels"), cfg.topic("terminal_deltas"), 30
        )
    finally:
        reader.close()


def terminal_bytes(terminals) -> dict[str, bytes]:
    return {t: terminals.get_bytes(t) for t in terminals}


def test_labels_change_terminal_features_like_replay(kafka_bootstrap, service_cfg, frame, model_dir):
    port = free_port()
    cfg = service_cfg(metrics_port=port, metrics_host="127.0.0.1")
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
    # The labels are folded in before the later events arrive: every one of those events counts them.
    produce(kafka_bootstrap, cfg.topic("labels"), [(label.event_id, encode_label(label)) for label in labels])
    wait_for_metric(port, "txsentinel_labels_applied_total", len(labels), running)
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
    # The writer drained and flushed when the service stopped: the table holds every label and event.
    terminals, positions, _ = table_of(kafka_bootstrap, cfg)
    assert positions.labels == {0: len(labels)}
    reference = StreamingFeaturizer()
    for batch, batch_labels in replay_batches(labelled, 500):
        reference.transform(batch, batch_labels)
    assert terminal_bytes(terminals) == terminal_bytes(reference.terminals)


def test_a_restarted_service_restores_the_terminal_table_and_label_positions(
    kafka_bootstrap, service_cfg, frame, model_dir
):
    port = free_port()
    cfg = service_cfg(max_poll_records=10, metrics_port=port, metrics_host="127.0.0.1")
    events = transactions_from_frame(frame)
    messages = [(t.account_id, encode_transaction(t)) for t in events]
    split = split_at_new_ts(frame, len(events) // 3)
    labelled, labels = with_labels(frame, split)
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[:split])

    first = Running(cfg, model_dir, kafka_bootstrap)
    wait_for_scores(kafka_bootstrap, cfg.topic("scores"), split, first)
    produce(kafka_bootstrap, cfg.topic("labels"), [(label.event_id, encode_label(label)) for label in labels])
    wait_for_metric(port, "txsentinel_labels_applied_total", len(labels), first)
    more = split + (len(events) - split) // 3
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[split:more])
    wait_for_scores(kafka_bootstrap, cfg.topic("scores"), split + 1, first)  # past the labels
    first_stats = first.stop()
    done = len(read_committed(kafka_bootstrap, cfg.topic("scores")))
    assert split < done <= more and first_stats.labels_applied == len(labels)
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[more:])

    scores, stats = serve_until(cfg, model_dir, kafka_bootstrap, len(events))
    by_event = assert_exactly_once(scores, events)
    # Restored, not re-read: the labels' positions came back with the terminal records they are counted in.
    assert stats.restored_terminals > 0 and stats.labels_applied == 0
    assert stats.events_scored == len(events) - done
    # An uninterrupted run, terminal features included.
    assert_scores_equal(by_event, replay_scores(model_dir, labelled))


def test_a_table_whose_positions_record_is_garbage_is_rebuilt_from_the_deltas_and_what_it_held_deleted(
    kafka_bootstrap, service_cfg, frame, model_dir
):
    """Anyone who can write the table topic can break its positions record: the next start reads the table
    as empty and folds every delta and label the topics hold, scoring as if nothing had happened, and the
    writer's first flush deletes the records it left out (here a made-up terminal's), so that every reader
    after it holds what the running ones do."""
    cfg = service_cfg(max_poll_records=10)
    events = transactions_from_frame(frame)
    messages = [(t.account_id, encode_transaction(t)) for t in events]
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    split = len(events) // 2
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[:split])
    serve_until(cfg, model_dir, kafka_bootstrap, split)
    terminals, _, _ = table_of(kafka_bootstrap, cfg)
    sound = encode_terminal(terminals.get_bytes(next(iter(terminals))))
    produce(kafka_bootstrap, cfg.topic("terminal_table"), [("ghost", sound), (POSITIONS_KEY, b"{not json")])
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[split:])

    scores, _ = serve_until(cfg, model_dir, kafka_bootstrap, len(events))

    assert_scores_equal(assert_exactly_once(scores, events), replay_scores(model_dir, frame))
    terminals, positions, left_out = table_of(kafka_bootstrap, cfg)
    assert "ghost" not in terminals and left_out == [] and positions.deltas
    assert set(terminals) == {t.terminal_id for t in events}


def test_bad_labels_and_delta_records_go_to_dead_letter_and_good_ones_apply(
    kafka_bootstrap, service_cfg, frame, model_dir
):
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
    bad_deltas = {b"garbage": "bad magic", pack_header(b"TXD1") + b"[1": "does not decode"}
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    create_topic(kafka_bootstrap, cfg.topic("labels"), partitions=2)
    produce(kafka_bootstrap, cfg.topic("labels"), [("k", encode_label(good))] + [("k", v) for v in bad])
    messages = [(t.account_id, encode_transaction(t)) for t in events]
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[:20])

    running = Running(cfg, model_dir, kafka_bootstrap)
    wait_for_scores(kafka_bootstrap, cfg.topic("scores"), 20, running)
    # Records in the deltas topic that no txsentinel wrote: every reader skips them, none stops.
    produce(kafka_bootstrap, cfg.topic("terminal_deltas"), [("intruder", v) for v in bad_deltas])
    produce(kafka_bootstrap, cfg.topic("transactions"), messages[20:])
    wait_for_scores(kafka_bootstrap, cfg.topic("scores"), len(events), running)
    assert running.thread.is_alive() and running.error is None, "a bad label or delta stopped the service"
    stats = running.stop()  # the table writer, which dead-letters them, flushes on the way out
    dead = [json.loads(r.value) for r in read_committed(kafka_bootstrap, cfg.topic("dead_letter"))]

    expected = {(cfg.topic("labels"), why) for why in bad.values()}
    expected |= {(cfg.topic("terminal_deltas"), why) for why in bad_deltas.values()}
    assert len(dead) == len(expected) and stats.dead_lettered == len(expected) and stats.labels_applied == 1
    for topic, why in expected:
        assert any(d["source_topic"] == topic and why in d["reason"] for d in dead), f"no {topic}: {why!r}"


def test_an_external_table_writer_keeps_the_table_when_no_instance_runs_one(
    kafka_bootstrap, service_cfg, frame, model_dir, tmp_path
):
    """`txsentinel terminal-writer` as docs/operations.md shows it, beside a service with terminal_table_writer
    external: no instance flushes, the command does, and it exits 0 on SIGTERM after a last flush."""
    cfg = service_cfg(terminal_table_writer="external", terminal_table_flush_s=0.5)
    events = transactions_from_frame(frame)
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    produce(
        kafka_bootstrap, cfg.topic("transactions"), [(t.account_id, encode_transaction(t)) for t in events]
    )
    command = [
        str(Path(sys.executable).parent / "txsentinel"), "terminal-writer", "--bootstrap-servers", kafka_bootstrap,
        "--group-id", cfg.group_id, "--set", f"topic_prefix={cfg.topic_prefix}", "--set", "terminal_table_flush_s=0.5",
    ]  # fmt: skip
    log_path = tmp_path / "writer.log"
    with log_path.open("w") as sink:
        writer = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        _, serve_stats = serve_until(cfg, model_dir, kafka_bootstrap, len(events))
    finally:
        writer.send_signal(signal.SIGTERM)
        code = writer.wait(timeout=60)
    assert code == 0, f"terminal-writer exited {code} on SIGTERM:\n{log_path.read_text()[-3000:]}"

    assert serve_stats.terminal_table_flushes == 0, "an instance ran the writer although it is external"
    terminals, positions, _ = table_of(kafka_bootstrap, cfg)
    reference = StreamingFeaturizer()
    for batch, _ in replay_batches(frame, 500):  # no labels were streamed
        reference.transform(batch)
    assert terminal_bytes(terminals) == terminal_bytes(reference.terminals) and positions.deltas


def test_a_flood_of_new_terminal_ids_keeps_every_holder_within_the_cap_and_every_event_is_scored(
    kafka_bootstrap, service_cfg, model_dir, caplog
):
    """Forty terminals in the table, then a flood of valid events each at a terminal never seen: after
    every batch the scorer holds at most the cap, the table writer lets those with the least history go (the
    forty first: an event each, as the flood's, but older) and deletes them with tombstones, both say so, and
    every event is scored."""
    cap, port = 50, free_port()
    cfg = service_cfg(
        max_terminals_in_memory=cap, terminal_table_flush_s=0.5, metrics_port=port, metrics_host="127.0.0.1"
    )
    now_us = time.time_ns() // 1000
    early = [
        Transaction(
            f"early-{i}", f"early-account-{i % 5}", now_us - 2 * DAY_US + i, 20.0, f"early-terminal-{i}"
        )
        for i in range(40)
    ]  # two days before the flood: as little history as the flood's terminals, and older
    flood = [
        Transaction(f"flood-{i}", f"flood-account-{i % 17}", now_us - HOUR_US + i, 10.0 + i % 7, f"flood-{i}")
        for i in range(400)
    ]
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=1)
    held = []  # the scorer's terminals, as its gauge says after each part of the flood

    def scored(events: list[Transaction], running: Running, total: int) -> None:
        produce(
            kafka_bootstrap,
            cfg.topic("transactions"),
            [(t.account_id, encode_transaction(t)) for t in events],
        )
        wait_until(
            lambda: committed_count(kafka_bootstrap, cfg.topic("scores")) >= total,
            f"{total} scores",
            60,
            running,
        )

    with caplog.at_level(logging.ERROR, logger="consumers.terminals.idle"):
        running = Running(cfg, model_dir, kafka_bootstrap)
        scored(early, running, len(early))
        wait_until(
            lambda: len(table_of(kafka_bootstrap, cfg)[0]) == len(early),
            "the table writer flushed",
            30,
            running,
        )
        for part in range(0, len(flood), 50):
            scored(flood[part : part + 50], running, len(early) + part + 50)
            held.append(scrape(port, "txsentinel_terminals_in_memory"))
        capped = scrape(port, 'txsentinel_terminals_capped_total{holder="scorer"}')
        stats = running.stop()  # the writer drains and flushes on the way out
    scores = [json.loads(r.value) for r in read_committed(kafka_bootstrap, cfg.topic("scores"))]

    assert_exactly_once(scores, early + flood)
    assert all(math.isfinite(s["score"]) for s in scores) and stats.dead_lettered == 0
    assert max(held) <= cap and min(held[1:]) >= math.ceil(0.9 * cap), held
    assert 0 < capped <= stats.terminals_capped and stats.terminals_capped >= len(early + flood) - cap
    terminals, _, _ = table_of(kafka_bootstrap, cfg)
    assert 0 < len(terminals) <= cap and not any(t.startswith("early-") for t in terminals)
    tombstones = {
        r.key.decode()
        for r in read_committed(kafka_bootstrap, cfg.topic("terminal_table"))
        if r.value is None
    }
    assert {t.terminal_id for t in early} <= tombstones
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    for holder in ("scorer", "writer"):
        assert any(f"holder={holder} max_terminals_in_memory={cap}" in e for e in errors), (holder, errors)


@pytest.mark.timeout(300)
def test_two_instances_count_every_event_at_its_terminal(kafka_bootstrap, service_cfg, model_dir):
    """A and B split 4 partitions of a history whose accounts share terminals, with fraud labels mixed in
    (each twice).
    Then new accounts, one at each terminal, must score as with a scorer that saw the whole history: on A
    and B while they run (each has folded in the other's deltas), and on C, which starts after they stop,
    from the table plus the deltas after it. And the table plus those deltas is the terminal state of EVERY
    event and label, not one instance's share."""
    cfg = service_cfg(max_poll_records=50, terminal_table_flush_s=0.5)
    history = generate(GenerateConfig(accounts=150, days=10, seed=21)).sort("ts", "event_id")
    events = transactions_from_frame(history)
    terminals = sorted(set(history["terminal_id"].to_list()))
    assert len(events) > 800 and len(events) > 5 * len(terminals)  # terminals are shared across accounts
    split = split_at_new_ts(history, len(events) // 2)
    labelled, labels = with_labels(history, split)
    create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=4)
    create_topic(kafka_bootstrap, cfg.topic("labels"), partitions=4)

    def newcomers(tag: str, days_later: int) -> list[Transaction]:
        at = int(history["ts"].max().timestamp() * 1e6) + days_later * 86_400_000_000
        return [
            Transaction(f"{tag}-{i}", f"{tag}-account-{i}", at + i, 42.0 + i, terminal)
            for i, terminal in enumerate(terminals)
        ]

    def scored(messages: list[Transaction], running: Running, total: int) -> dict[str, dict]:
        produce(
            kafka_bootstrap,
            cfg.topic("transactions"),
            [(t.account_id, encode_transaction(t)) for t in messages],
        )
        return {
            s["event_id"]: s for s in wait_for_scores(kafka_bootstrap, cfg.topic("scores"), total, running)
        }

    ports = free_port(), free_port()
    a, b = (
        Running(replace(cfg, metrics_host="127.0.0.1", metrics_port=p), model_dir, kafka_bootstrap)
        for p in ports
    )
    wait_for_stable_group(kafka_bootstrap, cfg.group_id, 2, a)
    # Every label comes twice: first a repeat dated two days later, keyed by account (so on another
    # partition), then the label itself. A reader that folds the repeat first counts the report two days
    # late and moves it back when the label comes: each event is reported once, on the label's day.
    repeats = [replace(label, label_ts_us=label.label_ts_us + 2 * 86_400_000_000) for label in labels]
    produce(
        kafka_bootstrap,
        cfg.topic("labels"),
        [(label.account_id, encode_label(label)) for label in repeats]
        + [(label.event_id, encode_label(label)) for label in labels],
    )
    scored(events, a, len(events))
    # Idle now. Each instance folds in every delta record the other wrote (and never its own), so once both
    # have caught up their counts add up to the records the topic holds.
    written = len(read_committed(kafka_bootstrap, cfg.topic("terminal_deltas")))
    applied = "txsentinel_terminal_deltas_applied_total"
    wait_until(
        lambda: sum(scrape(port, applied) for port in ports) >= written,
        "both folded in the other's deltas",
        60,
        a,
    )
    first = newcomers("first", 1)
    live = scored(first, a, len(events) + len(first))
    a_stats, b_stats = a.stop(), b.stop()
    assert a_stats.events_scored > 0 and b_stats.events_scored > 0, "one instance scored everything"
    assert a_stats.terminal_deltas_applied > 0 and b_stats.terminal_deltas_applied > 0
    assert a_stats.terminal_table_flushes + b_stats.terminal_table_flushes > 0

    everything = StreamingFeaturizer()
    for batch, batch_labels in replay_batches(labelled, 500):
        everything.transform(batch, batch_labels)
    # The repeats count nothing more (each report stays on its label's day), but each remembered event
    # keeps its newest label, which is the repeat's: the table holds that too.
    everything.observe_labels(label_batch(repeats))
    everything.transform(
        EventBatch(
            [t.account_id for t in first],
            [t.terminal_id for t in first],
            np.array([t.ts_us for t in first]),
            np.array([t.amount for t in first]),
        )
    )
    table, positions, _ = table_of(kafka_bootstrap, cfg)
    restored = StreamingFeaturizer()
    restored.terminals = table
    deltas = [
        decode_deltas("test", r.value)
        for r in read_committed(kafka_bootstrap, cfg.topic("terminal_deltas"))
        if r.offset >= positions.deltas.get(r.partition, 0)
    ]
    restored.apply_terminal_ops(deltas)
    assert terminal_bytes(restored.terminals) == terminal_bytes(everything.terminals)

    second = newcomers("second", 2)
    c = Running(cfg, model_dir, kafka_bootstrap)
    later = scored(second, c, len(events) + len(first) + len(second))
    c.stop()

    reference = Scorer(load_model(model_dir))
    reference.score(events)
    reference.observe_labels(label_batch(labels))
    expected = {"first": reference.score(first), "second": reference.score(second)}
    for got, tag in ((live, "first"), (later, "second")):
        worst = max(abs(got[r.event_id]["score"] - r.score) for r in expected[tag])
        assert worst <= TOLERANCE, (
            f"a {tag} newcomer's score differs from the whole-history scorer's by {worst:.3g}"
        )
    half = Scorer(load_model(model_dir))
    half.score(events[::2])
    half.observe_labels(label_batch(labels))
    moved = max(abs(r.score - h.score) for r, h in zip(expected["first"], half.score(first), strict=True))
    assert moved > 1e-4, "half the terminal counts give the same scores: the test could not see them missing"


def test_a_fraud_label_dated_on_a_day_to_come_waits_at_its_position_for_that_day(
    kafka_bootstrap, service_cfg, monkeypatch
):
    """consumers/terminals/feed.py's wait on a real consumer: read by a clock at 23:30 the day before, the
    first of three labels (sent now, dated a minute ago) pauses its partition, whose position, and so the
    table's, stays before it while a read to the high watermarks still ends; once the clock reaches its day
    it and the labels after it are read, once each."""
    cfg = service_cfg()
    ensure_topics(cfg, kafka_bootstrap)
    now_us = time.time_ns() // 1000
    labels = [Label(f"E{i}", "A1", f"T{i}", True, now_us - 60_000_000) for i in range(3)]
    produce(kafka_bootstrap, cfg.topic("labels"), [("A1", encode_label(label)) for label in labels])
    clock = [(now_us // DAY_US) * DAY_US - HOUR_US // 2]  # 23:30 the day before the labels'
    fake = type("Clock", (), {"time_ns": lambda: clock[0] * 1000, "monotonic": time.monotonic})
    monkeypatch.setattr(feed_module, "time", fake)
    held = []
    offsets = Reader.connect(kafka_bootstrap, "test-wait")
    feed = FeedReader.connect(
        kafka_bootstrap, "test-wait-feed", offsets, cfg.topic("labels"), cfg.topic("terminal_deltas"), 30.0,
        on_held=lambda: held.append(1),
    )  # fmt: skip
    try:
        feed.seek(Positions())
        waiting = feed.read(to_high_watermark=True)
        at = feed.positions().labels
        clock[0] = now_us
        read = feed.read(to_high_watermark=True)
        again = feed.read(to_high_watermark=True)
        after = feed.positions().labels
    finally:
        feed.close()
        offsets.close()
    assert waiting.labels == [] and waiting.bad == [] and held == [1]
    assert set(at.values()) == {0}  # the partition waits before the label; the others hold none
    assert read.labels == labels and again.labels == [] and sorted(after.values())[-1] == len(labels)
