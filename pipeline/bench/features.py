"""`txsentinel bench features` and `bench replay`: featurizer throughput, and history replayed through the
live scorer, on one core (pipeline/bench/cores.py pins it before this module is imported), printed as tables.
"""

import os
import platform
import time
import tracemalloc

import numpy as np
import polars as pl
import torch

from consumers.scoring.scorer import Scorer
from consumers.terminals.idle import TerminalEviction
from models.registry import build_detector
from pipeline.data.generate import GenerateConfig, generate
from pipeline.features import StreamingFeaturizer, compute_features, fit_feature_spec, replay_batches
from pipeline.features.definitions import TERMINAL_ID_CACHE, terminal_code, terminal_hashes
from pipeline.features.state import ACCOUNT_STATE, TERMINAL_STATE, StateTable
from pipeline.features.stream_batches import LabelBatch
from pipeline.registry.artifact import LoadedModel


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'} core(s) used"


def run_feature_bench(
    events: int, batch_events: int, seed: int, terminals: int = 1_000_000
) -> dict[str, float]:
    accounts = 5000
    # ~1.9 events per account-day in the generator's default shape; a little extra, then cut to `events`.
    days = max(30, int(events / (accounts * 1.8)) + 2)
    frame = generate(GenerateConfig(accounts=accounts, days=days, seed=seed)).head(events)
    print(
        f"featurizing {frame.height:,} generated events ({accounts:,} accounts, {days} days) on {_machine()}"
    )

    compute_features(frame.head(10_000))  # warm-up: polars plans, numpy paths
    started = time.perf_counter()
    compute_features(frame)
    batch_s = time.perf_counter() - started

    batches = list(replay_batches(frame, batch_events))
    featurizer = StreamingFeaturizer()
    latencies = np.empty(len(batches))
    started = time.perf_counter()
    for i, (event_batch, labels) in enumerate(batches):
        t = time.perf_counter()
        featurizer.transform(event_batch, labels)
        latencies[i] = time.perf_counter() - t
    stream_s = time.perf_counter() - started

    labels, label_s = _fold_labels_twice(frame, batch_events)
    per_terminal = _bytes_per_terminal_held(TERMINALS_HELD)
    spread_s, one_day_s = (_seconds_to_let_go(terminals, same_day) for same_day in (False, True))
    cache_bytes = _bytes_of_the_id_cache(terminals)
    results = {
        "batch_events_per_s": frame.height / batch_s,
        "stream_events_per_s": frame.height / stream_s,
        "stream_batch_p50_ms": float(np.percentile(latencies, 50) * 1e3),
        "stream_batch_p99_ms": float(np.percentile(latencies, 99) * 1e3),
        "fraud_labels_per_s": labels / label_s if labels else float("nan"),
        "bytes_per_terminal_held": per_terminal,
        "cap_s_per_million_spread": spread_s / terminals * 1e6,
        "cap_s_per_million_one_day": one_day_s / terminals * 1e6,
        "id_cache_full_bytes": cache_bytes,
    }
    table = pl.DataFrame(
        {
            "measure": [
                "batch features (polars + numba kernels), events/s",
                f"streaming featurizer, micro-batches of {batch_events}, events/s",
                "streaming micro-batch latency p50 / p99, ms",
                f"fraud labels folded between batches, each given twice ({labels // 2:,} events), labels/s",
                "state per account / per terminal, bytes",
                f"memory per terminal held ({TERMINALS_HELD:,}, 10-character ids), bytes",
                f"cap letting 10% of {terminals:,} go (active over 60 days / one day), s a million",
                f"terminal-id hash cache when full ({TERMINAL_ID_CACHE:,} 10-character ids), MB",
            ],
            "value": [
                f"{results['batch_events_per_s']:,.0f}",
                f"{results['stream_events_per_s']:,.0f}",
                f"{results['stream_batch_p50_ms']:.2f} / {results['stream_batch_p99_ms']:.2f}",
                f"{results['fraud_labels_per_s']:,.0f}",
                f"{ACCOUNT_STATE.itemsize} / {TERMINAL_STATE.itemsize}",
                f"{results['bytes_per_terminal_held']:,.0f}",
                f"{results['cap_s_per_million_spread']:.2f} / {results['cap_s_per_million_one_day']:.2f}",
                f"{cache_bytes / 1e6:,.0f}",
            ],
            "target": [">= 1,000,000", ">= 100,000", "", "", "", "", "", ""],
        }
    )
    with pl.Config(tbl_hide_dataframe_shape=True, tbl_width_chars=120, fmt_str_lengths=80):
        print(table)
    return results


