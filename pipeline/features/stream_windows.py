"""The in-batch part of the stream's windows: what the earlier events of a micro-batch add to each event's
counts and sums, per entity (account or terminal).

Events come laid out as stream.py's _entity_batch lays them: by entity, then arrival, under a non-decreasing
key `entity * DAY_SPAN + the entity's newest day so far`, so each event's window "days D-d+1 .. D" is one
run of the layout, found by searchsorted. Two promises hold to the last bit:
- a sum adds values of its own entity only (grouped_scan): one account's amounts never reach another's;
- a window's sum adds the values of the events in that window only (window_sums, and _late_in_batch for the
  events that came late): an amount outside it never reaches it either. A difference of running sums would
  carry the rounding of everything before the window: beside an amount of 1e15 (MAX_AMOUNT) a window of
  small amounts would be off by about 0.1, beside the service's default max_amount of 1e9 by about 1e-7.
"""

from typing import NamedTuple

import numpy as np

from pipeline.features.definitions import WINDOW_DAYS
from pipeline.features.state import MAX_EPOCH_DAY

DAY_SPAN = MAX_EPOCH_DAY + 1  # composite key = code * DAY_SPAN + day; epoch days stay far below 2**20
_WINDOWS = np.asarray(WINDOW_DAYS, dtype=np.int64)


def grouped_scan(values: np.ndarray, first: np.ndarray) -> list[np.ndarray]:
    """The levels of a running sum of `values` [N] (sorted by group) that restarts at each group (`first`
    [N] marks a group's first element): levels[k][i] [N] is the sum of the 2**k values of i's group ending
    at i (fewer at the group's start), and the last level is the inclusive running sum.

    A Hillis-Steele scan: log2 of the longest group vectorised steps, each sum in an order set by the
    positions within the group, so a group's sums do not depend on any other group's values or on where the
    group lies in the batch, to the last bit.
    """
    n = len(values)
    index = np.arange(n)
    within = index - np.maximum.accumulate(np.where(first, index, 0))  # position inside the group
    levels = [np.array(values, dtype=np.float64)]
    shift = 1
    while True:
        take = np.flatnonzero(within >= shift)
        if len(take) == 0:
            return levels
        out = levels[-1].copy()
        out[take] = out[take] + out[take - shift]
        levels.append(out)
        shift *= 2


