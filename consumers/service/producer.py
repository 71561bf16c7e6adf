"""The service's one transactional producer: its start, its fence, and what a failed transaction undoes.

One transactional producer per instance. A batch's records, its consumed offsets and its commit go through
it in the order written where they happen, on the committer thread (consumers/service/commit_pipeline.py):
send the records -> send_offsets_to_transaction with the group's metadata (KIP-447 fences a zombie of an
older generation) -> commit_transaction, which flushes the records and then writes the commit markers.

A failed transaction is aborted (or, when the broker fenced the producer or the transaction broke under the
client, commit_pipeline.BrokenTransaction, the producer is replaced), every batch not committed is rewound
(consumers/service/restore.py) and redelivered; a commit the group refuses makes the member rejoin;
MAX_FAILED_BATCHES failures in a row stop the service.
"""

import logging
import uuid

from kafka import KafkaProducer
from kafka.errors import CommitFailedError, ProducerFencedError
from kafka.serializer import DefaultSerializer

from consumers.service.commit_pipeline import BrokenTransaction, TransactionPipeline

log = logging.getLogger(__name__)

KEYS = DefaultSerializer()  # account ids, str <-> UTF-8 (bytes pass through unchanged)
MAX_FAILED_BATCHES = 3  # consecutive aborted batches before the service gives up (a bug, not a blip)
# A commit still out this long after transaction_timeout_ms will not return: by then the broker has aborted a
# transaction that was not committing, and kafka-python gives up on a request after 30 s (request_timeout_ms).
COMMIT_GRACE_S = 30.0


class Transactions:
    """The producer's part of the service (loop._Service, whose __init__ and start() build the attributes
    used here): the producer and its commit pipeline, and the way out of a failed transaction."""

    def _new_producer(self) -> None:
        """The transactional producer and its commit pipeline, at start and after a fence."""
        cfg = self.cfg
        # Zombies of an older group generation are fenced by send_offsets_to_transaction (KIP-447), whatever
        # the id. A stable id (instance_id) also lets init_transactions abort a crashed predecessor's
        # transaction at once.
        self.transactional_id = f"{cfg.transactional_id_prefix}-{cfg.instance_id or uuid.uuid4().hex[:12]}"
        self.probes.wait_for("producer", f"starting transactional producer {self.transactional_id}")
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
        self.pipeline = TransactionPipeline(self.producer, cfg.transaction_timeout_ms / 1000 + COMMIT_GRACE_S)
        self.probes.done("producer")

    def _renew_producer(self, error: Exception) -> None:
        """A fenced producer is dead for good, and one whose transaction broke under it cannot be trusted: start
        another (its aborted batches are rewound by the caller).

        The broker fences a transactional producer when one of its transactions outlives
        transaction_timeout_ms (e.g. across a broker outage: the broker aborts it and bumps the producer's
        epoch), or when another producer starts with the same transactional id (two instances sharing an
        instance_id). The first is routine; the second repeats, and MAX_FAILED_BATCHES stops the service.
        """
        if isinstance(error, BrokenTransaction):
            log.warning("transaction broken (%s); starting a new producer", error)
        else:
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

    def _recover(self, error: Exception, batch: dict | None) -> None:
        """Abort, rewind and restore after a failure in scoring, publishing or committing.

        The failure may be this batch's (scoring, sending) or the previous batch's commit; either way every
        batch not committed is rewound: the one in flight (if its commit failed) and this one.
        """
        rewind = [batch] if batch else []
        group = None  # the group generation the failed commit was made under
        try:
            self._settle()  # a scoring failure leaves the previous commit running: let it finish first
        except Exception as commit_error:
            error = commit_error
            failed = self.pipeline.take_failed()
            rewind.insert(0, failed.polled)
            group = failed.group
        self._end_failed_transaction(error)
        rewound = merged_batches(rewind)
        if isinstance(error, CommitFailedError) and _moved_on_with_us(group, self.consumer.group_metadata()):
            # A cooperative rebalance completed while the commit was on its way: the offsets carried the
            # generation before it. This member is still in the group, and its partitions are its own
            # (a revoked one went through on_revoked): the batches are read again, nothing more.
            log.info("batch aborted: the group generation moved on during its commit; it is redelivered")
            self._rewind(rewound)
            return
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
        """Abort the failed batch's transaction and count it; a fenced or broken producer is replaced instead
        (the broker aborts its transaction: at once when fenced, else after transaction_timeout_ms)."""
        if isinstance(error, (ProducerFencedError, BrokenTransaction)):
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
            if not isinstance(error, BrokenTransaction):  # a broken one may never answer: the broker aborts
                self.pipeline.abort()


def _moved_on_with_us(then, now) -> bool:
    """The group has a newer generation than `then` (a ConsumerGroupMetadata), with this member in it."""
    return (
        then is not None
        and bool(then.member_id)
        and now.member_id == then.member_id
        and now.generation_id > then.generation_id
    )


def merged_batches(batches: list[dict]) -> dict:
    """Polled batches as one: {TopicPartition: records}, for one rewind."""
    merged: dict = {}
    for batch in batches:
        for tp, records in batch.items():
            merged[tp] = [*merged.get(tp, ()), *records]
    return merged
