"""The poll size bound: a batch must finish well inside max_poll_interval_ms at the measured cost."""

import pytest

from consumers.service.batch_limit import BatchLimit


def test_cheap_events_keep_max_poll_records():
    limit = BatchLimit(max_poll_records=500, max_poll_interval_ms=300_000)
    for _ in range(20):
        assert limit.observe(500, 0.1) == 500  # 0.2 ms an event: 500 take 0.1 s of a 75 s budget


def test_slow_events_lower_the_limit_to_the_budget_then_recover():
    limit = BatchLimit(max_poll_records=500, max_poll_interval_ms=10_000, budget_fraction=0.25)
    assert limit.observe(500, 50.0) == 25  # 0.1 s an event; budget 2.5 s -> 25 records
    assert limit.records == 25
    for _ in range(60):  # the model got faster (or the load dropped): the average follows, the cap lifts
        limit.observe(25, 0.025)
    assert limit.records == 500


def test_the_limit_never_drops_below_one_record():
    limit = BatchLimit(max_poll_records=500, max_poll_interval_ms=1_000)
    assert limit.observe(1, 30.0) == 1


def test_an_empty_batch_teaches_nothing():
    limit = BatchLimit(max_poll_records=500, max_poll_interval_ms=1_000)
    assert limit.observe(0, 5.0) == 500 and limit.seconds_per_event is None


def test_budget_fraction_must_be_a_fraction():
    with pytest.raises(ValueError, match="budget_fraction"):
        BatchLimit(500, 1_000, budget_fraction=0.0)
