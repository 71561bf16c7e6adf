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
"""

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kafka import KafkaProducer
from kafka.errors import CommitFailedError, KafkaError
from kafka.structs import OffsetAndMetadata, TopicPartition

log = logging.getLogger(__name__)

OutputRecord = tuple[str, bytes | None, bytes | None, int | None]  # (topic, key, value, partition or None)


@dataclass
class ScoredBatch:
    """A polled batch, scored in memory, and everything its transaction will write."""

    polled: dict[TopicPartition, list]  # the consumer's records: what a rewind seeks back over
    seq: int = 0  # numbers the batches scored by this instance, from 1
    records: list[OutputRecord] = field(default_factory=list)  # in send order
    offsets: dict[TopicPartition, OffsetAndMetadata] = field(default_factory=dict)  # next offset to read
    events: int = 0  # polled records, dead letters included
    scored: int = 0
    alerts: int = 0
    dead_lettered: int = 0
    duplicates_dropped: int = 0
    replays_dropped: int = 0  # events whose event_id was applied already (dead-lettered, in dead_lettered)
    rekeyed: int = 0  # records written again under their account's key (key_mismatch: rekey)
    careful: bool = False  # scored one event at a time: the last resort after a failed batch
    labels_applied: int = 0  # fraud and not-fraud labels read and applied before the batch's events
    deltas_applied: int = 0  # other instances' terminal delta records folded in before the batch's events
    reloaded: int = 0  # dormant accounts' states read back from the changelog for this batch
    unknown_fields: int = 0  # input messages with fields of no known name, ignored (unknown_fields: ignore)
    created_ms: list[float] = field(default_factory=list)  # the scored events' produce times (latency)
    observed: list = field(
        default_factory=list
    )  # (features, scores, ts_us) per scorer call: drift, at commit
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
    settle() waits for that commit. A batch is published only after the previous one has settled.
    """

    def __init__(self, producer: KafkaProducer):
        self.producer = producer
        self.committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="txsentinel-commit")
        self.in_flight: tuple[ScoredBatch, Future] | None = None  # committing, or failed and not yet taken
        self.open = False  # a transaction has begun and is neither committed nor aborted

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
        future = self.committer.submit(self._commit, batch.offsets, group_metadata)
        self.in_flight = (batch, future)

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
        self.producer.send_offsets_to_transaction(offsets, group_metadata)
        self.producer.commit_transaction()
        return time.time() * 1000.0, time.monotonic() - started

    def busy(self) -> bool:
        """A commit is still running (not merely waiting to be settled)."""
        return self.in_flight is not None and not self.in_flight[1].done()

    def settle(self) -> Committed | None:
        """Wait for the batch in flight, if any, and return it committed.

        Raises what failed the commit; the batch then stays in flight for take_failed().
        """
        if self.in_flight is None:
            return None
        batch, future = self.in_flight
        at_ms, seconds = future.result()
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
        self.committer.shutdown(wait=True)
