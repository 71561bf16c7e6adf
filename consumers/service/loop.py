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
producer.py (the transactional producer; failed transactions) and stats.py (what is counted). With
metrics_port set, /metrics, /healthz and /readyz answer from the start (consumers/runtime/endpoints.py);
readiness waits for the start, then for assigned partitions and their restored states (self.probes).
"""

import gc
import logging
import math
import threading
import time
import uuid
from dataclasses import asdict

import numpy as np
from kafka import KafkaConsumer
from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor
from kafka.errors import KafkaError

from consumers.runtime.compacted import RESTORE_FETCH, Reader, read_at
from consumers.runtime.drift import drift_window
from consumers.runtime.endpoints import StatusServer
from consumers.runtime.metrics import Metrics
from consumers.runtime.probes import Probes
from consumers.runtime.settings import ServeConfig
from consumers.runtime.signals import stop_on_signals
from consumers.runtime.topics import (
    ensure_topics,  # also the public way in for callers (pipeline/cli/demo.py)
    refresh_metadata,
)
from consumers.scoring.message_limits import MessageLimits
from consumers.scoring.scorer import Scorer
from consumers.service.batch_limit import BatchLimit
from consumers.service.batch_scoring import BatchScorer
from consumers.service.commit_pipeline import ScoredBatch, TransactionPipeline
from consumers.service.dormant import DormantStates
from consumers.service.producer import Transactions, merged_batches
from consumers.service.restore import Restore
from consumers.service.shadow import ShadowSide, changelog_for, ensure_shadow_topics
from consumers.service.stats import Bookkeeping, ServeStats, model_info
from consumers.terminals.feed import FeedReader
from consumers.terminals.writer import TerminalTableWriter
from pipeline.registry.artifact import LoadedModel
from pipeline.registry.tracking import load_model

log = logging.getLogger(__name__)

METADATA_WAIT_MS = 5_000  # the longest a metadata read holds up the loop (_watch_metadata)


def serve(
    cfg: ServeConfig,
    model: str | LoadedModel,
    bootstrap: str,
    stop_event: threading.Event | None = None,
    shadow: str | LoadedModel | None = None,
) -> ServeStats:
    """Run one member of the scoring consumer group until `stop_event` is set or SIGTERM/SIGINT arrives.

    The batch in flight is finished and committed before returning. `model`: a LoadedModel, or a URI for
    pipeline.registry.tracking.load_model. Signal handlers are only installed when called from the main thread.
    `shadow` (else cfg.shadow_model_uri): a challenger stepped on every event, scored to shadow_scores, never
    alerting (consumers/service/shadow.py).
    """
    loaded = load_model(model) if isinstance(model, str) else model
    shadow = cfg.shadow_model_uri if shadow is None else shadow
    challenger = load_model(shadow) if isinstance(shadow, str) else shadow
    stop = stop_event or threading.Event()
    service = _Service(cfg, loaded, challenger)
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
    stats = asdict(service.stats)  # also as fields of their own, for --log-format json
    log.info("serve stopped %s", " ".join(f"{k}={v}" for k, v in stats.items()), extra=stats)
    return service.stats


class _Service(Restore, Transactions, Bookkeeping):
    def __init__(self, cfg: ServeConfig, model: LoadedModel, shadow: LoadedModel | None = None):
        self.cfg = cfg
        self.scorer = Scorer(model, cfg.threshold, cfg.alert_reasons, shadow)
        self.model_version = str(model.meta.get("model_version", model.source or model.name))
        self.stats = ServeStats()
        self.limit = BatchLimit(cfg.max_poll_records, cfg.max_poll_interval_ms)
        self.metrics = Metrics()
        self.metrics.set_info("txsentinel_model_info", model_info(model))
        # Alive while the loop comes round within the longest wait it may have: a restore inside a poll,
        # a batch inside max_poll_interval_ms.
        self.probes = Probes(stall_after_s=cfg.restore_timeout_s + cfg.max_poll_interval_ms / 1000)
        self.probes.wait_for("start", "creating topics, starting the producer, reading the terminal table")
        self.probes.wait_for("partitions", "waiting for the group to assign partitions")
        self.metrics.read_from("txsentinel_ready", lambda: self.probes.ready()[0])
        self.drift = drift_window(model.spec, model.meta, self.scorer.threshold, cfg.drift_window_events)
        self.observed: list = []  # what the batch being scored fed the drift window (stats.py counts it)
        self.scorer.on_scored = lambda *scored: self.observed.append(scored)
        self.health_at = -math.inf  # time.monotonic() of the last drift and state-health refresh
        # time.monotonic() of the consumer's last metadata read (_watch_metadata): the start has just read it
        self.metadata_at = time.monotonic()
        self.initial_state = self.scorer.detector.init_state(1)  # what state health compares held states to
        self.health_rng = np.random.default_rng(0)  # which held states it samples
        self.fatal: BaseException | None = None  # raised in a rebalance callback, re-raised by run()
        self.assigned: set[int] = set()  # partitions of `transactions` held and restored
        self.to_restore: set[int] = set()  # assigned, paused until _catch_up has restored them
        self.to_seek: set[int] = set()  # rewound: sought to the committed offsets before the next poll
        self.partitions = 0  # of the transactions topic, known once start() has made sure of the topics
        self.topic = cfg.topic("transactions")
        self.changelog = cfg.topic("changelog")
        self.metrics_server = None
        self.consumer = self.producer = self.restorer = self.feed = None
        self.instance_tag = uuid.uuid4().hex[:12]  # + the restore count: this instance's delta session
        self.terminal_restores = 0
        self.writer: TerminalTableWriter | None = None  # built in start(); runs while partition 0 is ours
        self.closing = False
        self.pipeline: TransactionPipeline | None = None  # the producer, committing in the background
        self.bootstrap = self.transactional_id = ""  # set by start()
        self.failures = 0  # batches aborted in a row (commit refusals by the group aside)
        self.batches: BatchScorer | None = None  # polled batch -> records to send; built in start()
        # Memory's cap in accounts, from both caps (count and bytes); the store stops doubling there, with
        # room for the two batches not yet committed.
        capacity = self.scorer.states_within(cfg.max_states_in_memory, cfg.max_state_bytes_in_memory)
        self.scorer.store.row_limit = capacity + 2 * cfg.max_poll_records
        # refuses a bound below twice capacity
        self.dormant = DormantStates(capacity, cfg.max_accounts_kept, cfg.max_poll_records)
        self.shadow = None if shadow is None else ShadowSide(cfg, self.scorer, capacity)
        log.info(
            "state memory cap accounts=%d bytes_per_account=%d (max_states_in_memory=%d max_state_bytes_in_memory=%d)",
            capacity, self.scorer.state_bytes_per_account, cfg.max_states_in_memory, cfg.max_state_bytes_in_memory,
        )  # fmt: skip
        self.rebalance_callbacks = 0  # revocations and assignments seen: _top_up checks for one in between
        # {partition: offset}: a batch that failed in scoring held records up to these offsets; read again,
        # they are scored one event at a time (the last resort: consumers/service/batch_scoring.py)
        self.suspect: dict[int, int] = {}

    def start(self, bootstrap: str) -> None:
        cfg = self.cfg
        if cfg.metrics_port:  # first: the probes answer (not ready) while the rest starts
            self.metrics_server = StatusServer(self.metrics, self.probes, cfg.metrics_host, cfg.metrics_port)
        self.partitions = ensure_topics(cfg, bootstrap)
        self.changelog = changelog_for(cfg, bootstrap, self.scorer.model_fingerprint)  # promoted: its own
        if self.shadow is not None:
            ensure_shadow_topics(cfg, bootstrap, self.shadow.changelog, self.partitions)
        security = cfg.kafka_security
        # Reads the changelog on assignment and the terminal table; no group, so it never joins or commits.
        self.restorer = Reader.connect(bootstrap, "txsentinel-serve-restore", **RESTORE_FETCH, **security)
        self.bootstrap = bootstrap
        self._new_producer()
        counts = {}
        for name in ("scores", "alerts", "dead_letter", "changelog", "terminal_deltas"):
            # Metadata now, not on the first batch's first send to each topic (~0.3 s of latency there).
            counts[name] = len(self.producer.partitions_for(cfg.topic(name)))
        co_partitioned = counts["scores"] == counts["alerts"] == self.partitions
        self.metrics.inc("txsentinel_labels_held_total", 0, label="scorer")  # there from the start, at 0
        self.feed = FeedReader.connect(
            bootstrap, "txsentinel-serve-feed", self.restorer, cfg.topic("labels"), cfg.topic("terminal_deltas"),
            cfg.restore_timeout_s, MessageLimits.of(cfg), cfg.lost_feed_position,
            lambda records: self.metrics.inc("txsentinel_feed_records_lost_total", records),
            lambda: self.metrics.inc("txsentinel_labels_held_total", label="scorer"), **security,
        )  # fmt: skip
        self.writer = TerminalTableWriter(cfg, bootstrap, self.metrics)
        self.batches = BatchScorer(
            cfg, self.scorer, self.feed, self.model_version, co_partitioned, self.dormant,
            lambda wanted, topic=None: read_at(
                self.restorer, topic or self.changelog, wanted, cfg.restore_timeout_s
            ),
            self.shadow, self.changelog, self.partitions,
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
            metadata_max_age_ms=cfg.metadata_max_age_ms,
            # KIP-429: a rebalance moves only what must move; kept partitions keep their states in memory
            partition_assignment_strategy=(CooperativeStickyAssignor,),
            client_id="txsentinel-serve",
            **security,
        )
        self._subscribe()
        self.probes.done("start")
        log.info(
            "serve started topic=%s partitions=%d group=%s transactional_id=%s model=%s threshold=%.4f "
            "changelog=%s shadow=%s",
            self.topic, self.partitions, cfg.group_id, self.transactional_id, self.model_version,
            self.scorer.threshold, self.changelog, self.shadow and self.shadow.model.version,
        )  # fmt: skip

    # -- the loop ----------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Poll, score, commit in the background (consumers/service/commit_pipeline.py) until `stop` is set."""
        try:
            while not stop.is_set():
                self.probes.beat()
                self._cycle()
        finally:
            self.probes.wait_for("stop", "stopping: the batch in flight commits, then the instance leaves")
            self._finish_in_flight()

    def _cycle(self) -> None:
        # While a commit runs, poll briefly: an idle stream still settles it (and its metrics) promptly.
        self._catch_up()  # partitions assigned or rewound since the last poll (restore.py)
        self._watch_metadata()
        timeout_ms = min(self.cfg.poll_timeout_ms, 10) if self.pipeline.busy() else self.cfg.poll_timeout_ms
        rebalances = self.rebalance_callbacks
        batch = self.consumer.poll(timeout_ms=timeout_ms, max_records=self.limit.records)
        if self.rebalance_callbacks != rebalances and batch:
            batch = self._drop(batch)  # restores and rewinds first
        if batch:
            batch = self._top_up(batch)  # {} when a rebalance came in between: fetched again later
        if self.fatal is not None:
            raise self.fatal  # from a rebalance callback inside either poll
        if not batch and not self.pipeline.busy():
            self._fold_feed_while_idle()
            self._refresh_health()
        try:
            scored = self._score(batch) if batch else None  # in memory only: nothing is sent yet
            waiting = time.monotonic()
            self._settle()  # the previous batch's commit; raises what failed it
            if scored is not None:
                scored.waited_s = time.monotonic() - waiting
                self._publish(scored)
        except Exception as error:
            self._recover(error, batch)

    def _watch_metadata(self) -> None:
        """Every metadata_max_age_ms, read the cluster's metadata, so that the group sees a partition added
        to `transactions` (restore.py, _hold_beyond) within that time. A broker that does not answer holds
        the loop up for at most METADATA_WAIT_MS: the polls would bring nothing meanwhile either."""
        now = time.monotonic()
        if now - self.metadata_at < self.cfg.metadata_max_age_ms / 1000:
            return
        self.metadata_at = now
        try:
            refresh_metadata(self.consumer, min(METADATA_WAIT_MS, self.cfg.metadata_max_age_ms))
        except KafkaError as error:
            log.warning("metadata read failed, tried again in metadata_max_age_ms: %r", error)

    def _score(self, batch: dict) -> ScoredBatch:
        """The batch scored, one event at a time where it holds records of a batch that failed in scoring;
        a failure here marks its records so (the last resort: a failing record is dead-lettered, and the
        service never loops on input)."""
        careful = any(
            records[0].offset <= self.suspect.get(tp.partition, -1)
            for tp, records in batch.items()
            if records
        )
        self.observed.clear()
        try:
            scored = self.batches.score(batch, careful)
            scored.observed, self.observed = self.observed, []
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
        if log.isEnabledFor(logging.DEBUG):  # a line per batch: where each partition's input stands
            batch = committed.batch
            log.debug(
                "batch committed seq=%d events=%d offsets=%s commit_seconds=%.3f", batch.seq, batch.events,
                {tp.partition: f"{rs[0].offset}-{rs[-1].offset}" for tp, rs in batch.polled.items() if rs},
                committed.seconds,
            )  # fmt: skip
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
            return self._drop(batch)
        return merged_batches([batch, more])

    def _drop(self, batch: dict) -> dict:
        """{}: a batch polled around a rebalance waits (nothing of it is applied yet). Kept partitions are
        sought back to its first records, revoked ones are no longer ours; _catch_up then restores and
        rewinds before any of it is read again."""
        assigned = self.consumer.assignment()
        for tp, records in batch.items():
            if tp in assigned:
                self.consumer.seek(tp, records[0].offset)
        log.info("batch dropped: a rebalance came in while it was polled; it is fetched again")
        return {}

    def close(self) -> None:
        self.closing = True  # a rebalance callback from here on starts no table writer (restore.py)
        parts = (
            ("table writer", self.writer, lambda w: w.stop()),  # drains and flushes first
            ("consumer", self.consumer, lambda c: c.close(autocommit=False)),
            # Callbacks run on kafka-python's network thread: one that raced the flag above is stopped here.
            ("table writer", self.writer, lambda w: w.stop()),
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
