"""The terminal table's one writer: folds every terminal delta and every label into the compacted table.

It runs on a thread of the service instance that owns partition 0 of `transactions` (the consumer group picks
that instance, and moves the writer when it moves the partition), with its own Kafka clients; or, with
`terminal_table_writer: external`, in a process of its own (`txsentinel terminal-writer`, run_writer below),
which keeps its work off the scorers' interpreter. Its
transactional id is the same for every instance of a deployment
({transactional_id_prefix}-terminal-table-{group_id}),
so a writer that starts fences any older one, and only then reads the table: a zombie can never commit over
a table the new writer has read.

A run: start the producer (init_transactions), read the table (consumers/terminal_table.read_table), seek
the feed to its positions, then fold what arrives: a poll every READ_EVERY_S, and one after another while
polls come back full (a backlog). Every `flush_s` when something changed, or as soon as FLUSH_RECORDS
terminals and dead letters wait, ONE transaction writes the changed terminals, the labels and delta records
that do not decode to `dead-letter` (the writer is the one reader that dead-letters them, so each goes there
once however many instances read it), and the positions, last. The table is then
exactly the fold of everything before its positions, less the terminals let go: every EVICT_EVERY_S a
flush also deletes the idle ones (consumers/terminals/idle.py) with a tombstone each, so the table does not
grow for ever, and beyond `max_terminals_in_memory` the writer lets go of those with the least history
(consumers/terminals/idle.py) as soon as a fold takes it past the cap, their tombstones in the next flush.
Tombstones beyond FLUSH_RECORDS go first, in transactions of their own that end with the positions the table
already has: after each, the table is the fold of everything before those positions, less the terminals let go
so far.
A failed run (broker away, fenced) is logged and started again after a pause, from the table. On stop it
drains what has arrived and flushes (a writer that is behind, its polls full for longer than READ_EVERY_S,
flushes what it has folded).
"""

import logging
import threading
import time
from dataclasses import asdict, dataclass

from kafka import KafkaProducer
from kafka.serializer import DefaultSerializer

from consumers.runtime.compacted import PositionLostError, Reader
from consumers.runtime.endpoints import StatusServer
from consumers.runtime.metrics import Metrics
from consumers.runtime.probes import Probes
from consumers.runtime.settings import ServeConfig
from consumers.runtime.signals import stop_on_signals
from consumers.runtime.topics import ensure_topics
from consumers.scoring.message_limits import MessageLimits
from consumers.scoring.outputs import dead_letter
from consumers.terminals.feed import FeedRead, FeedReader, poll_records
from consumers.terminals.idle import TerminalEviction
from consumers.terminals.table import Positions, flush_records
from pipeline.features.stream import StreamingFeaturizer

log = logging.getLogger(__name__)

RETRY_AFTER_S = 2.0  # a failed run is started again after this pause
# Between reads of the feed (at most terminal_table_flush_s). A read that finds records costs a fetch round
# trip and a wake-up of the writer's threads; every scored batch writes a delta, so reading as records
# arrive would wake them once a batch, on the scorers' core when the writer is embedded. A read whose poll
# came back full is followed by the next at once: a backlog (a bulk import of labels, a catch-up after an
# outage) is read as fast as it folds, and the flush and stop are still looked at after every poll.
READ_EVERY_S = 1.0
DRAIN_TIMEOUT_S = 10.0  # on stop; what is not drained by then stays in the topics for the next writer
# A flush sends its records in chunks and, between chunks, pauses PAUSE_PER_BUSY times as long as the chunk
# took: the writer then holds at most a quarter of the interpreter while it flushes. Each record costs ~30 us
# of kafka-python's send, so thousands of terminals in one go would stall the scorer sharing the process
# (p99 latency at 3,000 events/s: ~125 ms with unpaced flushes, ~90 ms with no writer in the process).
# A writer that is behind (its polls have come back full for longer than READ_EVERY_S: _lag) does not pause:
# pausing would only keep it behind.
FLUSH_CHUNK = 100
PAUSE_PER_BUSY = 3.0
# Records of one transaction, about: the changed terminals and dead letters folded since the last flush
# trigger a flush when they reach it (one poll more at most: consumers/terminals/feed.POLL_TERMINAL_EVENTS),
# and tombstones beyond it go in transactions of their own. At ~30 us a record sent, ~120 us paced, a
# transaction is open ~1-4 s, far inside transaction_timeout_ms (30 s), past which the broker aborts it and
# the writer would build the same flush again from the same table, for ever.
FLUSH_RECORDS = 20_000


