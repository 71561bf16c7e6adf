"""A polled batch -> a ScoredBatch: every record its transaction will write, in send order.

In memory only: nothing is sent here (consumers/service/commit_pipeline.py sends it once the previous batch's commit
has returned). In order:
1. every `terminal_feed_interval_ms`, the labels and the other instances' terminal deltas that have arrived
   are applied to the terminal state (consumers/terminals/feed.py; records of either that do not decode are
   skipped, and the table writer dead-letters them); now and then, idle terminals leave it
   (consumers/terminals/idle.py);
2. each message is decoded and validated against the message settings (bad ones: dead letters with the
   reason and the original bytes), and its key checked against its account_id (key_mismatch: a dead letter,
   or the record written again under its account's key); accounts of the batch that memory let go of are
   read back from the changelog (consumers/service/dormant.py);
3. Scorer.score_batch, in partition order (one partition's records keep their order); the events it rejects
   (replays, rows that are not finite) are dead letters too;
4. records: scores (and alerts, with their reasons: consumers/scoring/explain.py) to the input event's
   partition number, the batch's terminal delta (keyed by this instance's session,
   consumers/terminals/deltas.py), then the changed accounts' states to the changelog partition of the event
   that changed them, and, past max_accounts_kept, a tombstone for each account let go
   (consumers/service/dormant.py).

The last resort: a batch that fails for a reason nobody foresaw is rewound by the service and read again
`careful`ly: each event scored on its own under a checkpoint of its account and terminal
(Scorer.checkpoint), so the one that fails is rolled back and dead-lettered with the exception's text, and
the rest go on exactly as if it had never come.
"""

import logging
import math
import time
from collections.abc import Callable
from typing import NamedTuple

from kafka.structs import OffsetAndMetadata

from consumers.runtime.key_partition import key_partition
from consumers.runtime.settings import ServeConfig
from consumers.scoring.explain import encode_alert
from consumers.scoring.message_limits import MessageError, MessageLimits
from consumers.scoring.messages import Transaction, UnknownFields, decode_transaction
from consumers.scoring.outputs import dead_letter, encode_scores
from consumers.scoring.scorer import Scorer
from consumers.service.commit_pipeline import OutputRecord, ScoredBatch
from consumers.service.dormant import DormantStates
from consumers.service.shadow import ShadowSide
from consumers.terminals.deltas import encode_deltas
from consumers.terminals.feed import FeedReader, poll_records
from consumers.terminals.idle import TerminalEviction

log = logging.getLogger(__name__)

# While polls of the feed come back full (a bulk import of labels, an instance that fell behind), a read goes
# on for this long at most (and one poll more: feed.POLL_TERMINAL_EVENTS): a batch waits no longer for it,
# and at the default terminal_feed_interval_ms (250) the feed takes at most ~40% of the instance's time
# until it has caught up. Scoring keeps the rest: a feed that lags only leaves terminal counts behind for a
# while, a batch that waits delays every score in it.
FEED_READ_S = 0.1


class _Event(NamedTuple):
    record: object  # the consumer's record
    tx: Transaction


