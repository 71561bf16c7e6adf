"""What a restored featurizer record may hold: every bound the folds of stream.py keep, for many records at once.

A record read back from bytes (the service's state changelog, the terminal table) that breaks one of them holds
what no sequence of events and labels folds into it. Restored, it would read as garbage ever after (a sum of
1e300 in every later mean, a count of 2**62 that no new event moves), overflow a few events later, or, with a
day past MAX_EPOCH_DAY, spill into the windows of the other keys of a batch (stream.py's composite keys). Its
key starts again from no history instead.

The bounds, and why every fold keeps them:
- days lie in -1..MAX_EPOCH_DAY (-1: none), last_ts_us in 0..MAX_TS_US, counts are >= 0 and sums finite and
  >= 0 (an amount is >= 0, so is its log1p);
- bucket i of a day ring holds -1 with a count of 0 (and an amount of 0), or a day d with d % RING_DAYS == i
  and a count >= 1: add_to_ring moves a day in only with its events. Every day in an event ring is <= max_day,
  and the bucket of max_day holds it: the newest event was folded on its own day, and no newer day can take
  its bucket. A report ring has no max_day (a label may come on any later day);
- an account's count is 0 exactly when max_day is -1 (and last_ts_us then 0); otherwise max_day is the day of
  last_ts_us, both the newest event's. The count is at least the events its ring holds and at most DAY_EVENTS
  a day over days 0..max_day: an account is served at most DAY_EVENTS events a day, which its int32 day
  bucket holds (more would wrap it negative);
- an amount is at most MAX_AMOUNT, its log1p at most L = log1p(MAX_AMOUNT): a bucket's amount is at most its
  count times MAX_AMOUNT, sum_log_amount at most count times L, and sumsq_log_amount at most L times
  sum_log_amount (0 <= x <= L gives x**2 <= L x). Each bound is widened by what rounding may add to a float64
  sum of that many terms (Higham's gamma_n), never by a guess;
- an event sets one bit of seen_terminals: at most count of them are set;
- a terminal remembers a reported event as (event key != 0, label day >= 0, verdict >= 2 x that day: its
  newest label is no older than its earliest fraud label) or holds an empty place (0, -1, -1), sorted by
  strictly increasing (verdict, event) with the empty places first, and the report ring's bucket of
  the day a counted report (even verdict) counts on holds that day or a newer one (report_memory.py).
"""

import numpy as np

from pipeline.data.schema import MAX_AMOUNT
from pipeline.features.definitions import DAY_US, RING_DAYS
from pipeline.features.state import MAX_EPOCH_DAY, MAX_TS_US

DAY_EVENTS = 2**31 - 1  # the most events of one day an account is served: its day bucket is an int32
_MOST_EVENTS = (MAX_EPOCH_DAY + 1) * DAY_EVENTS
_LOG_AMOUNT = float(np.nextafter(np.log1p(MAX_AMOUNT), np.inf))  # L, and the ulp log1p may round up by
_EPS = float(np.finfo(np.float64).eps)
_BUCKETS = np.arange(RING_DAYS)

# (field, what of records [N] breaks the bound: [N] or [N, field width] bool, the bound in words)
Fault = tuple[str, np.ndarray, str]


def record_faults(records: np.ndarray, last_day: int = MAX_EPOCH_DAY) -> np.ndarray:
    """[N] whether each record [N] (ACCOUNT_STATE or TERMINAL_STATE) breaks a bound that every fold keeps
    (record_fault says which). `last_day`: the last day one may hold, when the reader knows one before
    MAX_EPOCH_DAY (the last a ts may fall on now: a later one is still to come)."""
    bad = np.zeros(len(records), dtype=bool)
    wide: dict[int, np.ndarray] = {}  # faults of fields of one width, joined before one reduction (the cost)
    for _, wrong, _ in _faults(records, last_day):
        if wrong.ndim == 1:
            bad |= wrong
        else:
            width = wrong.shape[1]
            wide[width] = (
                wrong.copy() if width not in wide else np.logical_or(wide[width], wrong, out=wide[width])
            )
    for wrong in wide.values():
        bad |= wrong.any(axis=1)
    return bad