TERMINALS_HELD = 100_000


def _bytes_per_terminal_held(terminals: int) -> float:
    """What a terminal table holding `terminals` takes a terminal, by tracemalloc: the records (the table
    capped at that count, so they stop growing at its row limit, as a service's do) and the dict of ids."""
    table = StateTable(TERMINAL_STATE)
    table.row_limit = TerminalEviction(0, max_terminals=terminals).row_limit
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for start in range(0, terminals, 500):
            table.slots([f"T{i:09d}" for i in range(start, min(start + 500, terminals))])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return held / len(table)


def _seconds_to_let_go(terminals: int, same_day: bool) -> float:
    """Seconds TerminalEviction.cap takes to let the tenth of `terminals` with the least history go, their
    last activity spread over 60 days or all on one day (then every id is sorted to break the tie)."""
    table = StateTable(TERMINAL_STATE)
    slots = table.add([f"T{i:09d}" for i in range(terminals)])
    days = np.random.default_rng(0).integers(20_000 - 60, 20_001, terminals)
    table.records["max_day"][slots] = 20_000 if same_day else days
    eviction = TerminalEviction(0, max_terminals=terminals - 1)
    now = eviction.logged_at = time.monotonic()  # as if it had just logged: no error line in the table
    started = time.perf_counter()
    eviction.cap(table, now)
    return time.perf_counter() - started


def _bytes_of_the_id_cache(terminals: int) -> float:
    """What the featurizer's cache of terminal-id hashes takes when full, by tracemalloc: min(terminals,
    its size) distinct 10-character ids hashed, scaled to its size."""
    ids = [f"T{i:09d}" for i in range(min(terminals, TERMINAL_ID_CACHE))]
    terminal_code.cache_clear()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        terminal_hashes(ids)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        terminal_code.cache_clear()
    return held / len(ids) * TERMINAL_ID_CACHE


def _fold_labels_twice(frame: pl.DataFrame, batch_labels: int) -> tuple[int, float]:
    """(labels, seconds): every fraud label of `frame`, then each again (a repeat, recognised and not
    counted), folded by observe_labels in batches of `batch_labels`, as a restore folds a label backlog."""
    fraud = frame.filter(pl.col("is_fraud") & pl.col("label_ts").is_not_null()).sort("label_ts")
    fraud = pl.concat([fraud, fraud])
    terminals, events = fraud["terminal_id"].to_list(), fraud["event_id"].to_list()
    accounts = fraud["account_id"].to_list()
    label_us = fraud["label_ts"].dt.epoch("us").to_numpy()
    featurizer = StreamingFeaturizer()
    started = time.perf_counter()
    for i in range(0, fraud.height, batch_labels):
        part = slice(i, i + batch_labels)
        n = len(label_us[part])
        labels = LabelBatch(terminals[part], label_us[part], np.ones(n, bool), events[part], accounts[part])
        featurizer.observe_labels(labels)
    return fraud.height, time.perf_counter() - started


def run_replay_bench(events: int, models: list[str], batch_events: int, seed: int) -> dict[str, float]:
    """Events/s of a history replayed through the live scorer (what `txsentinel backtest` runs), per
    detector at its default size. The detectors are untrained: the cost does not depend on the weights."""
    torch.set_num_threads(1)
    accounts = 5000
    days = max(30, int(events / (accounts * 1.8)) + 2)
    frame = generate(GenerateConfig(accounts=accounts, days=days, seed=seed)).head(events)
    sample = compute_features(frame.head(200_000))
    spec = fit_feature_spec(sample, sample["ts"].min(), sample["ts"].max())
    print(f"replaying {frame.height:,} generated events in micro-batches of {batch_events} on {_machine()}")
    results = {}
    for name in models:
        scorer = Scorer(LoadedModel(build_detector(name, {"num_features": spec.num_features}), spec, {}))
        started = time.perf_counter()
        scored = scorer.replay(frame, batch_events=batch_events)
        seconds = time.perf_counter() - started
        results[name] = scored.height / seconds
        print(f"{name:20s} {seconds:7.1f} s  {results[name]:10,.0f} events/s", flush=True)
    return results
