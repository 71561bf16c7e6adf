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


def test_past_the_bound_the_least_recently_written_dormant_accounts_go_down_to_nine_tenths():
    dormant = DormantStates(capacity=2, max_accounts=10)
    dormant.committed({f"a{i}": (i % 2, i) for i in range(10)})
    assert dormant.let_go(in_memory=set(), seq=1) == {}  # at the bound: a len, nothing more
    dormant.committed({"a0": (0, 10), "a10": (0, 11), "a11": (1, 12)})  # a0 written again: the most recent
    gone = dormant.let_go(in_memory={"a1"}, seq=2)  # a1 is held in memory: the recently active stay
    assert gone == {"a2": (0, 2), "a3": (1, 3), "a4": (0, 4)}  # 12 -> 9, the oldest written first
    assert len(dormant.where) == 9 and not set(gone) & set(dormant.where)
    assert dormant.returning(["a2"], in_memory=set()) == {}  # not read back: it starts again as new
    assert dormant.let_go(in_memory=set(), seq=3) == {}


def test_accounts_let_go_stay_gone_once_their_batch_commits_and_come_back_first_after_an_abort():
    dormant = DormantStates(capacity=1, max_accounts=2)
    dormant.committed({"x": (1, 4), "y": (0, 2), "z": (0, 3)})
    assert dormant.let_go(set(), seq=1) == {"x": (1, 4)}
    assert dormant.put_back() == {1} and list(dormant.where) == ["x", "y", "z"]  # still the oldest
    assert dormant.let_go(set(), seq=2) == {"x": (1, 4)}
    dormant.committed({"x": None, "w": (0, 5)}, seq=2)  # the batch's tombstone and state records
    assert dormant.put_back() == set() and list(dormant.where) == ["y", "z", "w"]


def test_a_partition_leaving_takes_the_accounts_it_was_letting_go_with_it():
    dormant = DormantStates(capacity=1, max_accounts=2)
    dormant.committed({"x": (1, 4), "y": (0, 2), "z": (0, 3)})
    dormant.let_go(set(), seq=1)
    dormant.drop_partitions({1})
    assert dormant.put_back() == set() and "x" not in dormant.where


def test_letting_go_is_counted_and_logged_in_aggregate_at_most_once_a_minute(caplog):
    dormant = DormantStates(capacity=1, max_accounts=2)
    with caplog.at_level("WARNING"):
        dormant.count_let_go(0, now=0.0)
        dormant.count_let_go(3, now=1.0)
        dormant.count_let_go(4, now=30.0)
        dormant.count_let_go(0, now=61.5)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and dormant.let_go_total == 7
    assert "max_accounts_kept=2 let_go=3 since_start=3" in lines[0]
    assert "let_go=4 since_start=7" in lines[1] and "initial state" in lines[1]


def test_a_bound_below_twice_what_memory_holds_is_refused():
    with pytest.raises(ValueError, match=r"max_accounts_kept = 5: expected 0 .* at least twice the 3"):
        DormantStates(3, max_accounts=5)
    assert DormantStates(3, max_accounts=0).let_go(set(), seq=1) == {}  # 0: no bound


def _places(accounts: range) -> dict:
    return {f"a{i}": (i % 4, i) for i in accounts}


def _drain(dormant: DormantStates, seq: int, new: range = range(0)) -> int:
    """One batch: let go, its new accounts, its commit; the accounts it let go."""
    gone = dormant.let_go(set(), seq)
    dormant.committed({**dict.fromkeys(gone), **_places(new)}, seq)
    return len(gone)


def test_a_batch_lets_go_of_at_most_ten_accounts_an_event_and_batches_drain_one_scan_down_to_nine_tenths():
    # A restore onto more partitions: twice the tenth past the bound at once, ~20,000 tombstones to write
    dormant = DormantStates(capacity=10, max_accounts=100_000)  # max_poll_records: the default 500
    dormant.committed(_places(range(110_001)))
    assert dormant.let_go_per_batch == 5_000
    assert _drain(dormant, seq=1) == 5_000 and len(dormant.to_let_go) == 15_001  # one scan, for later batches
    assert [_drain(dormant, seq) for seq in range(2, 7)] == [5_000, 5_000, 5_000, 1, 0]
    assert len(dormant.where) == 90_000 and not dormant.to_let_go
    # A flood: every event of every batch a new account; the batches still keep the bound
    counts, new = [], 110_001
    for seq in range(7, 80):
        assert _drain(dormant, seq, range(new, new + 500)) <= 5_000
        counts.append(len(dormant.where))
        new += 500
    assert max(counts) <= 100_000 + 500 and min(counts[20:]) < 95_000  # let go of, down towards 90,000


def test_a_queued_account_written_again_deleted_or_held_in_memory_by_its_turn_stays():
    dormant = DormantStates(capacity=1, max_accounts=10, max_poll_records=1)  # 10 a batch
    dormant.committed(_places(range(30)))  # 21 past keep (9): a0-a20 queued
    assert list(dormant.let_go(set(), seq=1)) == [f"a{i}" for i in range(10)]
    dormant.committed({"a10": (2, 30), "a11": None}, seq=1)  # a10 written again (the newest now), a11 deleted
    gone = dormant.let_go(in_memory={"a12"}, seq=2)
    assert list(gone) == [f"a{i}" for i in range(13, 21)] and not dormant.to_let_go
    assert {"a10", "a12"} <= set(dormant.where)


def test_an_abort_puts_the_accounts_back_first_in_the_queue_and_the_next_batch_lets_them_go_again():
    dormant = DormantStates(capacity=1, max_accounts=10, max_poll_records=1)
    dormant.committed(_places(range(30)))
    first = dormant.let_go(set(), seq=1)
    second = dormant.let_go(set(), seq=2)  # both uncommitted when the abort comes
    assert dormant.put_back() == {0, 1, 2, 3} and list(dormant.where)[:20] == [*first, *second]
    assert dormant.let_go(set(), seq=3) == first and dormant.let_go(set(), seq=4) == second
    assert len(dormant.let_go(set(), seq=5)) == 1 and len(dormant.where) == 9


def test_accounts_queued_to_go_leave_with_their_partitions_and_those_left_are_picked_again():
    dormant = DormantStates(capacity=1, max_accounts=10, max_poll_records=1)
    dormant.committed(_places(range(40)))
    dormant.let_go(set(), seq=1)  # a0-a9; a10-a30 queued
    dormant.drop_partitions({0})  # 23 stay, past the bound: picked again from them
    assert not dormant.to_let_go and _drain(dormant, seq=2) == 10 and len(dormant.to_let_go) == 4
    dormant.drop_partitions({1, 2})  # 5 stay, under nine tenths: the rest stay
    assert dormant.let_go(set(), seq=3) == {} and len(dormant.where) == 5
