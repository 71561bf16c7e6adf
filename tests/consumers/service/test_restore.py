"""Restores that stay cheap (consumers/service/restore.py): states restored in batches equal those restored one
at a time; new partitions wait, paused, for the committed offsets to be fetched before the changelog is read; a
changelog read asks for its end offsets once; an aborted batch lets go of its own accounts only; a commit that
missed a cooperative rebalance is read again without leaving the group. The broker-backed versions are in tests/integration/test_service_restore.py."""

import dataclasses
import re
import struct
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import CommitFailedError
from kafka.structs import ConsumerGroupMetadata, TopicPartition

import consumers.service.restore as restore_module
from consumers.runtime.compacted import Reader
from consumers.scoring.account_state import CorruptRecordError, decode_account_record
from consumers.scoring.messages import transactions_from_frame
from consumers.scoring.scorer import Scorer
from consumers.service.commit_pipeline import Committed, ScoredBatch
from consumers.service.dormant import DormantStates
from consumers.service.shadow import ShadowSide
from consumers.service.state_restore import restore_partitions
from models.registry import REGISTRY, build_detector
from pipeline.data.generate import GenerateConfig, generate
from pipeline.features import FEATURE_NAMES, compute_features, fit_feature_spec
from pipeline.features.state import ACCOUNT_STATE
from pipeline.registry.artifact import LoadedModel
from tests.consumers.service.test_loop import P0, P1, make_service, records, scripted_loop

TINY = {"num_features": len(FEATURE_NAMES), "d_model": 8, "num_layers": 1, "dropout": 0.0}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def frame():
    return generate(GenerateConfig(accounts=40, days=20, seed=3)).sort("ts", "event_id")


def loaded(name: str, frame, seed: int = 0) -> LoadedModel:
    start = frame["ts"].min()
    spec = fit_feature_spec(compute_features(frame), start, start + timedelta(days=10))
    torch.manual_seed(seed)
    overrides = {"window_events": 8} if name == "transformer" else {}
    return LoadedModel(detector=build_detector(name, {**TINY, **overrides}), spec=spec)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_accounts_restored_in_chunks_equal_accounts_restored_one_at_a_time(name, frame, monkeypatch):
    txs = transactions_from_frame(frame)
    source = Scorer(loaded(name, frame))
    source.score(txs, [(i % 3, i) for i in range(len(txs))])
    accounts = sorted(source.accounts_in_memory)
    values = source.account_states_bytes(accounts)
    one_by_one = Scorer(loaded(name, frame))
    for account, value in zip(accounts, values, strict=True):
        one_by_one.restore_account(account, value)
    monkeypatch.setattr("consumers.scoring.held_accounts.RESTORE_CHUNK", 7)  # chunks that cut the accounts
    batched = Scorer(loaded(name, frame))
    batched.restore_accounts(accounts[:9], values[:9])
    for account in accounts[:4]:
        batched.evict(account)  # their rows are free: the next restore takes them, then a new block
    batched.restore_accounts(accounts, values)  # accounts 4-8 again: their own rows
    assert batched.account_states_bytes(accounts) == values == one_by_one.account_states_bytes(accounts)
    later = [t._replace(event_id=f"later-{i}") for i, t in enumerate(txs[-30:])]
    scores = [s.score for s in batched.score(later, [(0, 10**6 + i) for i in range(30)])]
    expected = [s.score for s in one_by_one.score(later, [(0, 10**6 + i) for i in range(30)])]
    np.testing.assert_array_equal(scores, expected)


def test_a_chunk_with_another_models_record_is_refused_naming_the_account(frame):
    txs = transactions_from_frame(frame.head(300))
    source, other = Scorer(loaded("lstm", frame)), Scorer(loaded("lstm", frame, seed=1))
    source.score(txs)
    other.score(txs)
    accounts = sorted(source.accounts_in_memory)
    values = source.account_states_bytes(accounts)
    values[3] = other.account_state_bytes(accounts[3])
    with pytest.raises(ValueError, match=f"record of {accounts[3]!r} was written by another 'lstm' model"):
        Scorer(loaded("lstm", frame)).restore_accounts(accounts, values)


