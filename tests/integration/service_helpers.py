"""What the service's integration tests share: topics, producing, reading committed outputs, a tiny saved
model, a serve() running in a thread, and the exactly-once and parity assertions."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import polars as pl
import torch
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition

from consumers.runtime.metrics import scrape
from consumers.runtime.settings import ServeConfig, load_serve_config
from consumers.scoring.messages import Transaction
from consumers.service.loop import serve
from models.registry import build_detector
from pipeline.features import compute_features, fit_feature_spec
from pipeline.registry.artifact import save_model_dir

TOLERANCE = 1e-5


def save_tiny_model(frame: pl.DataFrame, fit_days: int, out, version: str, seed: int = 0) -> str:
    """An untrained tiny LSTM artifact whose normalisation is fitted on the first `fit_days` of `frame`."""
    features = compute_features(frame)
    start = frame["ts"].min()
    spec = fit_feature_spec(features, start, start + timedelta(days=fit_days))
    torch.manual_seed(seed)
    tiny = {"num_features": spec.num_features, "d_model": 8, "num_layers": 1, "dropout": 0.0}
    detector = build_detector("lstm", tiny)
    return str(save_model_dir(out, detector, spec, {"model_version": version}))


@contextmanager
def prefixed_configs(bootstrap: str, tag: str, **defaults) -> Iterator[Callable[..., ServeConfig]]:
    """`make(**settings) -> ServeConfig` with a unique topic prefix and group (`defaults` < `settings`);
    every topic with that prefix is deleted afterwards. A failed clean-up does not hide the test's result."""
    prefix = f"{tag}-{uuid.uuid4().hex[:8]}-"
    overrides = {"topic_prefix": prefix, "group_id": f"{prefix}group", **defaults}
    yield lambda **more: load_serve_config(overrides={**overrides, **more}, env={})
    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        try:
            admin.delete_topics([t for t in admin.list_topics() if t.startswith(prefix)])
        finally:
            admin.close()
    except Exception as error:  # clean-up only
        print(f"could not delete topics {prefix}*: {error!r}")


def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics(
            {name: {"num_partitions": partitions, "replication_factor": 1}}, wait_for_metadata=True
        )
    finally:
        admin.close()


