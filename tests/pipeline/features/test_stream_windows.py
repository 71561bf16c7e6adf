"""The in-batch windows' correction for late events against a slow, readable reference: every late event
compared with every event, one pair at a time."""

import tracemalloc

import numpy as np
import pytest

from pipeline.features.definitions import WINDOW_DAYS
from pipeline.features.stream_windows import DAY_SPAN, _late_in_batch, in_batch_windows

DAY = 20_500


def late_reference(key: np.ndarray, days: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(miscounted [W, N], sums [W, N]) as _Late holds them, pair by pair."""
    codes, day_eff = key // DAY_SPAN, key % DAY_SPAN
    n = len(key)
    miscounted, sums = np.zeros((len(WINDOW_DAYS), n), dtype=np.int64), np.zeros((len(WINDOW_DAYS), n))
    for w, window in enumerate(WINDOW_DAYS):
        for i in range(n):
            first_day = day_eff[i] - window + 1  # i's window: first_day .. day_eff[i]
            for j in range(i + 1):
                if days[j] == day_eff[j] or codes[j] != codes[i]:
                    continue  # not late, or another entity's
                if j == i or days[j] >= first_day:
                    sums[w, i] += values[j]
                elif day_eff[j] >= first_day:
                    miscounted[w, i] += 1
    return miscounted, sums


def batch_of(codes: np.ndarray, days: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(key [N], days [N]) laid out as stream.py's _entity_batch lays them, codes sorted."""
    return np.maximum.accumulate(codes * DAY_SPAN + days), days


@pytest.mark.parametrize("seed", range(40))
def test_late_events_are_corrected_as_the_pairwise_reference_does(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 80))
    codes = np.sort(rng.integers(0, rng.integers(1, 6), n))
    newest = int(rng.choice([DAY, DAY_SPAN - 3, 40]))  # near the top of the day range, and near its start
    key, days = batch_of(codes, newest - rng.integers(0, rng.choice([2, 10, 40, 100]), n))
    values = rng.integers(0, 1000, n).astype(np.float64)  # whole numbers: every order of adding is exact
    late = _late_in_batch(key, days, values)
    if (days == key % DAY_SPAN).all():
        assert late is None  # nothing came late: nothing to correct
        return
    miscounted, sums = late_reference(key, days, values)
    np.testing.assert_array_equal(late.miscounted, miscounted)
    np.testing.assert_array_equal(late.sums, sums)


def alternating(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One account alternating today and yesterday: every other event late. (key, values, first, days)."""
    days = np.where(np.arange(n) % 2 == 0, DAY, DAY - 1)
    key, days = batch_of(np.zeros(n, dtype=np.int64), days)
    first = np.arange(n) == 0
    return key, np.arange(n, dtype=np.float64), first, days


def test_half_of_a_large_batch_late_on_one_account_is_counted_and_summed_exactly():
    n = 5_000
    key, values, first, days = alternating(n)
    windows = in_batch_windows(key, values, first, days)
    position = np.arange(n)
    # The 1-day window holds today's events (and a late event itself); the others hold all before.
    today = days == DAY
    np.testing.assert_array_equal(windows[1][0], np.cumsum(today) + ~today)
    np.testing.assert_array_equal(windows[1][1], np.cumsum(np.where(today, values, 0.0)) + ~today * values)
    for d in WINDOW_DAYS[1:]:
        np.testing.assert_array_equal(windows[d][0], position + 1)
        np.testing.assert_array_equal(windows[d][1], np.cumsum(values))


def test_the_work_of_a_batch_of_late_events_grows_with_the_batch_not_its_square():
    # 5,000 events, 2,500 of them late: comparing every event with every late one would hold arrays of
    # W * N * L = 37.5 million elements (hundreds of MiB); the runs hold O((N + L) log N).
    key, values, first, days = alternating(5_000)
    tracemalloc.start()
    try:
        in_batch_windows(key, values, first, days)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"{peak / 2**20:.1f} MiB at the peak for 5,000 events"