def test_the_known_end_of_each_changelog_partition_follows_its_records():
    dormant = DormantStates(capacity=10)
    dormant.restored({"a": (0, 4), "b": (1, 9)}, [], seq=0)
    dormant.committed({"a": (0, 12), "c": (2, 3), "b": None})  # b deleted in a tail read
    assert dormant.ends == {0: 13, 1: 10, 2: 4} and dormant.where == {"a": (0, 12), "c": (2, 3)}
    dormant.drop_partitions([0])
    assert dormant.ends == {1: 10, 2: 4}


def test_new_partitions_wait_paused_and_are_sought_to_offsets_fetched_before_the_changelog_read():
    service, consumer = make_service([])
    calls = []
    consumer.committed_offsets = {P1: 40}
    committed = consumer.committed
    consumer.committed = lambda tp, timeout_ms=None: (
        calls.append(f"committed {tp.partition}"),
        committed(tp),
    )[1]
    service._restore = lambda partitions: calls.append(f"restore {partitions}")
    service.on_assigned([P0, P1])
    assert consumer.paused == {P0, P1} and calls == [] and service.assigned == set()
    service._catch_up()
    assert calls == ["committed 0", "committed 1", "restore [0, 1]"]
    assert consumer.sought == {P0: 0, P1: 40} and consumer.paused == set() and service.assigned == {0, 1}
    service._catch_up()
    assert len(calls) == 3  # nothing more to do


def test_a_partition_added_after_the_start_is_read_unpaused_with_nothing_to_restore(caplog):
    # No changelog partition holds its accounts' states: its records are dead-lettered as they come
    # (tests/integration/test_service.py has the whole of it against the broker).
    service, consumer = make_service([])
    service.partitions = 1
    restored = []
    service._restore = restored.append
    service.on_assigned([P0, P1])
    assert consumer.paused == {P0} and service.to_restore == {0} and service.assigned == {1}
    assert "transactions partitions [1] are beyond the 1 this instance started with" in caplog.text
    service._catch_up()
    assert restored == [[0]] and service.assigned == {0, 1}


def test_a_rewind_reads_no_changelog_for_a_partition_added_after_the_start(monkeypatch):
    service, _ = make_service([])
    service.partitions, service.assigned = 1, {0, 1}
    tails = []
    monkeypatch.setattr(
        restore_module, "read_places", lambda r, t, starts, s: (tails.append(starts), ({}, 0))[1]
    )
    service._restore_terminals = lambda: None
    service._rewind({P0: [Key(b"a")], P1: [Key(b"b")]})
    assert tails == [{0: 0}] and service.to_seek == {0, 1}  # both go back; only 0 has states to read
    service._rewind({P1: [Key(b"b")]})
    assert tails == [{0: 0}]


def test_a_rewind_lets_go_of_the_batchs_accounts_only_and_seeks_back_before_the_next_poll(frame, monkeypatch):
    service, consumer = make_service([])
    txs = transactions_from_frame(frame.head(400))
    service.scorer.score(txs, [(0, i) for i in range(len(txs))])
    service.scorer.take_changed()
    service.assigned = {0}
    held = set(service.scorer.accounts_in_memory)
    in_batch = sorted(held)[:2]
    tails = []

    def read_places(reader, topic, starts, timeout_s):
        tails.append(starts)
        return {in_batch[0]: (0, 77)}, 1  # its record landed after all: the next read takes that one

    monkeypatch.setattr(restore_module, "read_places", read_places)
    service._restore_terminals = lambda: None
    service.dormant.committed({in_batch[0]: (0, 5), in_batch[1]: (0, 6)})
    batch = {P0: [Key(a.encode()) for a in in_batch]}
    service._rewind(batch)
    assert set(service.scorer.accounts_in_memory) == held - set(in_batch)
    assert tails == [{0: 7}] and service.dormant.where[in_batch[0]] == (0, 77)
    assert service.to_seek == {0} and consumer.sought == {}
    consumer.committed_offsets = {P0: 3}
    service._catch_up()
    assert consumer.sought == {P0: 3} and service.stats.states_rewound == 2