def record_fault(record: np.ndarray, last_day: int = MAX_EPOCH_DAY) -> str | None:
    """What record_faults finds wrong in one record, in words: the first field that breaks a bound, its value
    and the bound; None when nothing."""
    records = record.reshape(1)
    for name, wrong, expected in _faults(records, last_day):
        at = np.flatnonzero(wrong)
        if len(at):
            return f"{name} = {records[name].reshape(-1)[at[0]].item()!r}, expected {expected}"
    return None


def _faults(records: np.ndarray, last_day: int) -> list[Fault]:
    """Every check of records [N]: each field's range first, then how the fields hold together."""
    with np.errstate(all="ignore"):  # a corrupt record's values may overflow on the way to being refused
        days = np.ascontiguousarray(records["day"])  # [N, RING_DAYS]: read by several checks
        faults = [
            (
                name,
                _out_of_range(name, days if name == "day" else records[name], last_day),
                _range(name, records.dtype[name], last_day),
            )
            for name in records.dtype.names
        ]
        faults += _event_ring_faults(records, days)
        if "count" in records.dtype.names:  # an account
            faults += _account_faults(records, days)
        if "report_day" in records.dtype.names:  # a terminal
            faults += _report_faults(records)
    return faults


def _out_of_range(name: str, values: np.ndarray, last_day: int) -> np.ndarray:
    if name == "last_ts_us":
        return (values < 0) | (values > MAX_TS_US)
    if name.endswith("day"):  # max_day and the rings' days: -1 is empty
        return (values < -1) | (values > last_day)
    if name.endswith("verdict"):  # 2 x a label day, + 1 when it says not fraud: -1 is empty
        return (values < -1) | (values > 2 * last_day + 1)
    if values.dtype.kind == "f":  # sums of log-amounts and amounts, all >= 0
        return ~np.isfinite(values) | (values < 0)
    if values.dtype.kind == "i":  # counts
        return values < 0
    return np.zeros(values.shape, dtype=bool)  # bitsets and hashes: any bits


def _range(name: str, dtype: np.dtype, last_day: int) -> str:
    if name == "last_ts_us":
        return f"0..{MAX_TS_US} (microseconds since the epoch)"
    if name.endswith("day"):
        to_come = " (a later one is still to come)" if last_day < MAX_EPOCH_DAY else ""
        return f"an epoch day in 0..{last_day}{to_come}, or -1 for none"
    if name.endswith("verdict"):
        return f"2 x an epoch day in 0..{last_day} (+ 1: not fraud), or -1 for none"
    return "a finite sum >= 0" if dtype.base.kind == "f" else "a count >= 0"


_COUNTED = "0 in an empty bucket (day -1), at least 1 in a bucket holding a day"


def _event_ring_faults(r: np.ndarray, days: np.ndarray) -> list[Fault]:
    max_day = r["max_day"]
    newest = np.take_along_axis(days, (max_day % RING_DAYS).astype(np.intp)[:, None], axis=1)[:, 0]
    return [
        (
            "day",
            _misplaced(days) | (days > max_day[:, None]),
            f"-1 (empty), or a day d <= max_day in bucket d % {RING_DAYS}",
        ),
        (
            "max_day",
            (max_day != -1) & (newest != max_day),
            "-1 (no event), or the day its bucket of the day ring holds",
        ),
        ("day_count", _miscounted(days, r["day_count"]), _COUNTED),
    ]


