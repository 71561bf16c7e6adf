"""Terminals leave memory, and the table writer deletes them from the terminal table (tombstones), so
neither grows for ever: the idle ones, which changes no feature, and, beyond `max_terminals_in_memory`, those
with the least history, which does.

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

The cap. Idleness bounds a holder by the terminals active within `terminal_idle_days`, not by how many
those are: valid events each naming a new terminal_id would grow every holder by ~1 KB an event until the
process is killed for memory. So a holder that holds more than `max_terminals_in_memory` lets go, on its
next call (a len while under it), of those whose loss changes features least, down to CAP_KEEP of the cap,
so that a flood costs a scan per tenth of the cap in new terminals, not one per batch. This CHANGES
features: a terminal let go loses the counts still in its windows, and the holders apply the rule to what
each holds, when each folds, so for a while a terminal may be gone on one and held on another. Hence never
silently: an error at most every CAP_LOG_EVERY_S, with what to do, and a count
(txsentinel_terminals_capped_total; docs/operations.md, "Too many terminals").

Which go first (_cap_order): the terminals without a fraud report inside the windows (a report counts at a
terminal that has had events: labels alone, for events that never were, protect nothing), then
those with the fewest events inside them, then the least recently active (the newest of their event and
report days), then by terminal id, so that holders holding the same records let the same ones go. A flood
of made-up terminal ids, an event each, then lets its own terminals go before any terminal with two or more
events or a report inside the windows: by recency alone, yesterday's busy terminals and the compromised ones
whose reports the terminal-risk features read would go first, and the flood's, all active today, would
stay. Among terminals of one event each, the flood's and the quiet real ones alike, the oldest go first.
"""

import datetime
import logging
import math
import time

import numpy as np

from pipeline.features.definitions import RING_DAYS
from pipeline.features.state import StateTable

log = logging.getLogger(__name__)

# How often a holder looks for idle terminals: a scan reads every terminal's record (~40 ms for 1M), and
# terminals go idle over days.
EVICT_EVERY_S = 600.0
CAP_KEEP = 0.9  # a holder over the cap lets go down to this share of it
CAP_LOG_EVERY_S = 60.0  # the cap's error, at most this often (the first at once)


