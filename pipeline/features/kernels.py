"""Compiled one-pass kernels behind the batch features (numba), equal bit for bit to batch_reference.py.

The reference lays each entity's events out together (a counting sort), scans per entity with polars and
finds every window's first event with `searchsorted`: a dozen passes over the data. A kernel walks the
events once, in event order, and keeps per entity what those passes compute: running sums, the previous
timestamp and, for every window, a pointer to the entity's first event still inside it. The pointers only
move forward because the events are in (ts, event_id) order, so each entity's days never decrease.

Every float is computed with the reference's operations in the reference's order, so the results are
identical, not merely close; tests/pipeline/features/test_features.py holds the two equal on generated data.
All arrays are [N] in event order unless said otherwise; W = number of windows.
"""

import numpy as np
from numba import njit


@njit(cache=True)
def _segment_starts(codes: np.ndarray, n_entities: int) -> np.ndarray:
    """[E + 1]: where each entity's events begin in the (entity, event order) layout; the last is N."""
    starts = np.zeros(n_entities + 1, dtype=np.int64)
    for code in codes:
        starts[code + 1] += 1
    return np.cumsum(starts)


@njit(cache=True)
def entity_windows(codes, n_entities, days, windows, values):
    """Per event, over its entity's events up to and including it: (rank [N], counts [W, N], sums [W, N]).

    rank: the entity's events before this one. counts[w]: those of them on days D-d+1 .. D (d = windows[w],
    D this event's day), plus this one. sums[w]: the same window's sum of `values`, as the reference forms
    it: running[here] - running[first] + values[first], with running the entity's running sum. Pass an
    empty `values` for counts only (sums is then [W, 0]).
    """
    n, n_windows = len(codes), len(windows)
    with_values = len(values) > 0
    starts = _segment_starts(codes, n_entities)
    next_slot = starts[:-1].copy()  # [E] the entity's next free place in the layout
    first = np.empty((n_windows, n_entities), dtype=np.int64)  # [W, E] first laid event inside the window
    for w in range(n_windows):
        first[w] = starts[:-1]
    laid_day = np.empty(n, dtype=np.int64)
    laid_running = np.empty(n if with_values else 0)
    laid_value = np.empty(n if with_values else 0)
    rank = np.empty(n, dtype=np.int64)
    counts = np.empty((n_windows, n), dtype=np.int64)
    sums = np.empty((n_windows, n if with_values else 0))
    for i in range(n):
        entity, day = codes[i], days[i]
        here = next_slot[entity]
        next_slot[entity] = here + 1
        rank[i] = here - starts[entity]
        laid_day[here] = day
        if with_values:
            # The entity's running sum starts AT its first value (a cumulative sum), not at 0.0 + value.
            laid_running[here] = values[i] if rank[i] == 0 else laid_running[here - 1] + values[i]
            laid_value[here] = values[i]
        for w in range(n_windows):
            oldest_day = day - (windows[w] - 1)
            j = first[w, entity]
            while laid_day[j] < oldest_day:
                j += 1
            first[w, entity] = j
            counts[w, i] = here - j + 1
            if with_values:
                sums[w, i] = laid_running[here] - laid_running[j] + laid_value[j]
    return rank, counts, sums


@njit(cache=True)
def account_history(codes, n_accounts, ts_us, log_amount, seconds_per_us):
    """All-history moments before each event: (prev_sum_log_amount, prev_sumsq_log_amount, gap_s).

    As the reference: an inclusive running sum per account minus this event's own term; the gap in seconds
    since the account's previous event, 0 for its first. Polars divides an integer column by a constant as
    a product with its reciprocal, so the gap is (ts - previous ts) * seconds_per_us (= 1 / 1e6), not / 1e6.
    """
    n = len(codes)
    seen = np.zeros(n_accounts, dtype=np.bool_)
    running = np.zeros(n_accounts)
    running_sq = np.zeros(n_accounts)
    last_ts = np.zeros(n_accounts, dtype=np.int64)
    prev_sum = np.empty(n)
    prev_sumsq = np.empty(n)
    gap_s = np.empty(n)
    for i in range(n):
        account = codes[i]
        term = log_amount[i]
        square = term * term
        if seen[account]:
            total, total_sq = running[account] + term, running_sq[account] + square
            gap_s[i] = np.float64(ts_us[i] - last_ts[account]) * seconds_per_us
        else:
            total, total_sq = term, square
            gap_s[i] = 0.0
            seen[account] = True
        running[account], running_sq[account] = total, total_sq
        prev_sum[i] = total - term
        prev_sumsq[i] = total_sq - square
        last_ts[account] = ts_us[i]
    return prev_sum, prev_sumsq, gap_s


@njit(cache=True)
def terminal_reports(codes, n_terminals, ts_us, days, report_codes, report_us, windows, day_us):
    """[W, N]: fraud reports of the event's terminal with label time on days D-d+1 .. D and <= its ts.

    report_codes, report_us [R]: the terminal and label time (µs) of each fraud report, sorted by time.
    Per terminal and window, two pointers into its reports: past every report at or before the event's ts,
    and past every report before the window's first day.
    """
    n, n_windows = len(codes), len(windows)
    starts = _segment_starts(report_codes, n_terminals)
    next_slot = starts[:-1].copy()
    laid_us = np.empty(len(report_us), dtype=np.int64)  # each terminal's reports together, in time order
    for k in range(len(report_us)):
        terminal = report_codes[k]
        laid_us[next_slot[terminal]] = report_us[k]
        next_slot[terminal] += 1
    known = starts[:-1].copy()  # [T] first report after the current event's ts
    before = np.empty((n_windows, n_terminals), dtype=np.int64)  # [W, T] first report inside the window
    for w in range(n_windows):
        before[w] = starts[:-1]
    out = np.empty((n_windows, n), dtype=np.int64)
    for i in range(n):
        terminal = codes[i]
        end = starts[terminal + 1]
        j = known[terminal]
        while j < end and laid_us[j] <= ts_us[i]:
            j += 1
        known[terminal] = j
        for w in range(n_windows):
            window_start_us = (days[i] - (windows[w] - 1)) * day_us
            k = before[w, terminal]
            while k < end and laid_us[k] < window_start_us:
                k += 1
            before[w, terminal] = k
            out[w, i] = j - k
    return out
