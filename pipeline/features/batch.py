"""Batch form of the features: polars over a whole dataset (see `definitions.py` for what they mean).

Every windowed aggregate uses one trick: sort the events of an entity (account or terminal) by
(entity, event order), build an integer key `entity * 2**20 + day`, and the first event of the window
"days D-d+1 .. D" is `key.search_sorted(key - (d - 1))`. Counts are then index differences and sums are
differences of a running sum — no per-group Python and no materialised windows.
"""

import numpy as np
import polars as pl

from pipeline.features.definitions import (
    DAY_US,
    RAW_FIELDS,
    SECOND_US,
    TERMINAL_BUCKET_COLUMN,
    WINDOW_DAYS,
    derive_features,
    seen_bucket,
    terminal_bucket,
)
from pipeline.schema import EVENT_ORDER

# Room for 2**20 epoch days (year 4840) per entity inside one int64 key. Epoch days of real data are far
# above 30, so "D - 29" never reaches into the previous entity's key range.
_DAY_SPAN = 1 << 20

# Columns carried from the input to the feature frame, when present.
PASSTHROUGH: tuple[str, ...] = (
    "event_id",
    "account_id",
    "terminal_id",
    "ts",
    "is_fraud",
    "label_ts",
    "scenario",
)


def _windowed(frame: pl.DataFrame, entity: str, value: str | None, prefix: str) -> dict[str, pl.Series]:
    """Count (and sum of `value`) over days D-d+1 .. D up to and including each row, for every window.

    `frame` is sorted by (entity, event order) and has `key` = entity * 2**20 + day.
    """
    key = frame["key"]
    position = pl.int_range(key.len(), dtype=pl.Int64, eager=True)
    # Running sums restart per entity, so an entity's sums never depend on rounding of other entities' data.
    running = None if value is None else frame.select(pl.col(value).cum_sum().over(entity))[value]
    out = {}
    for d in WINDOW_DAYS:
        start = key.search_sorted(key - (d - 1), side="left")
        out[f"{prefix}_count_{d}d"] = position - start.cast(pl.Int64) + 1
        if running is not None:
            # Sum from `start` to here: running[i] - (running[start] - value[start]).
            out[f"{prefix}_amount_{d}d"] = running - running.gather(start) + frame[value].gather(start)
    return out


def _account_aggregates(events: pl.DataFrame) -> dict[str, pl.Series]:
    """Account aggregates, in (account, event order); `seq` says where each row belongs."""
    log_amount = pl.col("amount").log1p()
    first_of_account = pl.col("account") != pl.col("account").shift(1, fill_value=-1)
    by_account = events.sort("account", maintain_order=True).with_columns(
        key=pl.col("account") * _DAY_SPAN + pl.col("day")
    )
    columns = by_account.select(
        "seq",
        pl.int_range(pl.len(), dtype=pl.Int64).over("account").alias("prev_count"),
        (log_amount.cum_sum().over("account") - log_amount).alias("prev_sum_log_amount"),
        ((log_amount * log_amount).cum_sum().over("account") - log_amount * log_amount).alias(
            "prev_sumsq_log_amount"
        ),
        pl.when(first_of_account).then(0.0).otherwise(pl.col("ts_us").diff() / SECOND_US).alias("gap_s"),
        # Rows are in event order within an account, so the first occurrence of (account, bucket) is the
        # first time the account used a terminal of that bucket.
        (~(pl.col("account") * 1024 + pl.col("seen_bucket")).is_first_distinct())
        .cast(pl.Int64)
        .alias("terminal_seen"),
    )
    return {**columns.to_dict(), **_windowed(by_account, "account", "amount", "account")}


def _terminal_counts(events: pl.DataFrame) -> dict[str, pl.Series]:
    by_terminal = events.sort("terminal", maintain_order=True).with_columns(
        key=pl.col("terminal") * _DAY_SPAN + pl.col("day")
    )
    return {"seq": by_terminal["seq"], **_windowed(by_terminal, "terminal", None, "terminal")}