def _days(table: StateTable) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The terminals of `table`, [N] the newest day of an event at each (-1: none yet) and [N] the day each
    was last active: the newest of that and its newest fraud-report day (-1: neither)."""
    keys = list(table.slot_of)
    slots = np.fromiter(table.slot_of.values(), dtype=np.int64, count=len(keys))
    records = table.records
    event_day = records["max_day"][slots].astype(np.int64)
    report_day = records["report_day"][slots].max(axis=1).astype(np.int64)
    return keys, event_day, np.maximum(event_day, report_day)


def idle_terminals(table: StateTable, idle_days: int) -> list[str]:
    """The terminals of `table` whose last event and last fraud report are more than `idle_days` before
    the newest event day in it."""
    if not len(table):
        return []
    keys, event_day, active_day = _days(table)
    today = int(event_day.max())
    if today < 0:
        return []
    return [keys[i] for i in np.flatnonzero(active_day < today - idle_days)]


# The fields of a cap order, low to high: the day last active + 1 (0 .. MAX_EPOCH_DAY + 1), the events in the
# windows (capped), whether a report is in them.
_DAY_BITS = 21
_EVENT_BITS = 31
CAP_ORDER_ROWS = 4096  # records a step while ordering: the [rows, RING_DAYS] temporaries stay in cache


def _cap_order(table: StateTable, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """([N] int64, [N] int64, int) for the terminals at `slots` [N]: the order they go in over the cap (the
    lower, the sooner; module docstring), the day each was last active (the newest of its event and report
    days, -1: neither), and the newest event day held, whose RING_DAYS days are the windows. Read in one pass
    over the records up to the highest slot (a gather of RING_DAYS-wide fields by slot costs twice as much)."""
    records = table.records
    today = int(records["max_day"][slots].max())
    first_day, end = today - RING_DAYS + 1, int(slots.max()) + 1
    order, active_day = np.empty(end, dtype=np.int64), np.empty(end, dtype=np.int64)
    for start in range(0, end, CAP_ORDER_ROWS):
        rows = slice(start, min(start + CAP_ORDER_ROWS, end))  # free slots among them: read, never used
        report_day = records["report_day"][rows]  # [rows, RING_DAYS]
        events = np.where(records["day"][rows] >= first_day, records["day_count"][rows], 0).sum(axis=1)
        event_day = records["max_day"][rows]  # -1: no event ever, only labels
        reported = ((report_day >= first_day) & (records["report_count"][rows] > 0)).any(axis=1)
        reported &= event_day >= 0
        active_day[rows] = np.maximum(event_day, report_day.max(axis=1))
        order[rows] = (
            (reported.astype(np.int64) << (_DAY_BITS + _EVENT_BITS))
            + (np.minimum(events, (1 << _EVENT_BITS) - 1).astype(np.int64) << _DAY_BITS)
            + active_day[rows]
            + 1
        )
    return order[slots], active_day[slots], today


def _first_to_go(
    keys: list[str], order: np.ndarray, active_day: np.ndarray, count: int
) -> tuple[list[str], int, int]:
    """The `count` of `keys` lowest in `order` [N] (ties by id, so every holder picks alike); the day the most
    recently active of them was last active (-1: none was); and how many of them had a history (a report,
    or two events or more, inside the windows). 0 < count < N."""
    bound = int(np.partition(order, count - 1)[count - 1])  # the highest order among those that go
    lower = np.flatnonzero(order < bound)
    # A flood ties millions on one order: their ids sorted as they are (~0.3 s a million), no index lists.
    tied = sorted(keys[i] for i in np.flatnonzero(order == bound))[: count - len(lower)]
    day = max(int(active_day[lower].max()) if len(lower) else -1, (bound & ((1 << _DAY_BITS) - 1)) - 1)
    with_history = int(_had_history(order[lower]).sum()) + len(tied) * int(_had_history(np.array([bound]))[0])
    return [keys[i] for i in lower.tolist()] + tied, day, with_history


def _had_history(order: np.ndarray) -> np.ndarray:
    # [N] bool from cap orders [N]: a report, or two events or more, inside the windows
    return (order >> _DAY_BITS) >= 2  # the events field is >= 2, or the report bit above it is set


def _date(day: int) -> str:
    return "never" if day < 0 else (datetime.date(1970, 1, 1) + datetime.timedelta(days=day)).isoformat()


class TerminalEviction:
    def __init__(
        self, idle_days: int, max_terminals: int = 0, holder: str = "scorer", every_s: float = EVICT_EVERY_S
    ):
        """`idle_days`: terminal_idle_days (0: never evict), ValueError unless 0 or above RING_DAYS;
        `max_terminals`: max_terminals_in_memory (0: no cap); `holder`: who holds the table, for the log."""
        if idle_days != 0 and idle_days <= RING_DAYS:
            raise ValueError(
                f"terminal_idle_days = {idle_days}: expected 0 (keep every terminal) or more than {RING_DAYS}, "
                f"the longest terminal window; evicting sooner would change the features of its terminals"
            )
        self.idle_days, self.every_s, self.holder = idle_days, every_s, holder
        self.max_terminals = max_terminals
        self.keep = math.ceil(max_terminals * CAP_KEEP)  # what a holder over the cap keeps
        # A table's records stop doubling here (StateTable.row_limit): room for what one fold or batch
        # brings above the cap before the holder lets go. None: no cap, doubling as it needs.
        self.row_limit = max_terminals + max_terminals // 10 if max_terminals else None
        self.checked_at = -math.inf  # time.monotonic() of the last scan
        self.evicted = 0  # idle, since the start
        self.capped = 0  # over the cap, since the start
        self.logged_at = -math.inf  # time.monotonic() of the cap's last error
        self.unlogged = 0  # let go over the cap since that error
        self.unlogged_with_history = 0  # of them, those with a report or two events or more in the windows
        self.unlogged_day = self.unlogged_newest = -1  # the newest day of activity among them, and held

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

    def cap(self, table: StateTable, now: float | None = None) -> list[str]:
        """Over `max_terminals`, remove the terminals with the least history from `table` down to `keep`
        (module docstring); their ids. Cheap enough for every batch: a len, unless over."""
        gone: list[str] = []
        if self.max_terminals and len(table) > self.max_terminals:
            keys = list(table.slot_of)
            slots = np.fromiter(table.slot_of.values(), dtype=np.int64, count=len(keys))
            order, active_day, newest_held = _cap_order(table, slots)
            gone, day, with_history = _first_to_go(keys, order, active_day, len(keys) - self.keep)
            for terminal in gone:
                table.evict(terminal)
            self.capped += len(gone)
            self.unlogged += len(gone)
            self.unlogged_with_history += with_history
            self.unlogged_day, self.unlogged_newest = max(self.unlogged_day, day), newest_held
        if self.unlogged:
            now = time.monotonic() if now is None else now
            if now - self.logged_at >= CAP_LOG_EVERY_S:
                self._log_capped()
                self.logged_at = now
        return gone

    def _log_capped(self) -> None:
        day, newest = self.unlogged_day, self.unlogged_newest
        log.error(
            "terminals let go over the cap before they were idle holder=%s max_terminals_in_memory=%d "
            "let_go=%d with_history=%d since_start=%d newest_let_go_active=%s days_before_newest_held=%s: their "
            "counts still inside the %d-day windows are lost to the features of their later events. Raise "
            "max_terminals_in_memory (~1 KB a terminal) above the terminals active within terminal_idle_days, "
            "and look for what sends so many new terminal ids (docs/operations.md, \"Too many terminals\")",
            self.holder, self.max_terminals, self.unlogged, self.unlogged_with_history, self.capped, _date(day),
            newest - day if day >= 0 and newest >= 0 else "-", RING_DAYS,
        )  # fmt: skip
        self.unlogged = self.unlogged_with_history = 0
        self.unlogged_day = -1