class Key:
    def __init__(self, key: bytes):
        self.key = key


def test_a_commit_that_missed_a_cooperative_rebalance_is_read_again_without_rejoining():
    service, log, _, stop = scripted_loop(
        [({P0: records(0, 1)}, None), ({P0: records(0, 2)}, None), ({P0: records(0, 1, 2)}, None)],
        commits=[CommitFailedError("IllegalGenerationError")],
    )

    def rebalance_then_fail():  # the group moves to generation 2 while the commit is on its way
        service.consumer.group = ConsumerGroupMetadata("group", generation_id=2, member_id="member-1")
        raise CommitFailedError("IllegalGenerationError")

    service.producer.commits = [rebalance_then_fail]
    service.run(stop)
    assert "rejoined" not in log and log.count("rewound 0:1 0:2") == 1
    assert log[-2:] == ["offsets 0:3", "committed"] and service.failures == 0


class _Watermarks:
    def __init__(self, end: dict):
        self.end, self.end_calls = end, 0

    def beginning_offsets(self, tps):
        return {tp: 0 for tp in tps}

    def end_offsets(self, tps):
        self.end_calls += 1
        return {tp: self.end[tp] for tp in tps}


class _Committed:
    """Hands out each assigned partition's records, from offset 0, one poll at a time."""

    def __init__(self, records: dict):
        self.records, self.at = records, {}

    def assign(self, tps):
        self.at = {tp: 0 for tp in tps}

    def seek_to_beginning(self, *tps):
        self.at.update({tp: 0 for tp in tps})

    def position(self, tp):
        return self.at[tp]

    def poll(self, timeout_ms):
        out = {tp: self.records[tp][at:] for tp, at in self.at.items() if self.records[tp][at:]}
        self.at.update({tp: len(self.records[tp]) for tp in out})
        return out

    def unsubscribe(self):
        self.at = {}


class _Scorer:
    def __init__(self):
        self.store, self.reserved = {}, None

    def reserve_accounts(self, count):
        self.reserved = count

    def restore_accounts(self, accounts, values):
        """As Scorer.restore_accounts: a value starting b"bad" stands for a corrupt record, left out."""
        pairs = list(zip(accounts, values, strict=True))
        self.store.update((a, v) for a, v in pairs if not v.startswith(b"bad"))
        return [(a, "corrupt") for a, v in pairs if v.startswith(b"bad")]

    def evict(self, account, discard_changes=False):
        del self.store[account]


def test_a_changelog_restore_asks_for_the_end_offsets_once_and_reserves_and_reads_to_them():
    def record(partition, offset, key):
        return ConsumerRecord(
            "cl", partition, 0, offset, 0, 0, key.encode(), b"v" + key.encode(), None, None, 2, 2, -1
        )

    tps = [TopicPartition("cl", 0), TopicPartition("cl", 1)]
    logs = {tps[0]: [record(0, 0, "a"), record(0, 1, "b")], tps[1]: [record(1, 0, "c")]}
    watermarks = _Watermarks({tp: len(log) for tp, log in logs.items()})
    scorer = _Scorer()
    done = restore_partitions(scorer, Reader(_Committed(logs), watermarks), "cl", [0, 1], 5.0, keep=10)
    assert watermarks.end_calls == 1 and scorer.reserved == 3 and done.read == 3
    assert scorer.store == {"a": b"va", "b": b"vb", "c": b"vc"}


def test_an_account_whose_last_record_is_corrupt_is_neither_held_nor_noted_and_is_counted():
    def record(offset, key, value):
        return ConsumerRecord("cl", 0, 0, offset, 0, 0, key.encode(), value, None, None, 2, 2, -1)

    tp = TopicPartition("cl", 0)
    logs = {
        tp: [record(0, "a", b"va"), record(1, "b", b"vb"), record(2, "a", b"bad a"), record(3, "c", b"vc")]
    }
    scorer = _Scorer()
    done = restore_partitions(scorer, Reader(_Committed(logs), _Watermarks({tp: 4})), "cl", [0], 5.0, keep=10)
    assert done.corrupt == 1 and sorted(done.accounts) == ["b", "c"] and sorted(done.where) == ["b", "c"]
    assert "a" not in done.where  # never read back: its next event starts it again


