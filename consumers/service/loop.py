"""The Kafka scoring service: one consumer-group member that scores `transactions` exactly once.

Per poll (one micro-batch), inside ONE Kafka transaction of ONE transactional producer:
decode (bad input -> dead-letter, with its reason) -> Scorer.score in partition order -> scores, alerts,
the changed accounts' state records to the compacted changelog -> the consumed offsets -> commit.
Consumers of the outputs read committed, so a crash anywhere before the commit leaves no trace and the batch
is redelivered; the state records carry each account's last applied (partition, offset), so even a
redelivery past a lost commit is never applied twice. A batch's commit runs on a committer thread while the
next batch is polled and scored in memory; that batch is sent only once the commit has returned, and is
rewound with it if it failed (consumers/service/commit_pipeline.py).

The changelog has as many partitions as `transactions`, and each account's record goes to the partition
number of the input event it came from: on assignment of input partition p, this instance reads changelog
partition p from its beginning up to its end (read_committed) and holds every account of p. On revocation
the accounts of those partitions are evicted.

Terminal risk (consumers/terminals/table.py has the whole flow): on start, before joining the group, the
instance reads the terminal table, then the labels and every instance's terminal deltas after the table's
positions. Then, every terminal_feed_interval_ms (before a batch, or while idle), it folds in the labels
and the other instances' deltas that have arrived; after scoring, each batch's own terminal event counts go
out as one delta record in its transaction. Whichever instance owns transactions partition 0 also runs the table
writer (consumers/terminals/writer.py).
"""

import gc
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
from kafka import KafkaConsumer, KafkaProducer
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import CommitFailedError, ProducerFencedError
from kafka.serializer import DefaultSerializer
from kafka.structs import TopicPartition

from consumers.runtime.compacted import Reader, read_at, read_recent
from consumers.runtime.metrics import Metrics, MetricsServer
from consumers.runtime.settings import ServeConfig
from consumers.runtime.signals import stop_on_signals
from consumers.runtime.topics import (
    ensure_topics,  # also the public way in for callers (pipeline/cli/demo.py)
)
from consumers.scoring.scorer import Scorer
from consumers.service.batch_limit import BatchLimit
from consumers.service.batch_scoring import BatchScorer
from consumers.service.commit_pipeline import Committed, ScoredBatch, TransactionPipeline
from consumers.service.dormant import DormantStates
from consumers.terminals.feed import FeedReader
from consumers.terminals.writer import TerminalTableWriter
from pipeline.registry.artifact import LoadedModel
from pipeline.registry.tracking import load_model

log = logging.getLogger(__name__)

KEYS = DefaultSerializer()  # account ids, str <-> UTF-8 (bytes pass through unchanged)
MAX_FAILED_BATCHES = 3  # consecutive aborted batches before the service gives up (a bug, not a blip)


@dataclass
class ServeStats:
    batches: int = 0
    events_scored: int = 0
    dead_lettered: int = 0
    alerts: int = 0
    duplicates_dropped: int = 0
    aborted_batches: int = 0
    rebalances: int = 0
    restored_states: int = 0
    restore_s: float = 0.0
    # fraud and not-fraud labels read and applied (only fraud changes state); those after the table's
    # positions are read again by each restore, and count again
    labels_applied: int = 0
    restored_terminals: int = 0  # terminal records read from the table, at start and after aborts
    terminal_deltas_applied: int = 0  # other instances' batches of terminal counts folded in
    terminal_table_flushes: int = 0  # transactions of the table writer, while this instance ran it
    states_evicted: int = 0  # dormant accounts let go of beyond max_states_in_memory
    states_reloaded: int = 0  # dormant accounts read back from the changelog when they returned


