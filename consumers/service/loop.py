"""The Kafka scoring service: one consumer-group member that scores `transactions` exactly once.

Per poll (one micro-batch), inside ONE Kafka transaction of ONE transactional producer:
decode (bad input -> dead-letter, with its reason) -> Scorer.score in partition order -> scores, alerts,
the changed accounts' state records to the compacted changelog -> the consumed offsets -> commit.
Consumers of the outputs read committed, so a crash anywhere before the commit leaves no trace and the batch
is redelivered; the state records carry each account's last applied (partition, offset), so even a
redelivery past a lost commit is never applied twice. A batch's commit runs on a committer thread while the
next batch is polled and scored in memory; that batch is sent only once the commit has returned, and is
rewound with it if it failed (consumers/service/commit_pipeline.py).

This module is the poll loop. The service's other concerns live beside it, mixed into the one _Service:
restore.py (rebalances; account and terminal state read back on assignment and after an abort),
producer.py (the transactional producer; failed transactions) and stats.py (what is counted).
"""

import gc
import logging
import threading
import time
import uuid
from dataclasses import asdict

from kafka import KafkaConsumer

from consumers.runtime.compacted import Reader, read_at
from consumers.runtime.metrics import Metrics, MetricsServer
from consumers.runtime.settings import ServeConfig
from consumers.runtime.signals import stop_on_signals
from consumers.runtime.topics import (
    ensure_topics,  # also the public way in for callers (pipeline/cli/demo.py)
)
from consumers.scoring.messages import MessageLimits
from consumers.scoring.scorer import Scorer
from consumers.service.batch_limit import BatchLimit
from consumers.service.batch_scoring import BatchScorer
from consumers.service.commit_pipeline import ScoredBatch, TransactionPipeline
from consumers.service.dormant import DormantStates
from consumers.service.producer import Transactions, merged_batches
from consumers.service.restore import Restore
from consumers.service.stats import Bookkeeping, ServeStats
from consumers.terminals.feed import FeedReader
from consumers.terminals.writer import TerminalTableWriter
from pipeline.registry.artifact import LoadedModel
from pipeline.registry.tracking import load_model

log = logging.getLogger(__name__)


def serve(
    cfg: ServeConfig,
    model: str | LoadedModel,
    bootstrap: str,
    stop_event: threading.Event | None = None,
) -> ServeStats:
    """Run one member of the scoring consumer group until `stop_event` is set or SIGTERM/SIGINT arrives.

    The batch in flight is finished and committed before returning. `model`: a LoadedModel, or a URI for
    pipeline.registry.tracking.load_model. Signal handlers are only installed when called from the main thread.
    """
    loaded = load_model(model) if isinstance(model, str) else model
    stop = stop_event or threading.Event()
    service = _Service(cfg, loaded)
    with stop_on_signals(stop):
        try:
            service.start(bootstrap)
            # torch, polars, MLflow and the model leave ~350k long-lived objects, and a full collection
            # walks them all: 0.18 s, in the middle of a batch. Frozen, they are left out of every later
            # collection (at 2,000 events/s, p99 latency after the start: 108-110 ms frozen, 115-127 ms not).
            gc.collect()
            gc.freeze()
            service.run(stop)
        finally:
            gc.unfreeze()  # serve() may be a library call (tests, the demo): leave the collector as it was
            service.close()
            if service.writer is not None:  # None: start() failed before building it
                service.stats.terminal_table_flushes = service.writer.stats.flushes
                service.stats.dead_lettered += service.writer.stats.dead_lettered
    log.info("serve stopped %s", " ".join(f"{k}={v}" for k, v in asdict(service.stats).items()))
    return service.stats


