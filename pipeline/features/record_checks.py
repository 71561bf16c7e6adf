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
- a terminal remembers a reported event as (event key != 0, label day >= 0) or holds an empty place (0, -1),
  sorted by (day, event), and the report ring's bucket of a remembered day holds that day or a newer one
  (stream.py's _report_once).
"""

import functools
from collections.abc import Callable

import numpy as np

from pipeline.features.definitions import DAY_US, RING_DAYS
from pipeline.features.state import MAX_AMOUNT, MAX_EPOCH_DAY, MAX_TS_US

DAY_EVENTS = 2**31 - 1  # the most events of one day an account is served: its day bucket is an int32
_MOST_EVENTS = (MAX_EPOCH_DAY + 1) * DAY_EVENTS
_LOG_AMOUNT = float(np.nextafter(np.log1p(MAX_AMOUNT), np.inf))  # L, and the ulp log1p may round up by
_EPS = float(np.finfo(np.float64).eps)

# (field, what of records [N] breaks the bound: [N] or [N, field width] bool, the bound in words)
Check = tuple[str, Callable[[np.ndarray], np.ndarray], str]


def record_faults(records: np.ndarray) -> np.ndarray:
    """[N] whether each record [N] (ACCOUNT_STATE or TERMINAL_STATE) breaks a bound that every fold keeps
    (record_fault says which)."""
    bad = np.zeros(len(records), dtype=bool)
    with np.errstate(all="ignore"):  # a corrupt record's values may overflow on the way to being refused
        for _, wrong, _ in _checks(records.dtype):
            faults = wrong(records)  # [N] or [N, width]; N may be 0
            bad |= faults.any(axis=tuple(range(1, faults.ndim)))
    return bad


def record_fault(record: np.ndarray) -> str | None:
    """What record_faults finds wrong in one record, in words: the first field that breaks a bound, its value
    and the bound; None when nothing."""
    records = record.reshape(1)
    with np.errstate(all="ignore"):
        for name, wrong, expected in _checks(record.dtype):
            at = np.flatnonzero(wrong(records))
            if len(at):
                return f"{name} = {records[name].reshape(-1)[at[0]].item()!r}, expected {expected}"
    return None


@functools.cache
def _checks(dtype: np.dtype) -> list[Check]:
    """Every check of a record of `dtype`: each field's range first, then how the fields hold together."""
    checks = [
        (name, functools.partial(_out_of_range, name), _range(name, dtype[name])) for name in dtype.names
    ]
    checks += _event_ring_checks()
    if "count" in dtype.names:  # an account
        checks += _account_checks()
    if "report_day" in dtype.names:  # a terminal
        checks += _report_checks()
    return checks


def _out_of_range(name: str, records: np.ndarray) -> np.ndarray:
    values = records[name]
    if name == "last_ts_us":
        return (values < 0) | (values > MAX_TS_US)
    if name.endswith("day"):  # max_day and the rings' days: -1 is empty
        return (values < -1) | (values > MAX_EPOCH_DAY)
    if values.dtype.kind == "f":  # sums of log-amounts and amounts, all >= 0
        return ~np.isfinite(values) | (values < 0)
    if values.dtype.kind == "i":  # counts
        return values < 0
    return np.zeros(values.shape, dtype=bool)  # bitsets and hashes: any bits


def _range(name: str, dtype: np.dtype) -> str:
    if name == "last_ts_us":
        return f"0..{MAX_TS_US} (microseconds since the epoch)"
    if name.endswith("day"):
        return f"an epoch day in 0..{MAX_EPOCH_DAY}, or -1 for none"
    return "a finite sum >= 0" if dtype.kind == "f" else "a count >= 0"


def _event_ring_checks() -> list[Check]:
    return [
        (
            "day",
            lambda r: _misplaced(r["day"]) | (r["day"] > r["max_day"][:, None]),
            f"-1 (empty), or a day d <= max_day in bucket d % {RING_DAYS}",
        ),
        ("max_day", _newest_not_held, "-1 (no event), or the day its bucket of the day ring holds"),
        ("day_count", lambda r: _miscounted(r["day"], r["day_count"]), _COUNTED),
    ]


def _account_checks() -> list[Check]:
    return [
        (
            "day_amount",
            lambda r: np.where(
                r["day"] == -1,
                r["day_amount"] != 0,
                ~(r["day_amount"] <= _summed(MAX_AMOUNT, r["day_count"])),
            ),
            f"0 in an empty bucket (day -1), else at most day_count x {MAX_AMOUNT:g} (the largest amount)",
        ),
        (
            "count",
            _count_faults,
            f"at least the events its day ring holds, at most {DAY_EVENTS} a day over days 0..max_day, and 0 "
            "exactly when max_day is -1",
        ),
        (
            "last_ts_us",
            lambda r: np.where(
                r["count"] == 0, r["last_ts_us"] != 0, r["last_ts_us"] // DAY_US != r["max_day"]
            ),
            "0 with no events, else a time on day max_day (both the newest event's)",
        ),
        (
            "sum_log_amount",
            lambda r: ~(r["sum_log_amount"] <= _summed(_LOG_AMOUNT, r["count"])),
            f"at most count x log1p({MAX_AMOUNT:g}) (the largest log-amount)",
        ),
        (
            "sumsq_log_amount",
            _squares_faults,
            f"at most log1p({MAX_AMOUNT:g}) x sum_log_amount (each log-amount x <= L has x**2 <= L x)",
        ),
        ("seen_terminals", _seen_faults, "at most count bits set (one an event)"),
    ]


def _report_checks() -> list[Check]:
    return [
        (
            "report_day",
            lambda r: _misplaced(r["report_day"]),
            f"-1 (empty), or a day d in bucket d % {RING_DAYS}",
        ),
        ("report_count", lambda r: _miscounted(r["report_day"], r["report_count"]), _COUNTED),
        (
            "reported_event",
            lambda r: (r["reported_event"] == 0) != (r["reported_day"] == -1),
            "0 exactly in an empty place (reported_day -1)",
        ),
        (
            "reported_day",
            _memory_faults,
            "-1 (empty), or a label day, in (day, event) order, and at most the day its bucket of the report "
            "ring holds",
        ),
    ]


_COUNTED = "0 in an empty bucket (day -1), at least 1 in a bucket holding a day"


def _misplaced(days: np.ndarray) -> np.ndarray:
    """[N, RING_DAYS] a day held by another bucket than its own."""
    return (days != -1) & (days % RING_DAYS != np.arange(RING_DAYS))


def _miscounted(days: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return np.where(days == -1, counts != 0, counts < 1)


def _held(ring: np.ndarray, days: np.ndarray) -> np.ndarray:
    """The day ring [N, RING_DAYS] holds in the bucket of each of days [N, K]."""
    return np.take_along_axis(ring, (days % RING_DAYS).astype(np.intp), axis=1)


def _newest_not_held(r: np.ndarray) -> np.ndarray:
    max_day = r["max_day"][:, None]
    return ((max_day != -1) & (_held(r["day"], max_day) != max_day))[:, 0]


def _gamma(terms: np.ndarray) -> np.ndarray:
    """What rounding may add, relative, to a float64 sum of `terms` values (Higham's gamma, two terms more for
    the bound's own products); terms beyond any real count are held to one, whose sums are refused anyway."""
    nu = (np.minimum(terms.astype(np.float64), _MOST_EVENTS) + 2) * (_EPS / 2)
    return nu / (1 - nu)


def _summed(each: float, terms: np.ndarray) -> np.ndarray:
    """The most a float64 sum of `terms` values, each at most `each`, comes to."""
    return terms * each * (1 + _gamma(terms))


def _count_faults(r: np.ndarray) -> np.ndarray:
    count, max_day = r["count"], r["max_day"].astype(np.int64)
    in_ring = r["day_count"].sum(axis=1, dtype=np.int64)
    return (count < in_ring) | (count > (max_day + 1) * DAY_EVENTS) | ((count == 0) != (max_day == -1))


def _squares_faults(r: np.ndarray) -> np.ndarray:
    # Both sums may round by gamma, the one down, the other up.
    gamma = _gamma(r["count"])
    return ~(r["sumsq_log_amount"] * (1 - gamma) <= _LOG_AMOUNT * r["sum_log_amount"] * (1 + gamma))


def _seen_faults(r: np.ndarray) -> np.ndarray:
    """[N, bytes]: the set bytes of a bitset with more bits set than its account has events."""
    bits = r["seen_terminals"]
    too_many = np.bitwise_count(bits).sum(axis=1, dtype=np.int64) > r["count"]
    return (bits != 0) & too_many[:, None]


def _memory_faults(r: np.ndarray) -> np.ndarray:
    """[N, REMEMBERED_REPORTS]: a remembered report out of (day, event) order, or on a later day than its
    bucket of the report ring holds."""
    days, events = r["reported_day"], r["reported_event"]
    wrong = np.zeros(days.shape, dtype=bool)
    wrong[:, 1:] = (days[:, 1:] < days[:, :-1]) | (
        (days[:, 1:] == days[:, :-1]) & (events[:, 1:] < events[:, :-1])
    )
    return wrong | ((days >= 0) & (_held(r["report_day"], days) < days))
