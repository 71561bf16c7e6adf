"""How the service's integration tests run it, beside service_helpers.py: a per-test config fixture, a
stream with one terminal per event (test_service_resilience.py's docstring says why), serve() until a count
of committed scores, serve() in a child process to kill, waits on committed output and on the group, and
the scores of an uninterrupted run, computed once per model and stream however many tests compare with it."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time

import polars as pl
import pytest
from kafka import KafkaAdminClient

from consumers.scoring.messages import Transaction, encode_transaction
from consumers.scoring.results import ScoreRecord
from consumers.scoring.scorer import Scorer
from pipeline.bench.broker import REPO_ROOT
from pipeline.data.generate import GenerateConfig, generate
from pipeline.registry.tracking import load_model
from tests.integration.service_helpers import (
    CHILD,
    Running,
    prefixed_configs,
    read_committed,
    wait_for_scores,
)

# Short timeouts so takeovers are quick (as in test_service.py's crash test): the group drops a silent member
# after session_timeout_ms; a killed instance's open transaction is aborted after transaction_timeout_ms.
FAST = {"session_timeout_ms": 6000, "transaction_timeout_ms": 5000, "poll_timeout_ms": 200}


def service_configs(tag: str, **defaults):
    """A function-scoped fixture giving `make(**settings) -> ServeConfig` with its own topic prefix and group,
    whose topics are deleted after the test: `service_cfg = service_configs("res", **FAST)` in a module."""

    @pytest.fixture
    def service_cfg(kafka_bootstrap):
        with prefixed_configs(kafka_bootstrap, tag, **defaults) as make:
            yield make

    return service_cfg


def unique_terminals(frame: pl.DataFrame) -> pl.DataFrame:
    """One terminal per event: terminal features are then the same on every instance and in any order."""
    return frame.with_columns(("T-" + pl.col("event_id").cast(pl.Utf8)).alias("terminal_id"))


def unique_terminal_history(accounts: int, seed: int, days: int = 30) -> pl.DataFrame:
    """A generated history in ts order with one terminal per event (60 accounts, seed 5: ~2100 events)."""
    frame = generate(GenerateConfig(accounts=accounts, days=days, seed=seed)).sort("ts", "event_id")
    return unique_terminals(frame)


def messages(events: list[Transaction]) -> list[tuple[str, bytes]]:
    return [(t.account_id, encode_transaction(t)) for t in events]


def committed_count(bootstrap: str, topic: str) -> int:
    return len(read_committed(bootstrap, topic))


def wait_until(predicate, what: str, timeout_s: float, running: Running | None = None, child=None):
    """Polls `predicate` until true; fails early when the running service or the child process died."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if running is not None and running.error is not None:
            raise running.error
        if child is not None:
            assert child.poll() is None, f"the child service died (rc={child.returncode})"
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for: {what}"
        time.sleep(0.3)


def group_members(bootstrap: str, group: str) -> tuple[str, int]:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        info = admin.describe_groups([group])[group]
        return info["group_state"], len(info["members"])
    finally:
        admin.close()


def wait_for_stable_group(bootstrap: str, group: str, members: int, running: Running) -> None:
    wait_until(
        lambda: group_members(bootstrap, group) == ("Stable", members),
        f"a stable group of {members}",
        120,
        running,
    )


def serve_until(cfg, model: str, bootstrap: str, count: int, timeout_s: float = 90, shadow=None):
    """serve() on a thread until `count` committed scores (this run's and earlier ones'), then stopped.
    Returns (every committed score, the run's stats)."""
    running = Running(cfg, model, bootstrap, shadow=shadow)
    scores = wait_for_scores(bootstrap, cfg.topic("scores"), count, running, timeout_s=timeout_s)
    return scores, running.stop()


def start_child(cfg, model: str, bootstrap: str, stderr) -> subprocess.Popen:
    """serve() in a child process (CHILD) for a test to SIGKILL: no stop, no close, a transaction maybe open."""
    overrides = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "security"}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(overrides), model, bootstrap],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )


@functools.cache
def _uninterrupted(model: str, events: tuple[Transaction, ...]) -> tuple[ScoreRecord, ...]:
    return tuple(Scorer(load_model(model)).score(events))


def uninterrupted_scores(model: str, events: list[Transaction]) -> tuple[ScoreRecord, ...]:
    """The scorer's records over `events` in one uninterrupted run: the reference the service must equal.
    Cached per model directory and stream (a model directory is written once and never changed)."""
    return _uninterrupted(model, tuple(events))