def serve(
    cfg: ServeConfig,
    model: str | LoadedModel,
    bootstrap: str,
    stop_event: threading.Event | None = None,
) -> ServeStats:
    """Run one member of the scoring consumer group until `stop_event` is set or SIGTERM/SIGINT arrives.

    The batch in flight is finished and committed before returning. `model`: a LoadedModel, or a URI for
    pipeline.registry.artifact.load_model. Signal handlers are only installed when called from the main thread.
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


class _Listener(ConsumerRebalanceListener):
    # kafka-python calls these from inside poll(), between batches. The previous batch's commit may still be
    # running then: on_revoked settles it first, so no transaction stays open across a rebalance.
    def __init__(self, service: "_Service"):
        self.service = service

    def on_partitions_revoked(self, revoked):
        self.service.on_revoked(revoked)

    def on_partitions_assigned(self, assigned):
        self.service.on_assigned(assigned)

    def on_partitions_lost(self, lost):
        self.service.on_revoked(lost)


class _Service:
    def __init__(self, cfg: ServeConfig, model: LoadedModel):
        self.cfg = cfg
        self.scorer = Scorer(model, cfg.threshold)
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
            cfg.restore_timeout_s, **security,
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

    def _new_producer(self) -> None:
        """The transactional producer and its commit pipeline, at start and after a fence."""
        cfg = self.cfg
        # Zombies of an older group generation are fenced by send_offsets_to_transaction (KIP-447), whatever
        # the id. A stable id (instance_id) also lets init_transactions abort a crashed predecessor's
        # transaction at once.
        self.transactional_id = f"{cfg.transactional_id_prefix}-{cfg.instance_id or uuid.uuid4().hex[:12]}"
        self.producer = KafkaProducer(
            bootstrap_servers=self.bootstrap,
            transactional_id=self.transactional_id,
            transaction_timeout_ms=cfg.transaction_timeout_ms,
            linger_ms=cfg.producer_linger_ms,
            batch_size=cfg.producer_batch_bytes,
            retry_backoff_ms=cfg.producer_retry_backoff_ms,
            key_serializer=KEYS,
            **cfg.kafka_security,
        )
        self.producer.init_transactions()  # with a stable id: fences and aborts the predecessor's transaction
        self.pipeline = TransactionPipeline(self.producer)

    def _renew_producer(self, error: ProducerFencedError) -> None:
        """A fenced producer is dead for good: start another (its aborted batches are rewound by the caller).

        The broker fences a transactional producer when one of its transactions outlives
        transaction_timeout_ms (e.g. across a broker outage: the broker aborts it and bumps the producer's
        epoch), or when another producer starts with the same transactional id (two instances sharing an
        instance_id). The first is routine; the second repeats, and MAX_FAILED_BATCHES stops the service.
        """
        log.warning(
            "producer fenced (%r): a transaction outlived transaction_timeout_ms (a broker outage?) or "
            "another instance uses instance_id=%r; starting a new producer", error, self.cfg.instance_id,
        )  # fmt: skip
        old_producer, old_pipeline = self.producer, self.pipeline
        for close in (lambda: old_producer.close(timeout=0), old_pipeline.close):
            try:
                close()
            except Exception as close_error:  # a fenced producer may fail to close cleanly: it is dropped
                log.warning("closing the fenced producer failed error=%r", close_error)
        self._new_producer()

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
            scored = self.batches.score(batch) if batch else None  # in memory only: nothing is sent yet
            waiting = time.monotonic()
            self._settle()  # the previous batch's commit; raises what failed it
            if scored is not None:
                scored.waited_s = time.monotonic() - waiting
                self._publish(scored)
        except Exception as error:
            self._recover(error, batch)

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

    def _recover(self, error: Exception, batch: dict | None) -> None:
        """Abort, rewind and restore after a failure in scoring, publishing or committing.

        The failure may be this batch's (scoring, sending) or the previous batch's commit; either way every
        batch not committed is rewound: the one in flight (if its commit failed) and this one.
        """
        rewind = [batch] if batch else []
        try:
            self._settle()  # a scoring failure leaves the previous commit running: let it finish first
        except Exception as commit_error:
            error = commit_error
            failed = self.pipeline.take_failed()
            rewind.insert(0, failed.polled)
        self._end_failed_transaction(error)
        rewound = _merged(rewind)
        if isinstance(error, CommitFailedError):
            # The group no longer knows this member or its generation (a broker restart, a session timeout,
            # a rebalance it missed), so the offsets could not join the transaction and nothing of the batch
            # committed. Not a failed batch: rewind, then join again as a new member, which restores its
            # partitions' states when they are assigned.
            log.warning("batch aborted: the group has moved on without this member (%r); rejoining", error)
            self._rewind(rewound)
            self._rejoin()
            return
        self.failures += 1
        log.error("batch aborted attempt=%d error=%r", self.failures, error, exc_info=error)
        self._rewind(rewound)  # the batch is redelivered
        if self.failures >= MAX_FAILED_BATCHES:
            raise RuntimeError(
                f"{self.failures} batches in a row failed (last: {error!r}); stopping rather than loop"
            ) from error

    def _end_failed_transaction(self, error: Exception) -> None:
        """Abort the failed batch's transaction and count it; a fenced producer is replaced instead (the fence
        aborted its transaction, and it can do nothing more)."""
        if isinstance(error, ProducerFencedError):
            self._renew_producer(error)
        else:
            self.pipeline.abort()
        self.stats.aborted_batches += 1
        self.metrics.inc("txsentinel_aborted_transactions_total")

    def _finish_in_flight(self) -> None:
        """On the way out (stop, or an error): the last batch commits, or its transaction is aborted."""
        try:
            self._settle()
        except Exception as error:  # nothing of it committed: the group redelivers it to the next owner
            log.warning("last batch aborted on the way out error=%r", error)
            self.pipeline.take_failed()
            self.pipeline.abort()

    def _rejoin(self) -> None:
        """Drop this member's partitions and subscribe afresh: the next poll joins the group anew.

        Waiting does not do it: until a heartbeat learns that the member is unknown, every poll hands out
        records whose offsets cannot commit (kafka-python has no call that forces a rejoin).
        """
        self.on_revoked([TopicPartition(self.topic, p) for p in sorted(self.assigned)])
        self.consumer.unsubscribe()
        self._subscribe()

    def _subscribe(self) -> None:
        self.consumer.subscribe([self.topic], listener=_Listener(self))
        # kafka-python 3.0.12: without the topic's metadata before the first poll, the member can end up
        # in a stable group with no partitions (lost rejoin); see tests/integration/test_kafka_broker.py.
        self.consumer.partitions_for_topic(self.topic)

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
        return _merged([batch, more])

    def _count(self, committed: Committed) -> None:
        """Stats and metrics of a committed batch."""
        out = committed.batch
        self.stats.batches += 1
        self.stats.events_scored += out.scored
        self.stats.alerts += out.alerts
        self.stats.dead_lettered += out.dead_lettered
        self.stats.duplicates_dropped += out.duplicates_dropped
        self.stats.labels_applied += out.labels_applied
        self.stats.terminal_deltas_applied += out.deltas_applied
        self.stats.states_reloaded += out.reloaded
        self._let_dormant_go(committed)
        m = self.metrics
        m.inc("txsentinel_batches_total")
        m.inc("txsentinel_events_scored_total", out.scored)
        m.inc("txsentinel_alerts_total", out.alerts)
        m.inc("txsentinel_events_dead_lettered_total", out.dead_lettered)
        m.inc("txsentinel_duplicates_dropped_total", out.duplicates_dropped)
        m.inc("txsentinel_labels_applied_total", out.labels_applied)
        m.inc("txsentinel_terminal_deltas_applied_total", out.deltas_applied)
        m.inc("txsentinel_states_reloaded_total", out.reloaded)
        m.set("txsentinel_states_in_memory", len(self.scorer.accounts_in_memory))
        m.set("txsentinel_consumer_lag", self._lag())
        m.observe("txsentinel_batch_events", out.events)
        m.observe("txsentinel_commit_seconds", committed.seconds)
        if out.created_ms:
            waited_ms = committed.at_ms - np.asarray(out.created_ms, np.float64)
            m.observe("txsentinel_latency_seconds", np.maximum(waited_ms, 0.0) / 1000.0)
        if log.isEnabledFor(logging.DEBUG):
            phases = " ".join(f"{k}_s={v:.4f}" for k, v in out.seconds.items())
            log.debug(
                "batch events=%d scored=%d %s wait_s=%.4f commit_s=%.4f",
                out.events, out.scored, phases, out.waited_s, committed.seconds,
            )  # fmt: skip

    def _let_dormant_go(self, committed: Committed) -> None:
        """Note where the committed batch's state records went; evict what memory holds beyond capacity."""
        out = committed.batch
        self.dormant.committed(
            {
                key: (partition, future.value.offset)
                for (topic, key, _, partition), future in zip(out.records, out.sent, strict=True)
                if topic == self.changelog
            }
        )
        evicted = self.dormant.to_evict(self.scorer.accounts_in_memory, out.seq)
        for account in evicted:
            self.scorer.evict(account)  # its latest state is a committed record: it comes back exactly
        self.stats.states_evicted += len(evicted)
        self.metrics.inc("txsentinel_states_evicted_total", len(evicted))

    def _lag(self) -> int:
        """Records of the assigned partitions behind their high watermark (known from the last fetches)."""
        lag = 0
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            if high is not None:
                lag += max(high - self.consumer.position(tp), 0)
        return lag

    def _rewind(self, batch: dict, revoked: Iterable[int] = ()) -> None:
        """Undo uncommitted batches in memory (their transaction is aborted already).

        Their accounts may be half-applied, so they are reloaded from the changelog, terminal state is
        restored again (the table, then the labels and deltas after it), and the consumer goes back to the
        group's committed offsets. Partitions in `revoked`
        are leaving this instance: their accounts are dropped, not reloaded.
        """
        partitions = sorted({tp.partition for tp in batch})
        accounts = {a for p in partitions for a in self.scorer.accounts_in_partition(p)}
        accounts |= {KEYS.deserialize(None, None, r.key) for rs in batch.values() for r in rs if r.key}
        for account in accounts & set(self.scorer.accounts_in_memory):
            self.scorer.evict(account, discard_changes=True)
        self.scorer.take_changed()
        leaving = set(revoked)
        kept = [p for p in partitions if p not in leaving]
        self._restore(kept)
        self._restore_terminals()  # drops the batches' own terminal counts; labels and deltas are read again
        for tp in batch:
            if tp.partition not in kept:
                continue
            committed = self.consumer.committed(tp)
            if committed is None:
                self.consumer.seek_to_beginning(tp)  # auto_offset_reset=earliest: nothing committed yet
            else:
                self.consumer.seek(tp, committed)

    # -- terminal state -----------------------------------------------------------------------------------
    def _restore_terminals(self) -> None:
        """Terminal state = the table + every label and delta after its positions (consumers/terminals/table.py);
        then a new delta session: whatever this instance folds from now on, it also writes."""
        cfg, featurizer = self.cfg, self.scorer.featurizer
        started = time.monotonic()
        self.feed.start_from_table(featurizer, self.restorer, cfg.topic("terminal_table"))
        self.stats.restored_terminals += len(featurizer.terminals)
        featurizer.terminal_journal = []  # what the rewound batches folded is gone with the old table
        got = self.feed.read(to_high_watermark=True)  # every session's deltas: none of them is folded yet
        got.fold_into(featurizer)
        self.stats.labels_applied += len(got.labels)
        self.metrics.inc("txsentinel_labels_applied_total", len(got.labels))
        self.terminal_restores += 1
        self.batches.session = f"{self.instance_tag}/{self.terminal_restores}".encode()
        log.info(
            "terminal state restored terminals=%d deltas=%d labels=%d session=%s seconds=%.3f",
            len(featurizer.terminals), len(got.deltas), len(got.labels), self.batches.session.decode(),
            time.monotonic() - started,
        )  # fmt: skip

    def _fold_feed_while_idle(self) -> None:
        """No events: still fold in labels and other instances' deltas, so the next event sees them all."""
        try:
            labels, deltas = self.batches.fold_feed()
        except Exception as error:  # the next batch reads the feed again, and recovers if it fails there
            log.warning("reading labels and terminal deltas between batches failed error=%r", error)
            return
        self.stats.labels_applied += labels
        self.stats.terminal_deltas_applied += deltas
        self.metrics.inc("txsentinel_labels_applied_total", labels)
        self.metrics.inc("txsentinel_terminal_deltas_applied_total", deltas)

    def _run_writer(self, partitions: Iterable[int], assigned: bool) -> None:
        """The table writer runs where transactions partition 0 is (consumers/terminals/writer.py), unless
        it runs on its own (terminal_table_writer: external)."""
        if 0 not in partitions or self.cfg.terminal_table_writer != "embedded":
            return
        if assigned and not self.writer.running:
            self.writer.start()
        elif not assigned:
            self.writer.stop()

    # -- rebalance ---------------------------------------------------------------------------------------
    def on_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self.rebalance_callbacks += 1
        partitions = sorted(tp.partition for tp in revoked if tp.topic == self.topic)
        self._settle_before_revoking(partitions)
        self._run_writer(partitions, assigned=False)
        evicted = 0
        for p in partitions:
            leaving = self.scorer.accounts_in_partition(p)
            for account in leaving:
                # No batch is open between polls, so nothing unsaved is lost; discard_changes only guards
                # against an account whose events would be redelivered anyway (uncommitted offsets).
                self.scorer.evict(account, discard_changes=True)
            self.dormant.forget(leaving)
            evicted += len(leaving)
        self.assigned -= set(partitions)
        self.dormant.drop_partitions(partitions)
        self.stats.rebalances += 1
        self.metrics.set("txsentinel_assigned_partitions", len(self.assigned))
        self.metrics.set("txsentinel_states_in_memory", len(self.scorer.accounts_in_memory))
        log.info("partitions revoked partitions=%s evicted_states=%d", partitions, evicted)

    def _settle_before_revoking(self, partitions: list[int]) -> None:
        """The batch in flight commits under the generation that is ending, or is aborted and rewound."""
        try:
            self._settle()
        except Exception as error:  # kafka-python logs and swallows callback errors: handled here
            failed = self.pipeline.take_failed()
            self._end_failed_transaction(error)
            log.warning("batch aborted at revocation error=%r; it is redelivered", error)
            self._rewind(failed.polled, revoked=partitions)

    def on_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self.rebalance_callbacks += 1
        partitions = sorted(tp.partition for tp in assigned if tp.topic == self.topic)
        log.info("partitions assigned partitions=%s", partitions)
        try:
            self._restore(partitions)
        except BaseException as error:  # kafka-python logs and swallows callback errors: hand it to run()
            self.fatal = error
            return
        self.assigned |= set(partitions)
        self.metrics.set("txsentinel_assigned_partitions", len(self.assigned))
        self._run_writer(partitions, assigned=True)

    def _restore(self, partitions: list[int]) -> None:
        """Read changelog partitions from the beginning up to their high watermarks (read_committed) into the
        scorer, up to its capacity; the other accounts' places are noted (consumers/service/dormant.py)."""
        if not partitions:
            return
        started = time.monotonic()
        # Memory takes the accounts written most recently, up to its capacity; the others stay dormant in
        # the changelog, their places noted, until they return (consumers/service/dormant.py).
        room = max(self.dormant.capacity - len(self.scorer.accounts_in_memory), 0)
        latest, where, read = read_recent(
            self.restorer, self.changelog, partitions, self.cfg.restore_timeout_s, keep=room
        )
        for account, value in latest.items():
            self.scorer.restore_account(account, value)  # refuses another model's state, saying what to do
        restored = len(latest)
        self.dormant.drop_partitions(partitions)
        self.dormant.restored(where, latest, self.batches.seq if self.batches else 0)
        seconds = time.monotonic() - started
        self.stats.restored_states += restored
        self.stats.restore_s += seconds
        self.metrics.inc("txsentinel_restore_seconds_total", seconds)
        self.metrics.inc("txsentinel_restored_states_total", restored)
        self.metrics.set("txsentinel_states_in_memory", len(self.scorer.accounts_in_memory))
        log.info(
            "restore done partitions=%s records=%d states=%d dormant=%d seconds=%.3f",
            partitions, read, restored, len(where) - restored, seconds,
        )  # fmt: skip

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


def _merged(batches: list[dict]) -> dict:
    """Polled batches as one: {TopicPartition: records}, for one rewind."""
    merged: dict = {}
    for batch in batches:
        for tp, records in batch.items():
            merged[tp] = [*merged.get(tp, ()), *records]
    return merged