def _account_faults(r: np.ndarray, days: np.ndarray) -> list[Fault]:
    count, max_day = r["count"], r["max_day"].astype(np.int64)
    gamma = _gamma(count)
    # A day's count is an int32: its rounding is at most _gamma(DAY_EVENTS), whatever the bucket. An empty
    # bucket's count is 0 (day_count's check), so its amount is too.
    day_amounts = r["day_amount"] <= r["day_count"] * (MAX_AMOUNT * (1 + _gamma(np.float64(DAY_EVENTS))))
    in_ring = r["day_count"].sum(axis=1, dtype=np.int64)
    sums, squares = r["sum_log_amount"], r["sumsq_log_amount"]
    return [
        (
            "day_amount",
            ~day_amounts,
            f"at most day_count x {MAX_AMOUNT:g} (the largest amount): 0 in an empty bucket (day -1)",
        ),
        (
            "count",
            (count < in_ring) | (count > (max_day + 1) * DAY_EVENTS) | ((count == 0) != (max_day == -1)),
            f"at least the events its day ring holds, at most {DAY_EVENTS} a day over days 0..max_day, and 0 "
            "exactly when max_day is -1",
        ),
        (
            "last_ts_us",
            np.where(count == 0, r["last_ts_us"] != 0, r["last_ts_us"] // DAY_US != max_day),
            "0 with no events, else a time on day max_day (both the newest event's)",
        ),
        (
            "sum_log_amount",
            ~(sums <= count * _LOG_AMOUNT * (1 + gamma)),
            f"at most count x log1p({MAX_AMOUNT:g}) (the largest log-amount)",
        ),
        (
            # Both sums may round by gamma, the one down, the other up.
            "sumsq_log_amount",
            ~(squares * (1 - gamma) <= _LOG_AMOUNT * sums * (1 + gamma)),
            f"at most log1p({MAX_AMOUNT:g}) x sum_log_amount (each log-amount x <= L has x**2 <= L x)",
        ),
        ("seen_terminals", _seen_faults(r["seen_terminals"], count), "at most count bits set (one an event)"),
    ]


def _report_faults(r: np.ndarray) -> list[Fault]:
    report_days = np.ascontiguousarray(r["report_day"])
    events, remembered, verdicts = r["reported_event"], r["reported_day"], r["reported_verdict"]
    empty = events == 0
    return [
        ("report_day", _misplaced(report_days), f"-1 (empty), or a day d in bucket d % {RING_DAYS}"),
        ("report_count", _miscounted(report_days, r["report_count"]), _COUNTED),
        (
            "reported_event",
            empty != (remembered == -1),
            "0 exactly in an empty place (reported_day -1)",
        ),
        (
            "reported_verdict",
            np.where(empty, verdicts != -1, verdicts < 2 * remembered.astype(np.int64)),
            "-1 in an empty place, else at least 2 x reported_day (the newest label is no older than the "
            "earliest fraud label)",
        ),
        (
            "reported_day",
            _memory_faults(remembered, verdicts, events, report_days),
            "-1 (empty), or a label day, in strictly increasing (verdict, event) order, and at most the day its "
            "bucket of the report ring holds while counted",
        ),
    ]


def _misplaced(days: np.ndarray) -> np.ndarray:
    """[N, RING_DAYS] a day held by another bucket than its own."""
    return (days % RING_DAYS != _BUCKETS) & (days != -1)


def _miscounted(days: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """A count of 0 where a bucket holds a day, or another where it holds none (counts are >= 0 by range)."""
    return (days == -1) == (counts != 0)


def _gamma(terms: np.ndarray) -> np.ndarray:
    """What rounding may add, relative, to a float64 sum of `terms` values (Higham's gamma, two terms more for
    the bound's own products); terms beyond any real count are held to one, whose sums are refused anyway."""
    nu = (np.minimum(terms.astype(np.float64), _MOST_EVENTS) + 2) * (_EPS / 2)
    return nu / (1 - nu)


def _seen_faults(bits: np.ndarray, count: np.ndarray) -> np.ndarray:
    """[N, bytes]: the set bytes of a bitset [N, bytes] with more bits set than its account has events."""
    words = np.ascontiguousarray(bits).view(np.uint64)  # 8 popcounts a record rather than 64
    too_many = np.bitwise_count(words).sum(axis=1, dtype=np.int64) > count
    return (bits != 0) & too_many[:, None]


def _memory_faults(
    days: np.ndarray, verdicts: np.ndarray, events: np.ndarray, ring: np.ndarray
) -> np.ndarray:
    """[N, REMEMBERED_REPORTS]: a remembered report not after the one before it in (verdict, event) order, or a
    counted report (even verdict) on a later day than its bucket of the report ring
    [N, RING_DAYS] holds. Only terminals with a report are looked at: the rest hold (-1, -1, 0) everywhere,
    in order."""
    wrong = np.zeros(days.shape, dtype=bool)
    rows = np.flatnonzero((days != -1).any(axis=1))
    v, e, d = verdicts[rows], events[rows], days[rows]
    wrong[rows, 1:] = (v[:, 1:] < v[:, :-1]) | (
        (v[:, 1:] == v[:, :-1]) & (e[:, 1:] <= e[:, :-1]) & (e[:, 1:] != 0)
    )
    held = np.take_along_axis(ring[rows], (d % RING_DAYS).astype(np.intp), axis=1)
    wrong[rows] |= (d >= 0) & (v % 2 == 0) & (held < d)
    return wrong
