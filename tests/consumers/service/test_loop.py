"""The service's bookkeeping around poll() and its transactions.

_top_up takes the records that arrived during the last batch into this one, and a rebalance in between drops
the batch and rewinds, so nothing is skipped. A batch's commit runs while the next batch is scored, and
nothing of that batch is sent before the commit returns; a failed commit rewinds both; a revocation waits for
the commit in flight; a commit the group refuses makes the member rejoin instead of counting as a failed
batch. The consumer and producer are scripted stand-ins: what is under test is the service's side, not Kafka
(the integration tests run the real broker, crashes and rebalances included).
"""

import threading
from collections import namedtuple
from types import SimpleNamespace

import pytest
from kafka.errors import CommitFailedError, KafkaConnectionError, ProducerFencedError
from kafka.structs import ConsumerGroupMetadata, MemberState, OffsetAndMetadata, TopicPartition

from consumers.runtime.settings import load_serve_config
from consumers.service import loop as loop_module
from consumers.service.commit_pipeline import ScoredBatch, TransactionPipeline
from consumers.service.loop import _Service
from models.registry import build_detector
from pipeline.features.definitions import FEATURE_NAMES
from pipeline.features.spec import FeatureSpec
from pipeline.registry.artifact import LoadedModel

Record = namedtuple("Record", "partition offset")
P0, P1 = TopicPartition("transactions", 0), TopicPartition("transactions", 1)


class ScriptedConsumer:
    """poll() returns the next scripted records, running a revocation of `revoke` (and the reassignment
    of the rest) first when the script says so."""

    def __init__(self, service, polls):
        self.service, self.polls, self.sought, self.assigned = service, list(polls), {}, {P0, P1}
        self.committed_offsets, self.paused, self.log_ends = {}, set(), {}
        self.group = ConsumerGroupMetadata("group", generation_id=1, member_id="member-1")

    def poll(self, timeout_ms, max_records):
        records, revoke = self.polls.pop(0)
        if revoke is not None:
            self.service.on_revoked([revoke])
            self.assigned.discard(revoke)
            self.service.on_assigned(sorted(self.assigned))
        return records

    def assignment(self):
        return set(self.assigned)

    def seek(self, tp, offset):
        self.sought[tp] = offset

    def seek_to_beginning(self, tp):
        self.sought[tp] = 0

    def committed(self, tp, timeout_ms=None):
        return self.committed_offsets.get(tp)

    def end_offsets(self, tps):
        return {tp: self.log_ends.get(tp, 0) for tp in tps}

    def pause(self, *tps):
        self.paused |= set(tps)

    def resume(self, *tps):
        self.paused -= set(tps)

    def group_metadata(self):
        return self.group

    def highwater(self, tp):
        return None


class ScriptedProducer:
    """Logs the transactional calls in order. Each commit_transaction() first runs the next scripted step
    (a callable, on the committer thread), then raises it if it is an exception."""

    def __init__(self, commits=()):
        self.log, self.commits = [], list(commits)

    def begin_transaction(self):
        self.log.append("begin")

    def send(self, topic, key, value, partition):
        self.log.append(f"send {value}")

    def send_offsets_to_transaction(self, offsets, group_metadata):
        self.log.append(
            "offsets " + " ".join(f"{tp.partition}:{o.offset}" for tp, o in sorted(offsets.items()))
        )

    def commit_transaction(self):
        step = self.commits.pop(0) if self.commits else None
        if isinstance(step, BaseException):
            self.log.append("commit failed")
            raise step
        if step is not None:
            step()
        self.log.append("committed")

    def abort_transaction(self):
        self.log.append("aborted")


class ScriptedWriter:
    """The terminal table writer's start and stop, logged."""

    def __init__(self):
        self.running, self.log = False, []

    def start(self):
        self.running = True
        self.log.append("start")

    def stop(self):
        self.running = False
        self.log.append("stop")


def make_service(polls, **settings) -> tuple[_Service, ScriptedConsumer]:
    n = len(FEATURE_NAMES)
    spec = FeatureSpec(mean=(0.0,) * n, std=(1.0,) * n)
    detector = build_detector("lstm", {"num_features": n, "d_model": 8, "num_layers": 1})
    cfg = load_serve_config(
        config_file=None, overrides={"transactions_topic": "transactions", **settings}, env={}
    )
    service = _Service(cfg, LoadedModel(detector=detector, spec=spec))
    service.consumer = ScriptedConsumer(service, polls)
    service.producer = ScriptedProducer()
    service.writer = ScriptedWriter()
    service.pipeline = TransactionPipeline(service.producer)
    service._restore = lambda partitions: None  # no changelog here; restore is tested against the broker
    return service, service.consumer


