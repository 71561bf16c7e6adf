"""Batch form of the features over a whole dataset (see `definitions.py` for what they mean).

Polars does the relational work (event order, entity codes, terminal hashes, the fraud reports), and one
compiled pass per block computes the aggregates (kernels.py): per-entity running sums and day windows
with pointers that only move forward. batch_reference.py computes the same numbers with polars and numpy
passes, readable and slower; the tests hold the two equal bit for bit.
"""

import numpy as np
import polars as pl

from pipeline.data.schema import EVENT_ORDER
from pipeline.features import kernels
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

_WINDOWS = np.asarray(WINDOW_DAYS, dtype=np.int64)

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


def _entity_count(codes: np.ndarray) -> int:
    """How many entities codes 0.. can name (the kernels' per-entity arrays)."""
    return int(codes.max()) + 1 if len(codes) else 0


def _account_aggregates(events: pl.DataFrame) -> dict[str, np.ndarray]:
    """Account aggregates in event order (batch_reference._account_aggregates, one compiled pass)."""
    codes = events["account"].to_numpy()
    columns = events.select(
        pl.col("amount").log1p().alias("log_amount"),  # polars' log1p, as the reference's
        # Events are in event order, so the first occurrence of (account, bucket) is the first time the
        # account used a terminal of that bucket.
        (~(pl.col("account") * 1024 + pl.col("seen_bucket")).is_first_distinct())
        .cast(pl.Int64)
        .alias("terminal_seen"),
    )
    n_accounts = _entity_count(codes)
    prev_sum, prev_sumsq, gap_s = kernels.account_history(
        codes, n_accounts, events["ts_us"].to_numpy(), columns["log_amount"].to_numpy(), 1.0 / SECOND_US
    )
    rank, counts, sums = kernels.entity_windows(
        codes, n_accounts, events["day"].to_numpy(), _WINDOWS, events["amount"].to_numpy()
    )
    out = {
        "prev_count": rank,
        "prev_sum_log_amount": prev_sum,
        "prev_sumsq_log_amount": prev_sumsq,
        "gap_s": gap_s,
        "terminal_seen": columns["terminal_seen"].to_numpy(),
    }
    for w, d in enumerate(WINDOW_DAYS):
        out[f"account_count_{d}d"] = counts[w]
        out[f"account_amount_{d}d"] = sums[w]
    return out


def _terminal_aggregates(events: pl.DataFrame) -> dict[str, np.ndarray]:
    """Terminal counts and fraud reports in event order (batch_reference's, one compiled pass each)."""
    codes = events["terminal"].to_numpy()
    days = events["day"].to_numpy()
    n_terminals = _entity_count(codes)
    _, counts, _ = kernels.entity_windows(codes, n_terminals, days, _WINDOWS, np.empty(0))
    reports = (
        events.lazy()
        .filter(pl.col("is_fraud") & pl.col("label_us").is_not_null())
        .select("terminal", "label_us")
        .sort("label_us")
        .collect()
    )
    known = kernels.terminal_reports(
        codes, n_terminals, events["ts_us"].to_numpy(), days,
        reports["terminal"].to_numpy(), reports["label_us"].to_numpy(), _WINDOWS, DAY_US,
    )  # fmt: skip
    out = {}
    for w, d in enumerate(WINDOW_DAYS):
        out[f"terminal_count_{d}d"] = counts[w]
        out[f"terminal_reports_{d}d"] = known[w]
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
    raw.update(_account_aggregates(events))
    raw.update(_terminal_aggregates(events))
    return {name: raw[name] for name in RAW_FIELDS}


def raw_aggregates(frame: pl.DataFrame) -> dict[str, np.ndarray]:
    """Raw aggregates (definitions.RAW_FIELDS) for each row of `frame`, which must be in (ts, event_id) order."""
    return _raw_from_events(_events(frame))


def _in_event_order(frame: pl.DataFrame) -> bool:
    """Whether every row comes strictly after the one before in EVENT_ORDER: one comparison pass, a
    fraction of a sort's cost, for the usual input (datasets are written in that order). Nulls say no."""
    later, tied = pl.lit(False), pl.lit(True)
    for name in EVENT_ORDER:
        column, previous = pl.col(name), pl.col(name).shift()
        later = later | (tied & (column > previous))
        tied = tied & (column == previous)
    return bool(frame.select(later.slice(1).all(ignore_nulls=False)).item())


def compute_features(frame: pl.DataFrame) -> pl.DataFrame:
    """Features of every event: passthrough columns, FEATURE_NAMES (float64) and the terminal bucket.

    `frame` holds canonical columns; rows come back in (ts, event_id) order.
    """
    if not _in_event_order(frame):
        frame = frame.sort(EVENT_ORDER)
    events = _events(frame)
    features = derive_features(_raw_from_events(events))
    return frame.select([c for c in PASSTHROUGH if c in frame.columns]).with_columns(
        *(pl.Series(name, values) for name, values in features.items()),
        events[TERMINAL_BUCKET_COLUMN],
    )