class BatchScorer:
    def __init__(
        self,
        cfg: ServeConfig,
        scorer: Scorer,
        feed: FeedReader,
        model_version: str,
        co_partitioned: bool,
        dormant: DormantStates,
        read_states: Callable[..., dict[str, bytes]],
        shadow: ShadowSide | None = None,
        changelog: str | None = None,
        partitions: int | None = None,
    ):
        """`partitions`: of `transactions`, to check each record is on its key's (None: not checked)."""
        self.scorer, self.feed = scorer, feed
        self.session = b""  # the key of this instance's deltas since its last restore (set by the service)
        self.dormant, self.read_states = (
            dormant,
            read_states,
        )  # read_states: consumers.runtime.compacted.read_at
        self.seq = 0  # the last batch's
        self.feed_interval_s = cfg.terminal_feed_interval_ms / 1000
        self.feed_read_at = -math.inf  # time.monotonic() of the last read of the feed
        feed.poll_records = poll_records(cfg.max_poll_records)  # a poll's fold fits FEED_READ_S, about
        # Refuses an idle time that would change features; caps what the scorer holds (max_terminals_in_memory).
        self.eviction = TerminalEviction(cfg.terminal_idle_days, cfg.max_terminals_in_memory, "scorer")
        self.model_version = model_version
        self.limits = MessageLimits.of(cfg)  # refuses bounds it cannot keep, before the service starts
        # Input messages with fields of no known name (unknown_fields: ignore), transactions' and labels'.
        self.unknown = feed.unknown = UnknownFields()
        self.rekey = cfg.key_mismatch == "rekey"
        # key -> the partition its producers put it on, or None: unchecked (consumers/runtime/key_partition.py)
        if partitions is not None and partitions < 1:
            raise ValueError(f"{cfg.topic('transactions')!r} has {partitions} partitions: nothing to read")
        self.home = key_partition(cfg.producer_partitioner, partitions or 0)
        self.partitions = partitions  # of `transactions` at the start; records beyond them are refused
        self.partitioner = f"producer_partitioner {cfg.producer_partitioner}, {partitions} partitions"
        # Scores and alerts go to their input event's partition number when the topics have as many
        # partitions as `transactions` (those the service creates do): the key's partition under the default
        # partitioner, without kafka-python's pure-Python murmur2 per record (~10 us of a ~40 us send).
        self.co_partitioned = co_partitioned
        self.scores_topic, self.alerts_topic = cfg.topic("scores"), cfg.topic("alerts")
        self.dead_letter_topic, self.changelog, self.deltas_topic = (
            cfg.topic("dead_letter"), cfg.topic("changelog"), cfg.topic("terminal_deltas")
        )  # fmt: skip
        self.transactions_topic = cfg.topic("transactions")
        self.shadow = shadow  # the challenger's records and states (consumers/service/shadow.py), or None
        if changelog is not None:  # the served model's own, when it was promoted from shadow
            self.changelog = changelog

    def score(self, batch: dict, careful: bool = False) -> ScoredBatch:
        """Decode, apply labels, score and encode a polled batch ({TopicPartition: records}); `careful`:
        one event at a time, each under a checkpoint (the module's last resort)."""
        started = time.monotonic()
        self.seq += 1
        out = ScoredBatch(batch, seq=self.seq)
        out.labels_applied, out.deltas_applied = self.fold_feed()  # they count for all this batch's events
        events = self._decode(batch, out)
        out.unknown_fields, names = self.unknown.take()
        if names:  # once per name (UnknownFields keeps the first few): what the producers send that is unused
            log.info(
                "input carries fields the service does not read, ignored: %s", ", ".join(map(repr, names))
            )
        self._bring_back(out, {e.tx.account_id for e in events})
        decoded = time.monotonic()
        if careful:
            out.careful = True
            for event in events:
                self._score_alone(out, event)
        else:
            out.records += self._score(out, events)
        self._let_accounts_go(out)
        self.let_terminals_go()  # what the feed and the batch brought past the cap goes before the next batch
        out.seconds = {"decode": decoded - started, "score": time.monotonic() - decoded}
        return out

    def _decode(self, batch: dict, out: ScoredBatch) -> list[_Event]:
        events = []
        now_us = out.clock_us = time.time_ns() // 1000  # the clock ts is bounded by (max_ts_skew_s)
        for tp in sorted(batch, key=lambda tp: tp.partition):  # one partition's records keep their order
            for record in batch[tp]:
                out.offsets[tp] = OffsetAndMetadata(record.offset + 1, "", -1)
                out.events += 1
                if self.partitions is not None and record.partition >= self.partitions:
                    self._dead_letter(out, record, self._beyond_its_partitions(record.partition))
                    continue
                try:
                    if record.value is None:
                        raise MessageError("null value (a tombstone): expected a JSON transaction")
                    tx = decode_transaction(record.value, self.limits, now_us, self.unknown)
                except MessageError as error:
                    self._dead_letter(out, record, error)
                    continue
                except Exception as error:  # the decoder is total; should it not be, one record stops nothing
                    log.exception("the decoder failed at %s", _where(record))
                    self._dead_letter(out, record, MessageError(f"the decoder failed: {error!r}"[:500]))
                    continue
                key = tx.account_id.encode()
                if record.key != key:
                    if self.rekey:  # to the partition its account's key picks; read from there, in order
                        home = None if self.home is None else self.home(key)
                        out.records.append((self.transactions_topic, tx.account_id, record.value, home))
                        out.rekeyed += 1
                    else:
                        self._dead_letter(out, record, _another_key(record.key, key))
                    continue
                if self.home is not None and (home := self.home(key)) != record.partition:
                    # Never rekeyed: it has its key already, and sent again it could only go back and forth
                    # between instances that disagree on the rule or the partition count.
                    self._dead_letter(out, record, self._off_its_partition(record.partition, key, home))
                    continue
                events.append(_Event(record, tx))
        return events

    def _beyond_its_partitions(self, partition: int) -> MessageError:
        return MessageError(
            f"record on partition {partition}, beyond the {self.partitions} partitions of "
            f"{self.transactions_topic!r} this service started with: no state of its accounts is kept for it. "
            "The topic has grown; growing it is a new deployment (a new topic_prefix), then replay"
        )

    def _off_its_partition(self, partition: int, key: bytes, home: int) -> MessageError:
        return MessageError(
            f"record on partition {partition}, but its key {key[:80]!r} belongs on partition {home} "
            f"({self.partitioner}): its account's state lives with that partition, so here it would be scored "
            "without its history and split the state. Send it by its key; producer_partitioner names the "
            "producers' rule. Or the topic has grown since the start: that is a new deployment"
        )

    def _score(self, out: ScoredBatch, events: list[_Event]) -> list[OutputRecord]:
        """Score events and encode everything their transaction writes; dead letters for the rejected."""
        records: list[OutputRecord] = []
        scorer = self.scorer
        dropped_before, repaired_before = scorer.stats.duplicates_dropped, scorer.stats.positions_repaired
        scored = scorer.score_batch(
            [e.tx for e in events],
            [(e.record.partition, e.record.offset) for e in events],
            clock_us=out.clock_us,
        )
        for rejected in scored.rejected:
            record = events[rejected.index].record
            records.append(self._dead_letter_record(record, MessageError(rejected.reason)))
            out.dead_lettered += 1
            out.replays_dropped += rejected.replay
        out.duplicates_dropped += scorer.stats.duplicates_dropped - dropped_before
        out.positions_repaired += scorer.stats.positions_repaired - repaired_before
        partition_of = {}
        values = encode_scores(scored.records, self.model_version, self.limits.timestamp_format)
        for i, (s, value) in enumerate(zip(scored.records, values, strict=True)):
            partition = s.position[0] if self.co_partitioned else None
            records.append((self.scores_topic, s.account_id, value, partition))
            if s.alert:  # the same record, with the reasons behind it
                records.append(
                    (self.alerts_topic, s.account_id, encode_alert(value, scored.reasons.get(i)), partition)
                )
                out.alerts += 1
            partition_of[s.account_id] = s.position[0]
        if self.shadow is not None:
            partitions = [s.position[0] if self.co_partitioned else None for s in scored.records]
            records += self.shadow.records(scored.records, scored.shadow_logit, partitions)
        out.scored += len(scored.records)
        created = {(e.record.partition, e.record.offset): e.record.timestamp for e in events}
        out.created_ms += [created[s.position] for s in scored.records]  # duplicates dropped: no score
        # These events' terminal counts, for the other instances and the table writer.
        for deltas in encode_deltas(scorer.featurizer.take_terminal_journal()):
            records.append((self.deltas_topic, self.session, deltas, None))
        # Only now forget the changed set: should anything below fail, the rewind evicts and restores.
        changed = sorted(scorer.take_changed())
        for account, state in zip(changed, scorer.account_states_bytes(changed), strict=True):
            records.append((self.changelog, account, state, partition_of[account]))
        if self.shadow is not None:  # in the same transaction: exactly once for both models
            records += self.shadow.state_records(changed, partition_of)
        return records

    def _score_alone(self, out: ScoredBatch, event: _Event) -> None:
        """The last resort: one event under a checkpoint; if it fails, rolled back and dead-lettered."""
        counts = (out.scored, out.alerts, out.dead_lettered, out.replays_dropped, out.duplicates_dropped)
        created = len(out.created_ms)
        checkpoint = self.scorer.checkpoint([event.tx.account_id], [event.tx.terminal_id])
        try:
            out.records += self._score(out, [event])
        except Exception as error:
            self.scorer.rollback(checkpoint)
            (out.scored, out.alerts, out.dead_lettered, out.replays_dropped, out.duplicates_dropped) = counts
            del out.created_ms[created:]
            log.exception("event at %s failed alone: dead-lettered", _where(event.record))
            self._dead_letter(out, event.record, MessageError(f"scoring failed: {error!r}"[:500]))

    def _bring_back(self, out: ScoredBatch, accounts: set[str]) -> None:
        """Read the states of the batch's dormant accounts back from the changelog (consumers/service/dormant.py)."""
        self.dormant.touched(accounts, out.seq)
        returning = self.dormant.returning(accounts, self.scorer.accounts_in_memory)
        if not returning:
            return
        states = self.read_states(returning)
        # One batched restore; a corrupt record is left out, logged, its account starting from no history
        out.states_discarded += len(self.scorer.restore_accounts(list(states), list(states.values())))
        if self.shadow is not None:
            corrupt_before = self.shadow.model.corrupt
            self.shadow.bring_back(list(returning), lambda topic, wanted: self.read_states(wanted, topic))
            out.states_discarded += self.shadow.model.corrupt - corrupt_before
        out.reloaded = len(returning)

    def _let_accounts_go(self, out: ScoredBatch) -> None:
        """Past max_accounts_kept, the least recently written accounts out of memory go (at most ten an
        event the batch may hold), a tombstone each in this batch's transaction (and the challenger's too), so the changelog and a restore agree
        (consumers/service/dormant.py). After scoring: every account of the batch is in memory then."""
        gone = self.dormant.let_go(self.scorer.accounts_in_memory, out.seq)
        if not gone:
            return
        out.records += [
            (self.changelog, account, None, partition) for account, (partition, _) in gone.items()
        ]
        if self.shadow is not None:
            out.records += self.shadow.tombstones(gone)
        out.accounts_let_go = len(gone)

    def _dead_letter_record(self, record, error: MessageError) -> OutputRecord:
        return (self.dead_letter_topic, *dead_letter(record, error), None)

    def _dead_letter(self, out: ScoredBatch, record, error: MessageError) -> None:
        out.records.append(self._dead_letter_record(record, error))
        out.dead_lettered += 1

    def fold_feed(self) -> tuple[int, int]:
        """Fold in the labels and the other instances' deltas that have arrived, when `terminal_feed_interval_ms`
        has passed since the last read (the service also calls it when a poll brings nothing, so an idle
        instance keeps up), poll after poll while they come back full, for FEED_READ_S at most; (labels,
        deltas) folded."""
        now = time.monotonic()
        if now - self.feed_read_at < self.feed_interval_s:
            return 0, 0
        self.feed_read_at = now
        labels = deltas = 0
        while True:
            got = self.feed.read(self.session)
            got.fold_into(self.scorer.featurizer)
            self.let_terminals_go(now)
            labels, deltas = labels + len(got.labels), deltas + len(got.deltas)
            if not got.full or time.monotonic() - now >= FEED_READ_S:
                return labels, deltas

    def let_terminals_go(self, now: float | None = None) -> None:
        """The idle terminals, every EVICT_EVERY_S, then those with the least history beyond
        max_terminals_in_memory (consumers/terminals/idle.py); after every fold, batch and restore."""
        terminals = self.scorer.featurizer.terminals
        evicted = self.eviction.evict(terminals, now)
        if evicted:
            log.info("idle terminals evicted terminals=%d kept=%d", len(evicted), len(terminals))
        self.eviction.cap(terminals, now)


def _another_key(record_key: bytes | None, key: bytes) -> MessageError:
    shown = "missing" if record_key is None else f"{bytes(record_key)[:80]!r}"
    return MessageError(
        f"record key {shown} is not the body's account_id {key.decode()!r}: the account's events must share "
        "one key, or its state splits over partitions (key_mismatch: rekey writes such a record again under "
        "its account's key, to its partition)"
    )


def _where(record) -> str:
    return f"{record.topic}[{record.partition}]@{record.offset}"