def scripted_loop(polls, commits=()):
    """A service whose batches score to one record per event ("p:offset") and whose rewinds are logged.

    Returns (service, producer log, rewinds, stop); run(stop) ends after the last scripted poll.
    """
    service, _ = make_service([], fresh_fetch_ms=0)  # one poll a batch: the script is the batches
    stop = threading.Event()
    script = [*polls, ({}, None)]  # an empty poll at the end settles the last commit

    class Consumer(ScriptedConsumer):
        def poll(self, timeout_ms, max_records):
            if len(self.polls) == 1:
                stop.set()
            return super().poll(timeout_ms, max_records)

    service.consumer = Consumer(service, script)
    producer = service.producer = ScriptedProducer(commits)
    service.pipeline = TransactionPipeline(producer)
    service.assigned = {0, 1}
    rewinds = []

    def score(batch, careful=False):
        producer.log.append(("carefully scored " if careful else "scored ") + events(batch))
        out = ScoredBatch(batch, events=sum(map(len, batch.values())), careful=careful)
        for tp, rs in batch.items():
            out.records += [("scores", None, f"{r.partition}:{r.offset}", None) for r in rs]
            out.offsets[tp] = OffsetAndMetadata(rs[-1].offset + 1, "", -1)
        out.scored = out.events
        return out

    def rewind(batch, revoked=()):
        producer.log.append("rewound " + events(batch))
        rewinds.append((batch, list(revoked)))

    service.batches = SimpleNamespace(
        score=score, fold_feed=lambda: (0, 0), eviction=SimpleNamespace(capped=0)
    )
    service._rewind = rewind
    service._rejoin = lambda: producer.log.append("rejoined")
    return service, producer.log, rewinds, stop


def events(batch) -> str:
    return " ".join(f"{r.partition}:{r.offset}" for tp in sorted(batch) for r in batch[tp])


def records(partition, *offsets):
    return [Record(partition, o) for o in offsets]


def test_records_that_arrived_meanwhile_join_the_batch_in_order():
    service, consumer = make_service([({P0: records(0, 12, 13), P1: records(1, 7)}, None)])
    batch = service._top_up({P0: records(0, 10, 11)})
    assert batch == {P0: records(0, 10, 11, 12, 13), P1: records(1, 7)}
    assert consumer.polls == []


def test_a_full_batch_or_a_zero_wait_polls_no_more():
    service, consumer = make_service([({P0: records(0, 3)}, None)], max_poll_records=2)
    assert service._top_up({P0: records(0, 1, 2)}) == {P0: records(0, 1, 2)}
    service, consumer = make_service([({P0: records(0, 3)}, None)], fresh_fetch_ms=0)
    assert service._top_up({P0: records(0, 1, 2)}) == {P0: records(0, 1, 2)}
    assert len(consumer.polls) == 1  # never asked


def test_a_rebalance_in_between_drops_the_batch_and_rewinds_the_kept_partitions():
    service, consumer = make_service([({P0: records(0, 12)}, P1)])
    assert service._top_up({P0: records(0, 10, 11), P1: records(1, 5, 6)}) == {}
    assert consumer.sought == {P0: 10}  # kept: fetched again from its first record; P1 is another's now


def test_a_batch_is_scored_while_the_previous_one_commits_and_sent_only_after_it():
    second_scored = threading.Event()
    overlapped = []

    def slow_commit():  # the first batch's commit returns only once the second batch is scored (or 5 s)
        overlapped.append(second_scored.wait(timeout=5))

    service, log, rewinds, stop = scripted_loop(
        [({P0: records(0, 1, 2)}, None), ({P0: records(0, 3), P1: records(1, 7)}, None)],
        commits=[slow_commit],
    )
    score = service.batches.score
    service.batches.score = lambda batch, careful: (score(batch), batch.get(P1) and second_scored.set())[0]
    service.run(stop)
    assert overlapped == [True]  # the commit was still running when the next batch had been scored
    assert log == [
        "scored 0:1 0:2", "begin", "send 0:1", "send 0:2",
        "offsets 0:3", "scored 0:3 1:7", "committed",  # the commit ran while the next batch was scored
        "begin", "send 0:3", "send 1:7", "offsets 0:4 1:8", "committed",  # sent only after it returned
    ]  # fmt: skip
    assert rewinds == [] and service.stats.batches == 2 and service.stats.events_scored == 4


