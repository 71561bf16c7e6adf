"""Batch k's Kafka transaction commits in the background while the service scores batch k+1.

A commit is two calls of the transactional producer, five round trips to the broker (AddOffsetsToTxn,
TxnOffsetCommit, AddPartitionsToTxn, the flush of the held records, EndTxn): 15-25 ms a batch, most of it
spent waiting on the broker. Done in line, every batch waits for it; here a committer thread waits instead,
and the main thread polls, decodes and scores the next batch meanwhile.

The order that keeps this exactly once with ONE transactional producer:

    main thread:      score k+1 (in memory only) -> settle k -> begin k+1, send k+1, hand k+1's commit over
    committer thread:                  commit k ...|                                 commit k+1 ...

- Nothing of batch k+1 is sent before batch k's commit has returned: every output partition and the state
  changelog hold the same records in the same order as with in-line commits, so the compacted changelog's
  latest record of an account is always its latest state.
- If batch k's commit fails, batch k+1 (scored in memory, never sent) is rewound with it: its accounts and the
  terminal table are restored from the changelog and the table, and the consumer seeks back to the committed
  offsets, which are batch k's first records.
- A rebalance settles the batch in flight before partitions are revoked (service.on_revoked), so nothing is
  committed under a group generation that has moved on, and revocation leaves no transaction open.
- A commit is waited for at most commit_timeout_s, and a batch with a record that did not land is never taken
  for committed (BrokenTransaction says why): the producer is then replaced, as a fenced one is.
"""

import logging
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

from kafka import KafkaProducer
from kafka.errors import (
    CommitFailedError,
    InvalidProducerEpochError,
    KafkaError,
    OutOfOrderSequenceNumberError,
    UnknownProducerIdError,
)
from kafka.structs import OffsetAndMetadata, TopicPartition

log = logging.getLogger(__name__)

# A record failing with one of these makes kafka-python 3.0.12 bump the producer epoch inside the open transaction
# (KIP-360), which ends it on the broker while the client goes on: its commit then waits forever for records it
# no longer sends, or returns as if committed though nothing was. Seen when a frozen instance wakes (the broker
# aborted its transaction meanwhile) and under load (a retried produce request out of sequence).
EPOCH_BUMPING_ERRORS = (InvalidProducerEpochError, OutOfOrderSequenceNumberError, UnknownProducerIdError)
SETTLE_CHECK_S = 0.1  # while a commit is pending, how often settle() looks at its records


class BrokenTransaction(Exception):
    """The producer cannot be trusted with another transaction: a record of the batch did not land, or its commit
    did not return within commit_timeout_s. Nothing of the batch is taken for committed; replace the producer."""


OutputRecord = tuple[str, bytes | None, bytes | None, int | None]  # (topic, key, value, partition or None)


@dataclass
class ScoredBatch:
    """A polled batch, scored in memory, and everything its transaction will write."""

    polled: dict[TopicPartition, list]  # the consumer's records: what a rewind seeks back over
    seq: int = 0  # numbers the batches scored by this instance, from 1
    clock_us: int | None = None  # the instance's clock when the batch was decoded (what bounds its ts)
    records: list[OutputRecord] = field(default_factory=list)  # in send order
    offsets: dict[TopicPartition, OffsetAndMetadata] = field(default_factory=dict)  # next offset to read
    events: int = 0  # polled records, dead letters included
    scored: int = 0
    alerts: int = 0
    dead_lettered: int = 0
    duplicates_dropped: int = 0
    positions_repaired: int = 0  # events applied over a corrupt last applied position (Scorer stats)
    replays_dropped: int = 0  # events whose event_id was applied already (dead-lettered, in dead_lettered)
    rekeyed: int = 0  # records written again under their account's key (key_mismatch: rekey)
    careful: bool = False  # scored one event at a time: the last resort after a failed batch
    labels_applied: int = 0  # fraud and not-fraud labels read and applied before the batch's events
    deltas_applied: int = 0  # other instances' terminal delta records folded in before the batch's events
    reloaded: int = 0  # dormant accounts' states read back from the changelog for this batch
    states_discarded: int = 0  # of those, records refused as corrupt: their accounts start from no history
    # past max_accounts_kept: a changelog tombstone each (consumers/service/dormant.py)
    accounts_let_go: int = 0
    unknown_fields: int = 0  # input messages with fields of no known name, ignored (unknown_fields: ignore)
    created_ms: list[float] = field(default_factory=list)  # the scored events' produce times (latency)
    # (features, scores, ts_us) per scorer call: drift, at commit
    observed: list = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds of main-thread work
    waited_s: float = 0.0  # for the previous batch's commit, before this one could be sent
    sent: list = field(default_factory=list)  # kafka-python's futures of `records`, once published
    group: object = None  # the consumer's ConsumerGroupMetadata its offsets were committed under