def test_a_restore_notes_its_accounts_least_recently_written_first_and_a_tombstone_deletes_one():
    # The order the bound lets accounts go in (consumers/service/dormant.py); the tombstone is one it wrote.
    def record(offset, key, value):
        return ConsumerRecord("cl", 0, 0, offset, 0, 0, key.encode(), value, None, None, 2, 2, -1)

    tp = TopicPartition("cl", 0)
    values = [("a", b"va"), ("b", b"vb"), ("c", b"vc"), ("a", b"va2"), ("b", None)]
    logs = {tp: [record(offset, key, value) for offset, (key, value) in enumerate(values)]}
    scorer = _Scorer()
    done = restore_partitions(scorer, Reader(_Committed(logs), _Watermarks({tp: 5})), "cl", [0], 5.0, keep=10)
    assert list(done.where.items()) == [("c", (0, 2)), ("a", (0, 3))]
    assert scorer.store == {"a": b"va2", "c": b"vc"}  # b deleted: its next event starts it as a new account


def test_a_committed_batch_notes_its_tombstones_and_counts_the_accounts_it_let_go(caplog):
    service, _ = make_service([], max_states_in_memory=1, max_accounts_kept=2)
    service.dormant.committed({"x": (1, 4), "y": (0, 2), "z": (0, 3)})
    gone = service.dormant.let_go(set(), seq=1)
    cl = service.changelog
    out = ScoredBatch({}, seq=1, accounts_let_go=len(gone))
    out.records = [(cl, "x", None, 1), (cl, "w", b"state", 0), ("scores", "w", b"score", 0)]
    out.sent = [SimpleNamespace(value=SimpleNamespace(offset=o)) for o in (5, 6, 7)]
    with caplog.at_level("WARNING"):
        service._let_dormant_go(Committed(out, 0.0, 0.0))
    assert service.dormant.where == {"y": (0, 2), "z": (0, 3), "w": (0, 6)} and service.dormant.ends[1] == 5
    assert service.dormant.put_back() == set()  # gone for good: its tombstone committed
    assert service.stats.accounts_let_go == 1 == service.metrics.get("txsentinel_accounts_let_go_total")
    assert "accounts let go past the bound max_accounts_kept=2 let_go=1" in caplog.text


def test_a_rewind_keeps_the_accounts_its_batches_were_letting_go_and_reads_their_partitions_tail(monkeypatch):
    service, _ = make_service([], max_states_in_memory=1, max_accounts_kept=2, max_poll_records=3)
    assert service.dormant.let_go_per_batch == 30  # ten an event a batch may hold
    service.assigned = {0, 1}
    tails = []
    monkeypatch.setattr(
        restore_module, "read_places", lambda r, t, starts, s: (tails.append(starts), ({}, 0))[1]
    )
    service._restore_terminals = lambda: None
    service.dormant.committed({"x": (1, 4), "y": (0, 2), "z": (0, 3)})
    assert service.dormant.let_go(set(), seq=1) == {"x": (1, 4)}
    service._rewind({P0: [Key(b"a")]})
    # x's tombstone may have landed after all: partition 1 is read past what is known, as 0 is
    assert tails == [{0: 4, 1: 5}] and list(service.dormant.where) == ["x", "y", "z"]
    assert service.to_seek == {0}
    assert service.dormant.let_go(set(), seq=2) == {"x": (1, 4)}  # the next batch lets it go again


def _features(**values):
    def change(record):
        features = np.frombuffer(record.features, dtype=ACCOUNT_STATE).copy()
        for name, value in values.items():
            features[name].flat[0] = value
        return dataclasses.replace(record, features=features.tobytes())

    return change


