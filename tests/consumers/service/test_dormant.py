"""Which accounts leave memory and which are read back (consumers/service/dormant.py); the service against the real
broker is in tests/integration/test_service.py."""

import pytest

from consumers.service.dormant import DormantStates


def test_the_least_recently_touched_beyond_capacity_go_once_their_batch_has_committed():
    dormant = DormantStates(capacity=2)
    dormant.touched(["a", "b"], seq=1)
    dormant.touched(["c"], seq=2)
    dormant.touched(["a"], seq=3)  # a is the most recent now: b, then c, are the oldest
    dormant.committed({"a": (0, 5), "b": (0, 1), "c": (1, 2)})
    in_memory = {"a", "b", "c", "d"}
    assert dormant.to_evict(in_memory, committed_seq=1) == ["b"]  # c was touched by batch 2, not committed
    assert dormant.to_evict(in_memory - {"b"}, committed_seq=3) == ["c"]


def test_an_account_with_no_record_or_already_gone_is_never_evicted():
    dormant = DormantStates(capacity=1)
    dormant.touched(["gone", "unwritten", "a", "b"], seq=1)
    dormant.committed({"gone": (0, 1), "a": (0, 2), "b": (0, 3)})
    assert dormant.to_evict({"unwritten", "a", "b"}, committed_seq=1) == ["a", "b"]


def test_returning_accounts_are_those_out_of_memory_with_a_record():
    dormant = DormantStates(capacity=10)
    dormant.committed({"a": (0, 4), "b": (2, 9)})
    assert dormant.returning(["a", "b", "new"], in_memory={"a"}) == {"b": (2, 9)}


def test_a_partition_leaving_takes_its_accounts_places_and_recency_with_it():
    dormant = DormantStates(capacity=10)
    dormant.restored({"a": (0, 4), "b": (2, 9)}, in_memory=["a", "b"], seq=0)
    dormant.drop_partitions({2})
    dormant.forget(["b"])
    assert dormant.returning(["a", "b"], in_memory=set()) == {"a": (0, 4)}
    assert list(dormant.recency) == ["a"]  # nothing left behind for an account that went elsewhere


def test_a_capacity_below_one_is_refused():
    with pytest.raises(ValueError, match="at least one account state"):
        DormantStates(0)
