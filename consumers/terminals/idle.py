"""Idle terminals leave memory, and the table writer deletes them from the terminal table (tombstones), so
neither grows for ever.

A terminal is idle when its newest event day and its newest fraud-report day are both more than
`terminal_idle_days` before the newest event day its table holds (stream time, not the clock: a replay of
old data evicts nothing it still needs). Evicting one changes no feature, as long as the events that come
for it later are at most `terminal_idle_days - RING_DAYS` days older than that newest day: its records hold
days only up to its last activity, so every window of an event RING_DAYS or more after it counts none of
them, exactly as for a terminal never seen, and its max_day no longer moves such an event's day. Hence the
setting must exceed RING_DAYS (checked at start), and every scorer and the writer may evict on their own,
whenever they like: what they hold stays the fold of what they read, feature for feature.

One thing eviction does change: the terminal's memory of the events it was reported for goes with it, so a
label repeated later counts as a new report, on the holders that have evicted it and not on the others
until they do (docs/operations.md, "Idle terminals").
"""

import math
import time

import numpy as np

from pipeline.features.definitions import RING_DAYS
from pipeline.features.state import StateTable

# How often a holder looks for idle terminals: a scan reads every terminal's record (~40 ms for 1M), and
# terminals go idle over days.
EVICT_EVERY_S = 600.0


def idle_terminals(table: StateTable, idle_days: int) -> list[str]:
    """The terminals of `table` whose last event and last fraud report are more than `idle_days` before
    the newest event day in it."""
    if not len(table):
        return []
    keys = list(table.slot_of)
    slots = np.fromiter(table.slot_of.values(), dtype=np.int64, count=len(keys))
    records = table.records
    event_day = records["max_day"][slots].astype(np.int64)  # [N], -1: no event yet
    report_day = records["report_day"][slots].max(axis=1).astype(np.int64)  # [N], -1: no report
    today = int(event_day.max())
    if today < 0:
        return []
    idle = np.flatnonzero(np.maximum(event_day, report_day) < today - idle_days)
    return [keys[i] for i in idle]


class TerminalEviction:
    def __init__(self, idle_days: int, every_s: float = EVICT_EVERY_S):
        """`idle_days`: terminal_idle_days (0: never evict). ValueError unless 0 or above RING_DAYS."""
        if idle_days != 0 and idle_days <= RING_DAYS:
            raise ValueError(
                f"terminal_idle_days = {idle_days}: expected 0 (keep every terminal) or more than {RING_DAYS}, "
                f"the longest terminal window; evicting sooner would change the features of its terminals"
            )
        self.idle_days, self.every_s = idle_days, every_s
        self.checked_at = -math.inf  # time.monotonic() of the last scan
        self.evicted = 0  # since the start

    def evict(self, table: StateTable, now: float | None = None, force: bool = False) -> list[str]:
        """Remove the idle terminals from `table`, at most every `every_s` (of time.monotonic(), or `now`
        when the caller has read it) unless `force`; their ids."""
        now = time.monotonic() if now is None else now
        if self.idle_days == 0 or not (force or now - self.checked_at >= self.every_s):
            return []
        self.checked_at = now
        idle = idle_terminals(table, self.idle_days)
        for terminal in idle:
            table.evict(terminal)
        self.evicted += len(idle)
        return idle