def _terminal_reports(events: pl.DataFrame) -> dict[str, pl.Series]:
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
    out = {"seq": by_time["seq"]}
    for d in WINDOW_DAYS:
        window_start = by_time.with_columns(((pl.col("day") - (d - 1)) * DAY_US).alias("start_us"))
        before_window = window_start.join_asof(
            reports, left_on="start_us", allow_exact_matches=False, **asof
        )["reports_so_far"].fill_null(0)
        out[f"terminal_reports_{d}d"] = upto_now - before_window
    return out


def _events(frame: pl.DataFrame) -> pl.DataFrame:
    """Integer view of the events: seq (event order), entity codes, buckets, times in µs and epoch days."""
    # One code per terminal for the whole computation (categorical codes are not comparable across frames),
    # and the hashes computed once per distinct terminal rather than once per event.
    terminals = frame["terminal_id"].unique(maintain_order=True)
    terminal_codes = pl.DataFrame(
        {
            "terminal_id": terminals,
            "terminal": pl.int_range(terminals.len(), dtype=pl.Int64, eager=True),
            "seen_bucket": seen_bucket(terminals),
            TERMINAL_BUCKET_COLUMN: terminal_bucket(terminals),
        }
    )
    labelled = "is_fraud" in frame.columns and "label_ts" in frame.columns
    return (
        frame.lazy()
        .with_row_index("seq")
        .join(terminal_codes.lazy(), on="terminal_id", how="left", maintain_order="left")
        .select(
            "seq",
            "amount",
            "terminal",
            "seen_bucket",
            TERMINAL_BUCKET_COLUMN,
            pl.col("account_id").cast(pl.Categorical).to_physical().cast(pl.Int64).alias("account"),
            pl.col("ts").dt.epoch("us").alias("ts_us"),
            (pl.col("ts").dt.epoch("us") // DAY_US).alias("day"),
            (pl.col("is_fraud") if labelled else pl.lit(False)).alias("is_fraud"),
            (pl.col("label_ts").dt.epoch("us") if labelled else pl.lit(None, pl.Int64)).alias("label_us"),
        )
        .collect()
    )


def _raw_from_events(events: pl.DataFrame) -> dict[str, np.ndarray]:
    raw: dict[str, np.ndarray] = {
        "amount": events["amount"].to_numpy(),
        "ts_us": events["ts_us"].to_numpy(),
    }
    for block in (_account_aggregates(events), _terminal_counts(events), _terminal_reports(events)):
        seq = block.pop("seq")
        in_event_order = seq.is_sorted()
        seq = seq.to_numpy()
        for name, column in block.items():
            if in_event_order:
                raw[name] = column.to_numpy()
                continue
            values = np.empty(len(seq), dtype=column.to_numpy().dtype)
            values[seq] = column.to_numpy()  # back to event order
            raw[name] = values
    return {name: raw[name] for name in RAW_FIELDS}


def raw_aggregates(frame: pl.DataFrame) -> dict[str, np.ndarray]:
    """Raw aggregates (definitions.RAW_FIELDS) for each row of `frame`, which must be in (ts, event_id) order."""
    return _raw_from_events(_events(frame))


def compute_features(frame: pl.DataFrame) -> pl.DataFrame:
    """Features of every event: passthrough columns, FEATURE_NAMES (float64) and the terminal bucket.

    `frame` holds canonical columns; rows come back in (ts, event_id) order.
    """
    frame = frame.sort(EVENT_ORDER)
    events = _events(frame)
    features = derive_features(_raw_from_events(events))
    return frame.select([c for c in PASSTHROUGH if c in frame.columns]).with_columns(
        *(pl.Series(name, values) for name, values in features.items()),
        events[TERMINAL_BUCKET_COLUMN],
    )