@dataclass
class Committed:
    batch: ScoredBatch
    at_ms: float  # wall clock when the commit returned: the outputs became visible to read_committed readers
    seconds: float  # the commit calls' duration on the committer thread


class TransactionPipeline:
    """One transactional producer with at most one batch committing in the background.

    publish() begins a batch's transaction, sends its records and starts its commit on the committer thread;
    settle() waits for that commit, at most `commit_timeout_s` after it began. A batch is published only after
    the previous one has settled.
    """

    def __init__(self, producer: KafkaProducer, commit_timeout_s: float = 60.0):
        self.producer = producer
        self.commit_timeout_s = commit_timeout_s
        self.in_flight: tuple[ScoredBatch, Future] | None = None  # committing, or failed and not yet taken
        self.open = False  # a transaction has begun and is neither committed nor aborted
        self.step = "idle"  # where the committer thread is: what a commit that does not return was doing
        self.stuck = False  # a commit never returned: the committer thread is left behind with the producer
        self.started_at = 0.0  # time.monotonic() when the batch in flight was handed to the committer
        self.committer: threading.Thread | None = None  # the thread of the latest commit

    def publish(self, batch: ScoredBatch, group_metadata) -> None:
        if self.in_flight is not None:
            raise RuntimeError("publish() with a batch still in flight: settle() it first")
        producer = self.producer
        producer.begin_transaction()
        self.open = True
        batch.group = group_metadata
        batch.sent = [
            producer.send(topic, key=key, value=value, partition=partition)
            for topic, key, value, partition in batch.records
        ]
        future: Future = Future()
        self.in_flight, self.started_at = (batch, future), time.monotonic()
        # A daemon thread per commit (~0.1 ms), not a ThreadPoolExecutor: a commit stuck inside kafka-python
        # must not keep the process from exiting (the executor joins its workers at exit).
        self.committer = threading.Thread(
            target=self._run,
            args=(future, batch.offsets, group_metadata),
            name="txsentinel-commit",
            daemon=True,
        )
        self.committer.start()

    def _run(self, future: Future, offsets: dict, group_metadata) -> None:
        try:
            future.set_result(self._commit(offsets, group_metadata))
        except BaseException as error:  # handed to settle(), which raises it where it is called
            future.set_exception(error)
        self.step = "idle"

    def _commit(self, offsets: dict, group_metadata) -> tuple[float, float]:
        # The committer thread. Commit order (one transaction, all or nothing):
        #   1. the batch's records were sent by publish() (held by the producer until the flush below);
        #   2. the consumed offsets join the transaction with the group's metadata (generation, member id),
        #      so a zombie from an older generation is fenced by the group coordinator (KIP-447);
        #   3. commit_transaction() flushes every held record, then writes the commit markers; read_committed
        #      readers see all outputs and the new offsets at once, or (on abort or crash) none of them.
        started = time.monotonic()
        if getattr(group_metadata, "generation_id", 0) < 0:
            # The consumer has fallen out of the group (it was frozen past its session timeout, say) and reset
            # its generation to -1. The broker takes a transactional offset commit of generation -1 without
            # fencing it, so this member's offsets would land over its successor's: not here.
            raise CommitFailedError(
                "this member has left the group (generation -1): its batch is aborted, and it rejoins"
            )
        self.step = "send_offsets_to_transaction"
        _forget_refused_offsets(self.producer)
        self.producer.send_offsets_to_transaction(offsets, group_metadata)
        self.step = "commit_transaction"
        self.producer.commit_transaction()
        return time.time() * 1000.0, time.monotonic() - started

    def busy(self) -> bool:
        """A commit is still running (not merely waiting to be settled)."""
        return self.in_flight is not None and not self.in_flight[1].done()

    def settle(self) -> Committed | None:
        """Wait for the batch in flight, if any, and return it committed.

        Raises what failed the commit, or BrokenTransaction: a record of the batch failed in a way that ends
        the transaction under the client (EPOCH_BUMPING_ERRORS), the commit returned with a record not
        written, or it did not return within commit_timeout_s. The batch then stays in flight for take_failed().
        """
        if self.in_flight is None:
            return None
        batch, future = self.in_flight
        while not wait((future,), timeout=SETTLE_CHECK_S).done:
            waited_s = time.monotonic() - self.started_at
            bumped = _failed_record(batch, EPOCH_BUMPING_ERRORS)
            if bumped is None and waited_s < self.commit_timeout_s:
                continue
            self.stuck = True
            raise BrokenTransaction(
                f"the commit of batch seq={batch.seq} has not returned after {waited_s:.1f} s "
                f"(commit_timeout_s = {self.commit_timeout_s:.0f} s; the committer thread is in {self.step})"
                + ("" if bumped is None else f", and its record to {bumped} failed: the client ended the "
                   "transaction under its own commit (a producer epoch bump)")
            )  # fmt: skip
        try:
            at_ms, seconds = future.result()
        except Exception as error:
            bumped = _failed_record(batch, EPOCH_BUMPING_ERRORS)
            if bumped is not None:  # an abort would leave that record's batch-mates in the producer
                raise BrokenTransaction(
                    f"batch seq={batch.seq}: its record to {bumped} failed, then its commit: {error!r}"
                ) from error
            raise
        lost = _failed_record(batch)
        if lost is not None:
            raise BrokenTransaction(
                f"the commit of batch seq={batch.seq} returned, but its record to {lost} was not written: "
                "the transaction did not commit it (a producer epoch bump ended the transaction)"
            )
        self.in_flight, self.open = None, False
        return Committed(batch, at_ms, seconds)

    def take_failed(self) -> ScoredBatch | None:
        """The batch whose commit failed, handed over for a rewind (call abort() too)."""
        batch = None if self.in_flight is None else self.in_flight[0]
        self.in_flight = None
        return batch

    def abort(self) -> None:
        """Abort the open transaction, if any: its records vanish for read_committed readers."""
        if not self.open:
            return
        try:
            self.producer.abort_transaction()
        except KafkaError as error:
            log.warning("abort failed error=%r (the broker aborts it on timeout)", error)
        self.open = False

    def close(self) -> None:
        """Stop the committer thread; one stuck in a commit that never returns is left behind (a daemon)."""
        if self.committer is None:
            return
        self.committer.join(timeout=0 if self.stuck else self.commit_timeout_s)
        if self.committer.is_alive():
            log.warning("committer thread left behind, stuck in %s", self.step)