def test_a_failed_commit_rewinds_its_batch_and_the_next_one_which_is_never_sent():
    service, log, _, stop = scripted_loop(
        [
            ({P0: records(0, 1)}, None),
            ({P0: records(0, 2), P1: records(1, 7)}, None),
            ({P0: records(0, 1)}, None),
        ],
        commits=[KafkaConnectionError("broker gone")],
    )
    service.run(stop)
    assert log == [
        "scored 0:1", "begin", "send 0:1", "offsets 0:2", "commit failed",
        "scored 0:2 1:7", "aborted", "rewound 0:1 0:2 1:7",  # both batches, the second never sent
        "scored 0:1", "begin", "send 0:1", "offsets 0:2", "committed",  # redelivered, then committed
    ]  # fmt: skip
    assert service.stats.aborted_batches == 1 and service.failures == 0
    assert service.stats.events_scored == 1  # only what committed counts


def test_a_revocation_waits_for_the_commit_in_flight_and_rewinds_it_if_it_fails():
    service, log, rewinds, stop = scripted_loop(
        [({P0: records(0, 1), P1: records(1, 5)}, None), ({}, P1)], commits=[KafkaConnectionError("gone")]
    )
    service.on_assigned([P0, P1])
    service.run(stop)
    assert log == [
        "scored 0:1 1:5", "begin", "send 0:1", "send 1:5", "offsets 0:2 1:6", "commit failed",
        "aborted", "rewound 0:1 1:5",  # inside the revocation, before the partition changes hands
    ]  # fmt: skip
    assert rewinds[0][1] == [1]  # the revoked partition is dropped, not reloaded or sought
    assert service.stats.aborted_batches == 1 and service.assigned == {0}


def test_a_bookkeeping_error_after_a_commit_never_rewinds_the_committed_batch(caplog):
    service, log, rewinds, stop = scripted_loop([({P0: records(0, 1)}, None), ({P0: records(0, 2)}, None)])

    def broken(committed):
        raise RuntimeError("eviction bug")

    service._let_dormant_go = broken
    service.run(stop)
    assert rewinds == [] and log.count("committed") == 2 and "aborted" not in log
    assert service.stats.aborted_batches == 0 and "bookkeeping of committed batch seq=" in caplog.text


def test_a_fenced_producer_is_replaced_and_the_batches_it_held_are_read_again():
    # The broker fences a producer whose transaction outlived transaction_timeout_ms, e.g. across a broker
    # outage: routine, so the service starts another producer instead of stopping.
    polls = [({P0: records(0, 1)}, None), ({P0: records(0, 2)}, None), ({P0: records(0, 1, 2)}, None)]
    service, log, _, stop = scripted_loop(polls, commits=[ProducerFencedError()])
    fresh = ScriptedProducer()

    def new_producer():
        service.producer, service.pipeline = fresh, TransactionPipeline(fresh)

    service._new_producer = new_producer
    service.run(stop)
    assert log[-2:] == ["rewound 0:1 0:2", "scored 0:1 0:2"]  # both uncommitted batches, read again
    assert "aborted" not in log  # the fence aborted its transaction: a fenced producer cannot
    assert fresh.log == ["begin", "send 0:1", "send 0:2", "offsets 0:3", "committed"]
    assert service.stats.aborted_batches == 1 and service.stats.events_scored == 2


def test_a_commit_the_group_refuses_rejoins_instead_of_counting_as_a_failure():
    refused = CommitFailedError("UnknownMemberIdError")
    polls = [({P0: records(0, 1)}, None)] * 10  # a refusal shows while the next batch is scored: 2 a rejoin
    service, log, _, stop = scripted_loop(polls, commits=[refused] * 4)  # more than MAX_FAILED_BATCHES
    service.run(stop)  # four refusals did not stop the service
    assert log.count("rejoined") == 4 and log.count("aborted") == 4 and log.count("rewound 0:1 0:1") == 4
    assert log[-1] == "committed" and service.stats.aborted_batches == 4 and service.stats.batches == 2