def grouped_cumsum(values: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Inclusive running sums of `values` [N] that restart at each group: grouped_scan's last level."""
    return grouped_scan(values, first)[-1]


def window_sums(levels: list[np.ndarray], starts: np.ndarray, group_starts: np.ndarray) -> np.ndarray:
    """[W, N]: the sum of values[starts[w, i] .. i] for each window w and event i, the range lying within
    i's group, which begins at group_starts[i]; levels: grouped_scan's of the values.

    A range from the group's start is its running sum (the last level). Another is tiled from its end down
    by the blocks of the bits of its length, largest first, each read from its level: the range's values
    only, each once. The service's batches span minutes, so their windows nearly all start with the group."""
    total = np.repeat(levels[-1][None, :], len(starts), axis=0)  # [W, N]
    w, i = np.nonzero(starts > group_starts)  # [C] the windows that begin inside their group
    if len(i):
        length = i - starts[w, i] + 1  # [C] >= 1
        end = i.copy()  # [C] where the next block ends
        part = np.zeros(len(i))
        for k in range(len(levels) - 1, -1, -1):
            block = (length >> k) & 1  # [C] 1 where the length has bit k
            part += np.where(block == 1, levels[k][end], 0.0)  # `end` may be -1 where unused: any value
            end -= block << k
        total[w, i] = part
    return total


def in_batch_windows(
    key: np.ndarray, values: np.ndarray | None, first: np.ndarray | None, days: np.ndarray
) -> dict[int, tuple[np.ndarray, np.ndarray | None]]:
    """For each window d: (count [N], sum of values [N] or None) over the earlier-or-same events of this
    batch in the window, each earlier event on its own day. key [N] sorted (module docstring); first [N]
    marks each entity's first event (needed with values only); days [N] each event's own day, in key order."""
    position = np.arange(len(key))
    starts = np.searchsorted(key, key[None, :] - (_WINDOWS[:, None] - 1), side="left")  # [W, N]
    counts = position - starts + 1
    late = _late_in_batch(key, days, values)
    totals = None
    if values is not None:
        # A late event's value is added by _late_in_batch, in the windows its own day falls in.
        on_time = values if late is None else np.where(late.is_late, 0.0, values)
        group_starts = np.maximum.accumulate(np.where(first, position, 0))
        totals = window_sums(grouped_scan(on_time, first), starts, group_starts)
    if late is not None:
        counts = counts - late.miscounted
        totals = None if totals is None else totals + late.sums
    return {d: (counts[w], None if totals is None else totals[w]) for w, d in enumerate(WINDOW_DAYS)}


class _Late(NamedTuple):
    """A batch's late events, as in_batch_windows corrects for them (all in key order)."""

    is_late: np.ndarray  # [N] bool: the event's own day is before its entity's newest so far
    miscounted: np.ndarray  # [W, N] earlier late events the key's window counts and their own day does not
    sums: (
        np.ndarray | None
    )  # [W, N] values of the late events whose own day is in the window, itself included


def _late_in_batch(key: np.ndarray, days: np.ndarray, values: np.ndarray | None) -> _Late | None:
    """What the searchsorted windows of in_batch_windows get wrong: they count each earlier event of the
    batch on its entity's newest day so far (its key), where the state folds a late event on its own day.
    None when no event of the batch came late (the common case: nothing to correct).

    Per window and event, the earlier late events of its entity whose key falls in its window and whose own
    day does not (counted, to be taken back), and the sum of the values of the late events that belong in
    it: its own, late or not counted in its own window as the batch form's windows do, and the earlier ones
    whose own day falls in it (their key then does too).

    An entity's keys never decrease, so the later events whose window holds a late event j's own day are a
    run just after it, j+1 .. own_end[j], and those whose window holds its key a longer run, j+1 ..
    key_end[j]: both found by searchsorted, the counts then read off integer running sums (exact). The sums
    add each value to the power-of-two blocks tiling its run (_run_sums): O((N + L) log N) work and memory,
    not a [N, L] comparison against the L late ones (one account alternating two days, 5,000 events, 2,500
    of them late: 5 ms and a 2.7 MiB peak, where a [W, N, L] comparison took 240 ms and 406 MiB)."""
    codes, day_eff = key // DAY_SPAN, key % DAY_SPAN
    is_late = days < day_eff
    late = np.flatnonzero(is_late)
    if not late.size:
        return None
    n, rows = len(key), len(_WINDOWS)
    at_row = np.arange(rows)[:, None] * n  # [W, 1]: window w's events at w*N .. w*N + N-1 when flattened
    group_start = np.searchsorted(key, codes * DAY_SPAN, side="left")  # [N] where each event's entity begins
    entity_end = np.searchsorted(key, (codes[late] + 1) * DAY_SPAN, side="left")  # [L] one past its entity
    own_day = key[late] - day_eff[late] + days[late]  # [L] a late event's own day, in key form
    # [W, L] one past the last later event whose window holds the late event's own day, and its key (a window
    # holds a key's day and the window - 1 before); its own day may be out of its own window already.
    own_end = np.searchsorted(key, own_day + _WINDOWS[:, None])
    own_end = np.maximum(np.minimum(own_end, entity_end), late + 1)
    key_end = np.minimum(np.searchsorted(key, key[late] + _WINDOWS[:, None]), entity_end)
    # miscounted: per late event, its events own_end .. key_end - 1, in exact integer running sums
    change = np.bincount((own_end + at_row).ravel(), minlength=rows * n + 1)
    change -= np.bincount((key_end + at_row).ravel(), minlength=rows * n + 1)
    miscounted = np.cumsum(change)[:-1].reshape(rows, n)
    sums = None
    if values is not None:
        in_runs = _run_sums(
            (late + 1 + at_row).ravel(),
            (own_end + at_row).ravel(),
            (group_start[late] + at_row).ravel(),
            np.tile(values[late], rows),
            (group_start + at_row).ravel(),
        )
        sums = in_runs.reshape(rows, n) + np.where(is_late, values, 0.0)
    return _Late(is_late, miscounted, sums)


def _run_sums(
    begin: np.ndarray, end: np.ndarray, run_group: np.ndarray, values: np.ndarray, group_start: np.ndarray
) -> np.ndarray:
    """[N]: at each position i, the sum of the values[r] [R] whose run begin[r] .. end[r] - 1 holds i, and
    of those only. Run r lies in the group beginning at run_group[r]; group_start [N] is where each
    position's group begins.

    Each run is tiled by power-of-two blocks aligned within its group (so a group's sums do not depend on
    where it lies in the batch): an ascending pass takes the blocks that bring its start to a larger
    alignment, a descending one the rest, largest first. Position i then adds, per block size, the one
    block of its group holding it: each covering value once, each block's values in run order."""
    offset = begin - run_group  # [R] the start within the group, moved on block by block
    length = np.maximum(end - begin, 0)  # [R] what remains to tile
    sizes = range(int(length.max(initial=0)).bit_length())  # block sizes 2**k
    blocks: dict[int, list[np.ndarray]] = {k: [] for k in sizes}  # k -> the runs that took a block of 2**k

    def take(k: int, runs: np.ndarray) -> None:
        blocks[k].append(np.stack([runs, offset[runs] >> k]))  # [2, R_k]: run, block index in its group
        offset[runs] += 1 << k
        length[runs] -= 1 << k

    for k in sizes:  # ascending: the start moves to the next multiple of 2**(k+1) where that fits
        take(k, np.flatnonzero(((offset >> k) & 1 == 1) & (length >= 1 << k)))
    for k in reversed(sizes):  # descending: the start is now a multiple of every block size that fits
        take(k, np.flatnonzero(length >= 1 << k))
    n = len(group_start)
    within = np.arange(n) - group_start  # [N] each position's place in its group
    total = np.zeros(n)
    for k, taken in blocks.items():
        runs, index = np.concatenate(taken, axis=1)
        order = np.argsort(runs, kind="stable")  # each block adds its values in run order
        runs, index = runs[order], index[order]
        # a block's id is its group's start + its index in the group (below the group's length: unique)
        block_sums = np.bincount(run_group[runs] + index, weights=values[runs], minlength=n)
        total += block_sums[group_start + (within >> k)]
    return total
