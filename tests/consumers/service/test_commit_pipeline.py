"""A commit that never returns, or returns with records not written, is never taken for committed.

kafka-python 3.0.12 bumps a transactional producer's epoch when a record fails with InvalidProducerEpoch,
OutOfOrderSequenceNumber or UnknownProducerId, inside the open transaction: the broker has ended it, and the
client's commit then waits forever for the records it no longer sends, or returns as if it had committed
(tests/integration/test_service_fencing.py shows the second against the broker). The producer here is a
scripted stand-in; the futures of its sends are kafka-python's own.
"""

import threading
import time

import pytest
from kafka.errors import InvalidProducerEpochError, ProducerFencedError
from kafka.future import Future

from consumers.service.commit_pipeline import BrokenTransaction, ScoredBatch, TransactionPipeline
from tests.consumers.service.test_loop import P0, ScriptedProducer, records, scripted_loop


class HeldProducer(ScriptedProducer):
    """send() hands out kafka-python futures the test completes; commit_transaction() waits for `release`."""

    def __init__(self):
        super().__init__()
        self.futures, self.release = [], threading.Event()

    def send(self, topic, key, value, partition):
        super().send(topic, key, value, partition)
        self.futures.append(Future())
        return self.futures[-1]

    def commit_transaction(self):
        self.release.wait(30)
        super().commit_transaction()


def published(producer, commit_timeout_s: float) -> tuple[TransactionPipeline, ScoredBatch]:
    pipeline = TransactionPipeline(producer, commit_timeout_s)
    batch = ScoredBatch({}, seq=7, records=[("scores", None, b"a", 0), ("changelog", b"acc", b"s", 0)])
    pipeline.publish(batch, "group")
    return pipeline, batch


def test_a_commit_that_never_returns_is_given_up_after_commit_timeout_s_saying_where_it_waits():
    producer = HeldProducer()
    pipeline, batch = published(producer, commit_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(
        BrokenTransaction, match=r"seq=7 has not returned after 0\.\d s .* in commit_transaction"
    ):
        pipeline.settle()
    assert time.monotonic() - started < 2 and pipeline.take_failed() is batch
    pipeline.close()  # does not wait for the stuck committer
    assert pipeline.committer.is_alive()
    producer.release.set()


def test_a_record_failing_with_an_epoch_bump_error_breaks_the_transaction_without_waiting():
    producer = HeldProducer()
    pipeline, _ = published(producer, commit_timeout_s=30)
    producer.futures[0].success("ok")
    producer.futures[1].failure(InvalidProducerEpochError())
    started = time.monotonic()
    with pytest.raises(BrokenTransaction, match=r"changelog partition 0 \(InvalidProducerEpochError"):
        pipeline.settle()
    assert time.monotonic() - started < 2
    producer.release.set()
    pipeline.close()


def test_a_commit_that_returns_with_a_record_not_written_is_not_taken_for_committed():
    producer = HeldProducer()
    pipeline, batch = published(producer, commit_timeout_s=30)
    producer.futures[0].failure(InvalidProducerEpochError())
    producer.futures[1].failure(InvalidProducerEpochError())
    producer.release.set()
    while pipeline.busy():
        time.sleep(0.01)
    with pytest.raises(BrokenTransaction, match="returned, but its record to scores partition 0"):
        pipeline.settle()
    assert producer.log[-1] == "committed" and pipeline.take_failed() is batch
    pipeline.close()


def test_records_that_failed_otherwise_leave_the_commit_error_as_it_was():
    producer = HeldProducer()
    producer.commits = [ProducerFencedError()]
    pipeline, _ = published(producer, commit_timeout_s=30)
    for future in producer.futures:
        future.failure(ProducerFencedError())
    producer.release.set()
    with pytest.raises(ProducerFencedError):
        pipeline.settle()
    pipeline.close()


def test_the_service_replaces_a_producer_whose_commit_never_returns_and_reads_the_batches_again():
    polls = [({P0: records(0, 1)}, None), ({P0: records(0, 2)}, None), ({P0: records(0, 1, 2)}, None)]
    stuck = threading.Event()
    service, log, _, stop = scripted_loop(polls, commits=[lambda: stuck.wait(30)])
    service.pipeline.commit_timeout_s = 0.3
    fresh = ScriptedProducer()

    def new_producer():
        service.producer, service.pipeline = fresh, TransactionPipeline(fresh)

    service._new_producer = new_producer
    service.run(stop)
    stuck.set()
    assert log[-2:] == ["rewound 0:1 0:2", "scored 0:1 0:2"]  # both uncommitted batches, read again
    assert "aborted" not in log  # a stuck producer may never answer an abort: the broker aborts on timeout
    assert fresh.log == ["begin", "send 0:1", "send 0:2", "offsets 0:3", "committed"]
    assert service.stats.aborted_batches == 1 and service.stats.events_scored == 2