def test_a_member_that_has_left_the_group_never_commits_offsets_and_rejoins():
    # A consumer frozen past its session timeout wakes with generation -1; the broker would take a
    # transactional offset commit of generation -1 unfenced, over its successor's offsets.
    polls = [({P0: records(0, 1)}, None)] * 4
    service, log, _, stop = scripted_loop(polls)
    left = ConsumerGroupMetadata("g", -1, "", None, MemberState.UNJOINED)
    member = ConsumerGroupMetadata("g", 7, "member-1", None, MemberState.STABLE)
    snapshots = [left, member, member]
    service.consumer.group_metadata = lambda: snapshots.pop(0) if snapshots else member
    service.run(stop)
    first_commit = log.index("aborted")
    assert not any(entry.startswith("offsets") for entry in log[:first_commit])  # never sent unfenced
    assert log[first_commit + 1 : first_commit + 3] == ["rewound 0:1 0:1", "rejoined"]
    assert "offsets 0:2" in log and log[-1] == "committed"  # as a member again, it commits
    assert service.stats.aborted_batches == 1


def test_the_terminal_table_writer_runs_where_transactions_partition_0_is():
    service, _ = make_service([])
    writer = service.writer
    tp = lambda p: TopicPartition("transactions", p)  # noqa: E731
    service.on_assigned([tp(1)])
    assert writer.log == []
    service.on_assigned([tp(0), tp(2)])
    service.on_assigned([tp(0)])  # already running: not started twice
    assert writer.log == ["start"]
    service.on_revoked([tp(2)])
    assert writer.running
    service.on_revoked([tp(0), tp(1)])
    assert writer.log == ["start", "stop"] and not writer.running


def test_a_batch_that_fails_in_scoring_is_read_again_one_event_at_a_time_and_goes_on():
    # A record nobody foresaw makes scoring fail: the batch is rewound, read again carefully (the batch
    # scorer then dead-letters the failing event alone), committed, and the service goes on, never looping.
    polls = [
        ({P0: records(0, 1, 2, 3)}, None),
        ({P0: records(0, 1, 2)}, None),
        ({P0: records(0, 3, 4)}, None),
    ]
    polls += [({P0: records(0, 5)}, None)]
    service, log, rewinds, stop = scripted_loop(polls)
    score = service.batches.score
    failures = iter([ValueError("a fault nobody foresaw")])

    def failing_once(batch, careful=False):
        if not careful and (error := next(failures, None)) is not None:
            raise error
        return score(batch, careful)

    service.batches.score = failing_once
    service.run(stop)
    assert log[:2] == ["rewound 0:1 0:2 0:3", "carefully scored 0:1 0:2"]
    assert "carefully scored 0:3 0:4" in log  # 0:3 was in the failed batch: still careful
    assert "scored 0:5" in log and "carefully scored 0:5" not in log  # past it: batches again
    assert service.suspect == {} and service.failures == 0 and service.stats.events_scored == 5
    assert len(rewinds) == 1 and service.stats.aborted_batches == 1 and service.stats.careful_batches == 2


def test_a_failure_while_scoring_carefully_is_not_the_inputs_and_counts_towards_stopping():
    polls = [({P0: records(0, 1)}, None)] * 4
    service, _, _, stop = scripted_loop(polls)

    def always(batch, careful=False):
        raise OSError("the changelog cannot be read")

    service.batches.score = always
    with pytest.raises(RuntimeError, match="3 batches in a row failed"):
        service.run(stop)
    assert service.suspect == {0: 1}


def test_the_metadata_is_read_every_metadata_max_age_ms_and_a_failed_read_stops_nothing(monkeypatch, caplog):
    service, _ = make_service([], metadata_max_age_ms=1000)
    reads = []

    def refresh_metadata(consumer, timeout_ms):
        reads.append(timeout_ms)
        raise KafkaConnectionError("the broker went away")

    monkeypatch.setattr(loop_module, "refresh_metadata", refresh_metadata)
    service._watch_metadata()
    assert reads == []  # not yet due: the start has just read it
    service.metadata_at -= 1.0
    service._watch_metadata()
    service._watch_metadata()
    assert reads == [1000] and "metadata read failed, tried again in metadata_max_age_ms" in caplog.text