class _Service(Restore, Transactions, Bookkeeping):
    def __init__(self, cfg: ServeConfig, model: LoadedModel):
        self.cfg = cfg
        self.scorer = Scorer(model, cfg.threshold, cfg.alert_reasons)
        self.model_version = str(model.meta.get("model_version", model.source or model.name))
        self.stats = ServeStats()
        self.limit = BatchLimit(cfg.max_poll_records, cfg.max_poll_interval_ms)
        self.metrics = Metrics()
        self.fatal: BaseException | None = None  # raised in a rebalance callback, re-raised by run()
        self.assigned: set[int] = set()
        self.partitions = 0  # of the transactions topic, known once start() has made sure of the topics
        self.topic = cfg.topic("transactions")
        self.changelog = cfg.topic("changelog")
        self.metrics_server = None
        self.consumer = self.producer = self.restorer = self.feed = None
        self.instance_tag = uuid.uuid4().hex[:12]  # + the restore count: this instance's delta session
        self.terminal_restores = 0
        self.writer: TerminalTableWriter | None = None  # built in start(); runs while partition 0 is ours
        self.pipeline: TransactionPipeline | None = None  # the producer, committing in the background
        self.bootstrap = self.transactional_id = ""  # set by start()
        self.failures = 0  # batches aborted in a row (commit refusals by the group aside)
        self.batches: BatchScorer | None = None  # polled batch -> records to send; built in start()
        self.dormant = DormantStates(cfg.max_states_in_memory)
        self.rebalance_callbacks = 0  # revocations and assignments seen: _top_up checks for one in between
        # {partition: offset}: a batch that failed in scoring held records up to these offsets; read again,
        # they are scored one event at a time (the last resort: consumers/service/batch_scoring.py)
        self.suspect: dict[int, int] = {}

    def start(self, bootstrap: str) -> None:
        cfg = self.cfg
        self.partitions = ensure_topics(cfg, bootstrap)
        security = cfg.kafka_security
        if cfg.metrics_port:
            self.metrics_server = MetricsServer(self.metrics, cfg.metrics_host, cfg.metrics_port)
        # Reads the changelog on assignment and the terminal table; no group, so it never joins or commits.
        self.restorer = Reader.connect(bootstrap, "txsentinel-serve-restore", **security)
        self.bootstrap = bootstrap
        self._new_producer()
        counts = {}
        for name in ("scores", "alerts", "dead_letter", "changelog", "terminal_deltas"):
            # Metadata now, not on the first batch's first send to each topic (~0.3 s of latency there).
            counts[name] = len(self.producer.partitions_for(cfg.topic(name)))
        co_partitioned = counts["scores"] == counts["alerts"] == self.partitions
        self.feed = FeedReader.connect(
            bootstrap, "txsentinel-serve-feed", self.restorer, cfg.topic("labels"), cfg.topic("terminal_deltas"),
            cfg.restore_timeout_s, MessageLimits.of(cfg), **security,
        )  # fmt: skip
        self.writer = TerminalTableWriter(cfg, bootstrap, self.metrics)
        self.batches = BatchScorer(
            cfg, self.scorer, self.feed, self.model_version, co_partitioned, self.dormant,
            lambda wanted: read_at(self.restorer, self.changelog, wanted, cfg.restore_timeout_s),
        )  # fmt: skip
        self._restore_terminals()  # before joining the group: no event is scored without the table
        self.consumer = KafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=cfg.group_id,
            isolation_level="read_committed",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=cfg.max_poll_records,
            max_poll_interval_ms=cfg.max_poll_interval_ms,
            session_timeout_ms=cfg.session_timeout_ms,
            client_id="txsentinel-serve",
            **security,
        )
        self._subscribe()
        log.info(
            "serve started topic=%s partitions=%d group=%s transactional_id=%s model=%s threshold=%.4f",
            self.topic, self.partitions, cfg.group_id, self.transactional_id, self.model_version,
            self.scorer.threshold,
        )  # fmt: skip

    # -- the loop ----------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Poll, score, commit in the background (consumers/service/commit_pipeline.py) until `stop` is set."""
        try:
            while not stop.is_set():
                self._cycle()
        finally:
            self._finish_in_flight()

    def _cycle(self) -> None:
        # While a commit runs, poll briefly: an idle stream still settles it (and its metrics) promptly.
        timeout_ms = min(self.cfg.poll_timeout_ms, 10) if self.pipeline.busy() else self.cfg.poll_timeout_ms
        batch = self.consumer.poll(timeout_ms=timeout_ms, max_records=self.limit.records)
        if batch:
            batch = self._top_up(batch)  # {} when a rebalance came in between: fetched again later
        if self.fatal is not None:
            raise self.fatal  # from a rebalance callback inside either poll
        if not batch and not self.pipeline.busy():
            self._fold_feed_while_idle()
        try:
            scored = self._score(batch) if batch else None  # in memory only: nothing is sent yet
            waiting = time.monotonic()
            self._settle()  # the previous batch's commit; raises what failed it
            if scored is not None:
                scored.waited_s = time.monotonic() - waiting
                self._publish(scored)
        except Exception as error:
            self._recover(error, batch)

    def _score(self, batch: dict) -> ScoredBatch:
        """The batch scored, one event at a time where it holds records of a batch that failed in scoring;
        a failure here marks its records so (the last resort: a failing record is dead-lettered, and the
        service never loops on input)."""
        careful = any(
            records[0].offset <= self.suspect.get(tp.partition, -1)
            for tp, records in batch.items()
            if records
        )
        try:
            scored = self.batches.score(batch, careful)
        except Exception as error:
            if careful:
                raise  # one event at a time failed outside any one event: not the input's doing
            for tp, records in batch.items():
                if records:
                    self.suspect[tp.partition] = max(self.suspect.get(tp.partition, -1), records[-1].offset)
            log.warning(
                "batch failed in scoring error=%r; it is read again and scored one event at a time", error
            )
            raise
        for tp, records in batch.items():
            if records and records[-1].offset >= self.suspect.get(tp.partition, records[-1].offset + 1):
                del self.suspect[tp.partition]  # every suspect record of the partition is behind us
        return scored

    def _settle(self) -> None:
        """Wait for the batch in flight to commit, then count it (raises what failed its commit)."""
        committed = self.pipeline.settle()
        if committed is None:
            return
        self.failures = 0
        try:
            self._count(committed)
        except Exception:  # the batch IS committed: a bookkeeping error must not rewind it
            log.exception("bookkeeping of committed batch seq=%d failed", committed.batch.seq)

    def _publish(self, scored: ScoredBatch) -> None:
        started = time.monotonic()
        self.pipeline.publish(scored, self.consumer.group_metadata())
        scored.seconds["produce"] = time.monotonic() - started
        busy = sum(scored.seconds.values())
        self.metrics.observe("txsentinel_batch_seconds", busy)
        # The next poll's size follows the measured time between polls, the wait for the last commit included.
        self.limit.observe(scored.events, busy + scored.waited_s)

    def _top_up(self, batch: dict) -> dict:
        """The batch plus what arrived while the previous batch was processed (one short poll more).

        kafka-python hands out the response of the fetch it sent when the previous batch began, so by now
        those records are a batch cycle old, and whatever arrived since waits for the fetch this poll just
        sent: an event waited one to two cycles. Waiting `fresh_fetch_ms` for that fetch takes the new
        records into this batch, and an event waits about half a cycle. Skipped when the batch is full.

        A rebalance inside that poll drops the batch (nothing of it is applied yet): kept partitions are
        sought back to its first records, revoked ones are no longer ours.
        """
        room = self.limit.records - sum(len(r) for r in batch.values())
        if not self.cfg.fresh_fetch_ms or room <= 0:
            return batch
        rebalances = self.rebalance_callbacks
        more = self.consumer.poll(timeout_ms=self.cfg.fresh_fetch_ms, max_records=room)
        if self.rebalance_callbacks != rebalances:
            assigned = self.consumer.assignment()
            for tp, records in batch.items():
                if tp in assigned:
                    self.consumer.seek(tp, records[0].offset)
            log.info("batch dropped: a rebalance came in while topping it up; it is fetched again")
            return {}
        return merged_batches([batch, more])

    def close(self) -> None:
        parts = (
            ("table writer", self.writer, lambda w: w.stop()),  # drains and flushes first
            ("consumer", self.consumer, lambda c: c.close(autocommit=False)),
            ("producer", self.producer, lambda p: p.close(timeout=10)),
            ("committer", self.pipeline, lambda p: p.close()),
            ("restore consumers", self.restorer, lambda r: r.close()),
            ("feed", self.feed, lambda f: f.close()),
            ("metrics", self.metrics_server, lambda m: m.close()),
        )
        for name, part, close in parts:
            if part is None:
                continue  # never built: __init__ failed before it
            try:
                close(part)
            except Exception as error:  # closing the rest matters more than this one
                log.warning("close failed part=%s error=%r", name, error)