@dataclass
class WriterStats:
    flushes: int = 0
    terminals_written: int = 0
    dead_lettered: int = 0  # labels and delta records that do not decode
    terminals_evicted: int = 0  # idle terminals deleted from the table (a tombstone each)
    terminals_capped: int = 0  # let go beyond max_terminals_in_memory (a tombstone each, unless they return)
    failed_runs: int = 0


class TerminalTableWriter:
    def __init__(self, cfg: ServeConfig, bootstrap: str, metrics: Metrics, probes: Probes | None = None):
        self.cfg, self.bootstrap, self.metrics = cfg, bootstrap, metrics
        # Its own process's probes (run_writer); embedded in a service, the writer is no part of its readiness.
        self.probes = probes or Probes()
        # One per deployment (its group): writers of other deployments on the cluster never fence this one.
        self.transactional_id = f"{cfg.transactional_id_prefix}-terminal-table-{cfg.group_id}"
        self.stats = WriterStats()
        # Refuses an idle time that would change features; caps what the writer holds (max_terminals_in_memory).
        self.eviction = TerminalEviction(cfg.terminal_idle_days, cfg.max_terminals_in_memory, "writer")
        for name in ("txsentinel_terminals_capped_total", "txsentinel_labels_held_total"):
            metrics.inc(name, 0, label="writer")  # there from the start, at 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        # A fresh event per start: a thread that outlived its stop() keeps its own, set, and ends when it can
        # (should it overlap the new one, the new producer's init_transactions fences it).
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, args=(self._stop,), name="txs-terminal-writer", daemon=True
        )
        self._thread.start()
        log.info("terminal table writer started transactional_id=%s", self.transactional_id)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Drain, flush and close; returns once the thread has ended (or `timeout_s` has passed)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("terminal table writer still running %.0f s after stop", timeout_s)
        self._thread = None

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.probes.beat()  # a run that fails and starts again (the broker away) is still alive
            try:
                self._run(stop)
            except Exception as error:
                self.stats.failed_runs += 1
                self.probes.wait_for("table", f"the last run failed ({error!r}); starting again")
                then = (
                    "stopping" if stop.is_set() else f"starting again from the table in {RETRY_AFTER_S:.0f} s"
                )
                # A lost position fails every run alike until someone acts (its message says how): an error.
                level = logging.ERROR if isinstance(error, PositionLostError) else logging.WARNING
                log.log(
                    level,
                    "terminal table writer failed error=%r; %s (what it had not flushed is still in the "
                    "deltas and labels after the table's positions)",
                    error, then, exc_info=log.isEnabledFor(logging.DEBUG),
                )  # fmt: skip
                stop.wait(RETRY_AFTER_S)

    def _run(self, stop: threading.Event) -> None:
        cfg = self.cfg
        security = cfg.kafka_security
        producer = KafkaProducer(
            bootstrap_servers=self.bootstrap,
            transactional_id=self.transactional_id,
            transaction_timeout_ms=cfg.transaction_timeout_ms,
            retry_backoff_ms=cfg.producer_retry_backoff_ms,
            key_serializer=DefaultSerializer(),  # terminal ids (str) and dead letters' original keys (bytes)
            **security,
        )
        reader = feed = None
        try:
            producer.init_transactions()  # fences an older writer before the table is read (module doc)
            reader = Reader.connect(self.bootstrap, "txsentinel-terminal-writer", **security)
            feed = FeedReader.connect(
                self.bootstrap, "txsentinel-terminal-writer-feed", reader, cfg.topic("labels"),
                cfg.topic("terminal_deltas"), cfg.restore_timeout_s, MessageLimits.of(cfg), cfg.lost_feed_position,
                lambda records: self.metrics.inc("txsentinel_feed_records_lost_total", records),
                lambda: self.metrics.inc("txsentinel_labels_held_total", label="writer"), **security,
            )  # fmt: skip
            feed.poll_records = poll_records(cfg.max_poll_records)
            featurizer = StreamingFeaturizer()
            left_out = feed.start_from_table(
                featurizer, reader, cfg.topic("terminal_table"), row_limit=self.eviction.row_limit
            )
            self.probes.done("table")
            flushed_at = feed.positions()
            changed: set[str] = set()
            # Let go beyond the cap since the last flush, and the records the table read left out: deleted by
            # the next flush, unless held again by then (their deltas folded anew), so every reader agrees.
            capped = self._cap(featurizer, set(left_out))
            bad: list = []
            last_flush = time.monotonic()
            stopping = stop.is_set()
            full_since = None  # when the polls began to come back full, while they do
            behind = False  # they have for longer than READ_EVERY_S: the writer is not keeping up
            while True:
                self.probes.beat()
                # Stopping: everything committed so far, this instance's last batch included, then a flush;
                # unless behind, where that would be a backlog in one flush: the next writer reads it.
                got = feed.read(to_high_watermark=stopping and not behind, timeout_s=DRAIN_TIMEOUT_S)
                self._fold(featurizer, got, changed)
                self._cap(featurizer, capped)  # at once, not at the flush: the fold may have brought a flood
                bad += got.bad
                full_since, behind = _lag(full_since, got.full)
                due = time.monotonic() - last_flush >= cfg.terminal_table_flush_s
                if stopping or due or len(changed) + len(bad) >= FLUSH_RECORDS:
                    read_to = feed.positions()
                    evicted = self.eviction.evict(featurizer.terminals)
                    if changed or bad or evicted or capped or read_to != flushed_at:
                        self._flush(
                            producer, featurizer, changed, bad, read_to, not (stopping or behind), evicted,
                            capped, table_at=flushed_at,
                        )  # fmt: skip
                        changed, capped, bad, flushed_at = set(), set(), [], read_to
                    last_flush = time.monotonic()
                if stopping:
                    return
                stopping = stop.wait(0 if got.full else min(READ_EVERY_S, cfg.terminal_table_flush_s))
        finally:
            for name, close in (
                ("producer", lambda: producer.close(timeout=5)),
                ("reader", lambda: reader is not None and reader.close()),
                ("feed", lambda: feed is not None and feed.close()),
            ):
                try:
                    close()
                except Exception as error:  # closing the rest matters more
                    log.warning("terminal table writer: closing the %s failed error=%r", name, error)

    def _cap(self, featurizer: StreamingFeaturizer, capped: set[str]) -> set[str]:
        """Let go of the terminals with the least history beyond max_terminals_in_memory, adding them to
        `capped` (their tombstones go in the next flush); `capped`."""
        gone = self.eviction.cap(featurizer.terminals)
        capped.update(gone)
        self.stats.terminals_capped += len(gone)
        self.metrics.inc("txsentinel_terminals_capped_total", len(gone), label="writer")
        return capped

    def _transaction(self, producer, records: list, paced: bool) -> None:
        producer.begin_transaction()
        for start in range(0, len(records), FLUSH_CHUNK):
            began = time.monotonic()
            for topic, key, value, partition in records[start : start + FLUSH_CHUNK]:
                producer.send(topic, key=key, value=value, partition=partition)
            if paced and start + FLUSH_CHUNK < len(records):
                time.sleep(PAUSE_PER_BUSY * (time.monotonic() - began))
        producer.commit_transaction()
        self.probes.beat()  # a flush in many transactions is alive while they commit
        self.metrics.inc("txsentinel_terminal_table_flushes_total")

    @staticmethod
    def _fold(featurizer: StreamingFeaturizer, got: FeedRead, changed: set[str]) -> None:
        got.fold_into(featurizer)
        for op in got.deltas:
            changed.update(op.terminals)
        # A fraud label reports its event; one saying not fraud may withdraw a report, at a terminal held.
        changed.update(
            label.terminal_id
            for label in got.labels
            if label.is_fraud or label.terminal_id in featurizer.terminals
        )

    def _flush(
        self,
        producer,
        featurizer,
        changed: set[str],
        bad: list,
        positions,
        paced: bool = True,
        evicted=(),
        capped=(),
        *,
        table_at: Positions,
    ) -> None:
        """ONE transaction: the dead letters, the tombstones of the terminals let go (`evicted` idle,
        `capped` beyond the cap, unless back since), the changed terminals still held, the positions last.
        Tombstones beyond FLUSH_RECORDS go before it, in transactions of their own that end with `table_at`,
        the positions the table holds. `paced`: in chunks with pauses between them (FLUSH_CHUNK); a writer
        that is stopping or behind flushes at once."""
        cfg = self.cfg
        table, dead_letter_topic = cfg.topic("terminal_table"), cfg.topic("dead_letter")
        held = featurizer.terminals
        # A terminal let go over the cap whose events came again since is held anew: its record, no tombstone.
        gone = sorted({t for t in (*evicted, *capped) if t not in held})
        changed = {t for t in changed if t in held}

        def table_records(changed: set[str], positions: Positions) -> list:
            return [
                (table, key, value, 0)
                for key, value in flush_records(
                    held, changed, positions, cfg.topic("labels"), cfg.topic("terminal_deltas")
                )
            ]

        dead = [(dead_letter_topic, *dead_letter(record, error), None) for record, error in bad]
        tombstones = [(table, terminal, None, 0) for terminal in gone]  # compaction deletes them
        terminals = table_records(changed, positions)  # the positions last
        room = max(0, FLUSH_RECORDS - len(dead) - len(terminals))
        alone = max(0, len(tombstones) - room)  # the first ones, in transactions of their own
        for start in range(0, alone, FLUSH_RECORDS - 1):
            part = tombstones[start : min(alone, start + FLUSH_RECORDS - 1)]
            self._transaction(producer, part + table_records(set(), table_at), paced)
        self._transaction(producer, dead + tombstones[alone:] + terminals, paced)
        self.stats.flushes += 1
        self.stats.terminals_written += len(changed)
        self.stats.dead_lettered += len(bad)
        self.stats.terminals_evicted += len(evicted)
        self.metrics.inc("txsentinel_terminals_evicted_total", len(evicted))
        self.metrics.inc("txsentinel_events_dead_lettered_total", len(bad))
        log.debug(
            "terminal table flushed terminals=%d tombstones=%d dead_letters=%d",
            len(changed),
            len(gone),
            len(bad),
        )