def _forget_refused_offsets(producer) -> None:
    """Drop the offsets an earlier transaction's refused TxnOffsetCommit left in the producer.

    kafka-python 3.0.12 keeps a partition's offset in TransactionManager._pending_txn_offset_commits until the
    group accepts it, also after the group refused it (a generation that moved on, a member it no longer knows)
    and the transaction was aborted, and sends it again with the next transaction's offsets: the aborted batch's
    offsets then commit with the next batch, and its events are never scored. This runs before a transaction
    joins its offsets, when none of its own are pending yet.
    """
    manager = getattr(producer, "_transaction_manager", None)
    pending = getattr(manager, "_pending_txn_offset_commits", None)
    if pending:
        with manager._lock:
            log.info("dropping offsets a refused commit left in the producer offsets=%s", dict(pending))
            pending.clear()


def _failed_record(batch: ScoredBatch, errors: tuple = ()) -> str | None:
    """Where the first record of `batch` went that failed with one of `errors`, or, with none given, that
    failed or is not acknowledged."""
    for (topic, _, _, partition), sent in zip(batch.records, batch.sent, strict=False):
        done = getattr(sent, "is_done", True)  # kafka-python's future of the send
        error = getattr(sent, "exception", None) if done else None
        if isinstance(error, errors) if errors else (not done or error is not None):
            return f"{topic} partition {partition} ({repr(error) if done else 'not acknowledged'})"
    return None
