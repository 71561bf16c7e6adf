"""Reference form of the batch aggregates: polars and numpy passes, the specification of kernels.py.

Every windowed aggregate uses one trick: lay the events of each entity (account or terminal) out in
(entity, event order) — a counting sort from per-entity ranks, no comparison sort — build an integer key
`entity * 2**20 + day`, and the first event of the window "days D-d+1 .. D" is
`searchsorted(key, key - (d - 1))`. Counts are then index differences and sums are differences of a
per-entity running sum; everything comes back in event order without a scatter. Polars does the
relational work (codes, per-entity ranks and running sums, as-of joins for label times).

batch.py computes the same numbers with one compiled pass per block (kernels.py); the tests hold the two
equal bit for bit. `raw_aggregates_reference` runs this form end to end.
"""

import numpy as np
import polars as pl

from pipeline.features.batch import _events
from pipeline.features.definitions import DAY_US, RAW_FIELDS, SECOND_US, WINDOW_DAYS

# Room for 2**20 epoch days (year 4840) per entity inside one int64 key. Epoch days of real data are far
# above 30, so "D - 29" never reaches into the previous entity's key range.
_DAY_SPAN = 1 << 20


def _windowed(
    codes: np.ndarray, rank: np.ndarray, days: np.ndarray, prefix: str, values=None, running=None
) -> dict[str, np.ndarray]:
    """Count (and sum of `values`) over days D-d+1 .. D up to and including each event, for every window.

    All inputs and outputs are [N] in event order: `codes` the entity of each event (0..E-1), `rank` its
    position among its entity's events, `running` the per-entity running sum of `values`. Laying the events
    out by (entity, event order) needs no sort: an entity's events start where the counts of the entities
    before it end, so each event's place is that start plus its rank.
    """
    starts = np.zeros(int(codes.max()) + 1 if len(codes) else 0, dtype=np.int64)
    np.cumsum(np.bincount(codes)[:-1], out=starts[1:])
    place = starts[codes] + rank  # [N] position in the (entity, event order) layout
    key = np.empty_like(place)
    key[place] = codes * _DAY_SPAN + days  # non-decreasing in that layout
    if values is not None:
        laid_running, laid_values = np.empty(len(place)), np.empty(len(place))
        laid_running[place], laid_values[place] = running, values
    out = {}
    for d in WINDOW_DAYS:
        start = np.searchsorted(key, key - (d - 1), side="left")  # first event of the window, same layout
        out[f"{prefix}_count_{d}d"] = rank - (start[place] - starts[codes]) + 1
        if values is not None:
            # Sum from `start` to here: running[here] - (running[start] - value[start]).
            first = start[place]
            out[f"{prefix}_amount_{d}d"] = running - laid_running[first] + laid_values[first]
    return out


def _account_aggregates(events: pl.DataFrame) -> dict[str, np.ndarray]:
    """Account aggregates in event order."""
    log_amount = pl.col("amount").log1p()
    # Per-account running sums (over() keeps event order): an account's sums never depend on the rounding
    # of other accounts' data, so removing later events changes nothing earlier, bit for bit.
    columns = events.select(
        pl.int_range(pl.len(), dtype=pl.Int64).over("account").alias("prev_count"),
        (log_amount.cum_sum().over("account") - log_amount).alias("prev_sum_log_amount"),
        ((log_amount * log_amount).cum_sum().over("account") - log_amount * log_amount).alias(
            "prev_sumsq_log_amount"
        ),
        (pl.col("ts_us").diff().over("account").fill_null(0) / SECOND_US).alias("gap_s"),
        # Events are in event order, so the first occurrence of (account, bucket) is the first time the
        # account used a terminal of that bucket.
        (~(pl.col("account") * 1024 + pl.col("seen_bucket")).is_first_distinct())
        .cast(pl.Int64)
        .alias("terminal_seen"),
        pl.col("amount").cum_sum().over("account").alias("running_amount"),
    )
    out = {name: columns[name].to_numpy() for name in columns.columns if name != "running_amount"}
    out.update(
        _windowed(
            events["account"].to_numpy(),
            out["prev_count"],
            events["day"].to_numpy(),
            "account",
            values=events["amount"].to_numpy(),
            running=columns["running_amount"].to_numpy(),
        )
    )
    return out


def _terminal_counts(events: pl.DataFrame) -> dict[str, np.ndarray]:
    rank = events.select(pl.int_range(pl.len(), dtype=pl.Int64).over("terminal"))["literal"].to_numpy()
    return _windowed(events["terminal"].to_numpy(), rank, events["day"].to_numpy(), "terminal")


def _terminal_reports(events: pl.DataFrame) -> dict[str, np.ndarray]:
    """Fraud labels of the terminal with label_ts on days D-d+1 .. D and label_ts <= the event's ts."""
    reports = (
        events.lazy()
        .filter(pl.col("is_fraud") & pl.col("label_us").is_not_null())
        .select("terminal", "label_us")
        .sort("label_us")
        .with_columns(pl.int_range(1, pl.len() + 1, dtype=pl.Int64).over("terminal").alias("reports_so_far"))
        .collect()
    )
    # Events are in (ts, event_id) order, so ts_us and every window start are sorted, as join_asof needs
    # (it cannot check sortedness itself when `by` groups are given).
    by_time = events.select("seq", "terminal", "ts_us", "day")
    asof = {"right_on": "label_us", "by": "terminal", "strategy": "backward", "check_sortedness": False}
    upto_now = by_time.join_asof(reports, left_on="ts_us", **asof)["reports_so_far"].fill_null(0)
    out = {}
    for d in WINDOW_DAYS:
        window_start = by_time.with_columns(((pl.col("day") - (d - 1)) * DAY_US).alias("start_us"))
        before_window = window_start.join_asof(
            reports, left_on="start_us", allow_exact_matches=False, **asof
        )["reports_so_far"].fill_null(0)
        out[f"terminal_reports_{d}d"] = (upto_now - before_window).to_numpy()
    return out


def raw_aggregates_reference(frame: pl.DataFrame) -> dict[str, np.ndarray]:
    """batch.raw_aggregates computed by this form: `frame` in (ts, event_id) order."""
    events = _events(frame)
    raw: dict[str, np.ndarray] = {"amount": events["amount"].to_numpy(), "ts_us": events["ts_us"].to_numpy()}
    raw.update(_account_aggregates(events))
    raw.update(_terminal_counts(events))
    raw.update(_terminal_reports(events))
    return {name: raw[name] for name in RAW_FIELDS}