def _lag(full_since: float | None, full: bool) -> tuple[float | None, bool]:
    """(when the polls began to come back full, or None; whether the writer is behind) after a poll.

    A full poll alone is not a backlog: more than a poll's records arrive in READ_EVERY_S whenever the feed
    brings more than poll_records() a second (one delta per scored batch per instance), and the polls right
    after catch up. Only polls full for longer than READ_EVERY_S say the writer reads slower than the feed."""
    if not full:
        return None, False
    now = time.monotonic()
    since = now if full_since is None else full_since
    return since, now - since > READ_EVERY_S


def run_writer(cfg: ServeConfig, bootstrap: str, stop_event: threading.Event | None = None) -> WriterStats:
    """`txsentinel terminal-writer`: the table writer in a process of its own, until `stop_event` is set or
    SIGTERM/SIGINT arrives; it drains and flushes before returning. Creates missing topics like serve."""
    stop = stop_event or threading.Event()
    metrics = Metrics()
    # Alive while its loop comes round (once a second, or after a table read bounded by restore_timeout_s).
    probes = Probes(stall_after_s=cfg.restore_timeout_s + cfg.max_poll_interval_ms / 1000)
    probes.wait_for("table", "creating topics, starting the producer, reading the terminal table")
    metrics.read_from("txsentinel_ready", lambda: probes.ready()[0])
    with stop_on_signals(stop):
        server = (
            StatusServer(metrics, probes, cfg.metrics_host, cfg.metrics_port) if cfg.metrics_port else None
        )
        writer = None
        try:
            ensure_topics(cfg, bootstrap)
            writer = TerminalTableWriter(cfg, bootstrap, metrics, probes)
            writer.start()
            stop.wait()
        finally:
            probes.wait_for("stop", "stopping: draining and flushing")
            if writer is not None:
                writer.stop()
            if server is not None:
                server.close()
    log.info("terminal writer stopped %s", writer.stats, extra=asdict(writer.stats))
    return writer.stats