def produce(bootstrap: str, topic: str, messages: list[tuple[str, bytes | None]]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for key, value in messages:
        producer.send(topic, key=key.encode(), value=value)
    producer.flush()
    producer.close()


class Running:
    """serve() on a thread; stop() sets its stop_event, joins, and re-raises what serve raised."""

    def __init__(self, cfg, model, bootstrap, shadow=None):
        self.stop_event = threading.Event()
        self.stats = self.error = None

        def target():
            try:
                self.stats = serve(cfg, model, bootstrap, stop_event=self.stop_event, shadow=shadow)
            except BaseException as error:
                self.error = error

        self.thread = threading.Thread(target=target, name="txs-serve-test", daemon=True)
        self.thread.start()

    def stop(self, timeout_s: float = 60):
        self.stop_event.set()
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"serve() did not return within {timeout_s} s of stop_event"
        if self.error is not None:
            raise self.error
        return self.stats


def read_committed(bootstrap: str, topic: str) -> list:
    """Every committed record of `topic`, from the beginning up to its current end."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed")
    try:
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        if not tps:
            return []  # not created yet (the service creates its output topics)
        consumer.assign(tps)
        consumer.seek_to_beginning()
        end = consumer.end_offsets(tps)
        records, deadline = [], time.monotonic() + 30
        while any(consumer.position(tp) < end[tp] for tp in tps):
            assert time.monotonic() < deadline, f"could not read {topic} up to {end}"
            for batch in consumer.poll(timeout_ms=200).values():
                records.extend(batch)
        return records
    finally:
        consumer.close()


def wait_for_scores(bootstrap, topic, count, running: Running, timeout_s: float = 90) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        if running.error is not None:
            raise running.error
        scores = [json.loads(r.value) for r in read_committed(bootstrap, topic)]
        if len(scores) >= count:
            return scores
        assert time.monotonic() < deadline, f"{len(scores)} of {count} scores within {timeout_s} s"
        time.sleep(0.5)


def wait_for_metric(port: int, name: str, value: float, running: Running, timeout_s: float = 60) -> None:
    """Until the running service's /metrics shows `name` at `value` or more."""
    deadline = time.monotonic() + timeout_s
    while (seen := scrape(port, name)) < value:
        if running.error is not None:
            raise running.error
        assert time.monotonic() < deadline, f"{name} = {seen}, not {value}, within {timeout_s} s"
        time.sleep(0.1)


def assert_exactly_once(scores: list[dict], events: list[Transaction]) -> dict[str, dict]:
    by_event = {}
    for s in scores:
        assert s["event_id"] not in by_event, f"event {s['event_id']} scored twice"
        by_event[s["event_id"]] = s
    assert set(by_event) == {t.event_id for t in events}, "an event was never scored, or a stranger was"
    return by_event


def assert_same_scores(by_event: dict[str, dict], reference) -> None:
    worst = max(abs(by_event[r.event_id]["score"] - r.score) for r in reference)
    assert worst <= TOLERANCE, f"service scores differ from the scorer's by up to {worst:.3g}"
    assert all(by_event[r.event_id]["alert"] == r.alert for r in reference)


# serve() in a child process that the test kills with SIGKILL: no stop, no close, a transaction maybe open.
# SIGUSR1 writes every thread's stack to its stderr (what a test prints when the child seems stuck); with
# TXS_TEST_SERVICE_LOG_LEVEL=DEBUG in its environment the service logs a line per committed batch.
LOG_FORMAT = "%(asctime)s %(threadName)s %(levelname)s:%(name)s:%(message)s"
CHILD = f"""
import faulthandler, json, logging, os, signal, sys
from consumers.service.loop import serve
from consumers.runtime.settings import load_serve_config
faulthandler.register(signal.SIGUSR1, all_threads=True)
logging.basicConfig(level=logging.INFO, format={LOG_FORMAT!r})
logging.getLogger("consumers").setLevel(os.environ.get("TXS_TEST_SERVICE_LOG_LEVEL", "INFO"))
serve(load_serve_config(overrides=json.loads(sys.argv[1]), env={{}}), sys.argv[2], sys.argv[3])
"""

# What a failing test prints of a service's log: its own lines, group membership, warnings and errors; not
# kafka-python's metadata and connection chatter, nor the test's own readers' warnings.
RELEVANT = (
    ":consumers.", "joined group", "Cooperative rebalance complete", "Revoking", "Leaving consumer group",
    "rebalancing", "not recognized", "session expired", "Bumping producer epoch", "WARNING:", "ERROR:",
)  # fmt: skip
NOISE = (
    "group_id is None", "ran for", "Metadata refresh", "Fetch to node", "heartbeat_interval_ms is high",
    "DEBUG:consumers.service.stats", "DEBUG:consumers.terminals", "batch committed seq=",
)  # fmt: skip


def relevant_lines(lines, last: int = 60) -> list[str]:
    """The last `last` of `lines` (log lines in LOG_FORMAT) that say something about the service."""
    kept = [ln for ln in lines if any(w in ln for w in RELEVANT) and not any(w in ln for w in NOISE)]
    return [ln[:400] for ln in kept[-last:]]


class ServiceLog(logging.Handler):
    """The last lines this process's services log (consumers.* at DEBUG, kafka-python's group coordinator at
    INFO), kept for a failing test to print; `with ServiceLog() as log:` attaches and detaches it."""

    def __init__(self, keep: int = 5000):
        super().__init__(logging.DEBUG)
        self.lines: deque[str] = deque(maxlen=keep)
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self.levels: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def __enter__(self) -> ServiceLog:
        for name, level in (("consumers", logging.DEBUG), ("kafka.coordinator", logging.INFO)):
            self.levels[name] = logging.getLogger(name).level
            logging.getLogger(name).setLevel(level)
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for name, level in self.levels.items():
            logging.getLogger(name).removeHandler(self)
            logging.getLogger(name).setLevel(level)


def thread_stacks(prefixes: tuple[str, ...]) -> str:
    """The stacks of this process's threads whose names start with one of `prefixes`."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, str(ident))
        if name.startswith(prefixes):
            out.append(f"--- thread {name}\n" + "".join(traceback.format_stack(frame)[-12:]))
    return "\n".join(out)
