"""The service's bookkeeping around poll(): _top_up takes the records that arrived during the last batch
into this one, and a rebalance in between drops the batch and rewinds, so nothing is skipped; a commit the
group refuses makes the member rejoin instead of counting as a failed batch. The consumer is a scripted
stand-in: what is under test is the service's side, not Kafka (the integration tests run the real broker)."""

import threading
from collections import namedtuple

from kafka.errors import CommitFailedError
from kafka.structs import TopicPartition

from consumers.service import _Service
from consumers.service_config import load_serve_config
from models.registry import build_detector
from pipeline.artifact import LoadedModel
from pipeline.features.definitions import FEATURE_NAMES
from pipeline.features.spec import FeatureSpec

Record = namedtuple("Record", "partition offset")
P0, P1 = TopicPartition("transactions", 0), TopicPartition("transactions", 1)


class ScriptedConsumer:
    """poll() returns the next scripted records, running a revocation of `revoke` (and the reassignment
    of the rest) first when the script says so."""

    def __init__(self, service, polls):
        self.service, self.polls, self.sought, self.assigned = service, list(polls), {}, {P0, P1}

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


def make_service(polls, **settings) -> tuple[_Service, ScriptedConsumer]:
    n = len(FEATURE_NAMES)
    spec = FeatureSpec(mean=(0.0,) * n, std=(1.0,) * n)
    detector = build_detector("lstm", {"num_features": n, "d_model": 8, "num_layers": 1})
    cfg = load_serve_config(
        config_file=None, overrides={"transactions_topic": "transactions", **settings}, env={}
    )
    service = _Service(cfg, LoadedModel(detector=detector, spec=spec))
    service.consumer = ScriptedConsumer(service, polls)
    service._restore = lambda partitions: None  # no changelog here; restore is tested against the broker
    return service, service.consumer


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


class RejoiningConsumer(ScriptedConsumer):
    """Also records unsubscribe/subscribe, the public calls a rejoin is made of."""

    def __init__(self, service, polls):
        super().__init__(service, polls)
        self.calls = []

    def unsubscribe(self):
        self.calls.append("unsubscribe")

    def subscribe(self, topics, listener):
        self.calls.append("subscribe")

    def partitions_for_topic(self, topic):
        return {0, 1}


def test_a_commit_the_group_refuses_rejoins_instead_of_counting_as_a_failure(monkeypatch):
    service, _ = make_service([], fresh_fetch_ms=0)  # one poll a batch: the script is the batches
    polls = [({P0: records(0, i)}, None) for i in range(5)]
    consumer = service.consumer = RejoiningConsumer(service, polls)
    service.assigned = {0, 1}
    outcomes = [CommitFailedError("UnknownMemberIdError")] * 4 + [None]  # more than MAX_FAILED_BATCHES
    processed, rewound = [], []

    def process(batch):
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
        processed.append(batch)
        stop.set()

    stop = threading.Event()
    monkeypatch.setattr(service, "_process", process)
    monkeypatch.setattr(service, "_abort_and_rewind", lambda batch: rewound.append(batch))
    service.run(stop)  # returns once the fifth batch commits: four refusals did not stop the service
    assert processed == [{P0: records(0, 4)}]
    assert len(rewound) == 4 and service.stats.aborted_batches == 4
    assert consumer.calls == ["unsubscribe", "subscribe"] * 4
    assert service.assigned == set()  # its partitions were dropped; the next join hands some back


def test_owning_some_partitions_flags_terminal_counts_as_partial(caplog):
    service, _ = make_service([])
    service.partitions = 4  # the transactions topic's partition count, known at start
    service.on_assigned([TopicPartition("transactions", p) for p in (0, 1)])
    assert service.metrics.get("txsentinel_terminal_counts_partial") == 1
    assert "owns 2 of 4 transactions partitions" in caplog.text
    service.on_assigned([TopicPartition("transactions", p) for p in (2, 3)])  # the other instance left
    assert service.metrics.get("txsentinel_terminal_counts_partial") == 0