def _nan_state(record):
    return dataclasses.replace(record, detector=record.detector[:-4] + struct.pack("<f", float("nan")))


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (_nan_state, r"'lstm' state 'h' holds nan at \[.*\], expected \|h\| <= 1"),
        (_features(sum_log_amount=float("nan")), "sum_log_amount = nan, expected a finite sum >= 0"),
        (_features(count=-5), "count = -5, expected a count >= 0"),
        # Finite, but more than any events fold: poison for every later mean, or an overflow soon after.
        (
            _features(sum_log_amount=1e300),
            r"sum_log_amount = 1e\+300, expected at most count x log1p\(1e\+15\)",
        ),
        (_features(count=2**62), f"count = {2**62}, expected at least the events its day ring holds"),
        (_features(max_day=2**31 - 1), "max_day = 2147483647, expected an epoch day"),
        (_features(day=-7), "day = -7, expected an epoch day"),
        (_features(last_ts_us=2**63 - 1), "last_ts_us = 9223372036854775807, expected 0.."),
        (
            lambda r: dataclasses.replace(r, last_ts_us=2**63 - 1),
            "newest ts 9223372036854775807, expected 0..",
        ),
        (lambda r: dataclasses.replace(r, offset=-9), r"source position \(-1, -9\)"),
    ],
)
def test_a_corrupt_record_is_left_out_naming_the_account_and_its_account_starts_again(frame, corrupt, reason):
    # Restored, a NaN in a state makes every later score of the account fail, and a day past the composite
    # keys' range spills into the other accounts of its batches: a corrupt record is refused, not applied,
    # and it stops nothing: its account starts again from no history, the others are restored.
    txs = transactions_from_frame(frame.head(300))
    source = Scorer(loaded("lstm", frame))
    source.score(txs)
    accounts = sorted(source.accounts_in_memory)
    values = source.account_states_bytes(accounts)
    values[3] = corrupt(decode_account_record(values[3])).to_bytes()
    match = f"account state record of {accounts[3]!r}: {reason}.* the record is corrupt"
    with pytest.raises(CorruptRecordError, match=match):
        Scorer(loaded("lstm", frame)).restore_account(accounts[3], values[3])
    target = Scorer(loaded("lstm", frame))
    target.score(txs[:50])  # memory holds an older state of some accounts: the corrupt one's goes too
    (left_out,) = target.restore_accounts(accounts, values)
    assert left_out[0] == accounts[3] and re.search(match, left_out[1])
    assert sorted(target.accounts_in_memory) == sorted(set(accounts) - {accounts[3]})
    sound = accounts[:3] + accounts[4:]
    assert target.account_states_bytes(sound) == values[:3] + values[4:]


@pytest.mark.parametrize("garbage", [b'{"event_id": "e1", "amount": 5}', b"TXS", b""])
def test_a_changelog_value_that_is_no_state_record_is_left_out_and_stops_nothing(frame, garbage):
    # A transaction produced to the changelog by mistake: no state of any model, so nothing to deploy anew.
    txs = transactions_from_frame(frame.head(300))
    source = Scorer(loaded("lstm", frame))
    source.score(txs)
    accounts = sorted(source.accounts_in_memory)
    values = source.account_states_bytes(accounts)
    values[1] = garbage
    target = Scorer(loaded("lstm", frame))
    (left_out,) = target.restore_accounts(accounts, values)
    assert left_out[0] == accounts[1] and "not a txsentinel account state" in left_out[1]
    assert sorted(target.accounts_in_memory) == sorted(set(accounts) - {accounts[1]})


def test_the_challengers_record_of_an_account_let_go_gets_its_tombstone_too():
    side = ShadowSide.__new__(ShadowSide)  # only its changelog and places are used here
    side.changelog, side.places = "cl.f00", DormantStates(1)
    side.places.committed({"x": (1, 4), "y": (0, 2)})
    tombstones = side.tombstones(["x", "never-shadowed"])
    assert tombstones == [("cl.f00", "x", None, 1)]
    side.committed(tombstones, [SimpleNamespace(value=SimpleNamespace(offset=9))])
    assert side.places.where == {"y": (0, 2)}  # its place goes once the tombstone commits
