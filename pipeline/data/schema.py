"""The canonical transaction schema: the one place that says what a transaction is.

Every dataset directory, every ingest, the generator and the stream's JSON messages use these names and types.
"""

from datetime import UTC, datetime

import polars as pl

SCHEMA_VERSION = 1

REQUIRED_COLUMNS: tuple[str, ...] = ("event_id", "account_id", "ts", "amount", "terminal_id")
OPTIONAL_COLUMNS: tuple[str, ...] = ("category", "channel", "country")
LABEL_COLUMNS: tuple[str, ...] = ("is_fraud", "label_ts")
# Ground truth that only the generator knows: which fraud scenario (or "drift"/"legit") made the event.
TRUTH_COLUMNS: tuple[str, ...] = ("scenario",)

TIMESTAMP = pl.Datetime("us", "UTC")

TRANSACTION_SCHEMA = pl.Schema(
    {
        "event_id": pl.String,
        "account_id": pl.String,
        "ts": TIMESTAMP,
        "amount": pl.Float64,
        "terminal_id": pl.String,
        "category": pl.String,
        "channel": pl.String,
        "country": pl.String,
        "is_fraud": pl.Boolean,
        "label_ts": TIMESTAMP,
        "scenario": pl.String,
    }
)

# Every ts of a dataset lies in [EARLIEST_TS, LATEST_TS), the years 1970..2099. Outside them a time is a typo
# or a unit mix-up (seconds read as milliseconds), and past year 9999 Python's datetime cannot even hold it.
# The service is stricter (2000..2099, consumers/scoring/message_limits.py); history for training may be older.
EARLIEST_TS = datetime(1970, 1, 1, tzinfo=UTC)
LATEST_TS = datetime(2100, 1, 1, tzinfo=UTC)
TS_RANGE = "1970-01-01 .. 2099-12-31 UTC"

# Every amount lies in 0..MAX_AMOUNT, wherever events enter: ingest, a dataset read, the scorer (service and
# backtest) and the MLflow model. The streaming featurizer's state holds any history of such amounts (2**31
# events a day at this amount still sum far from the float maximum, and log1p keeps its precision), and a
# restored record is held to bounds that rest on it (pipeline/features/record_checks.py): an event above it
# would write a state its account's restore refuses. The service's max_amount setting may not exceed it.
MAX_AMOUNT = 1e15
AMOUNT_RANGE = f"a finite amount in 0..{MAX_AMOUNT:g}"


def amount_outside(amount):
    """Where an amount is none an event may hold: not a number, negative, or above MAX_AMOUNT. Of amounts [N]
    (a numpy array) or a polars expression alike: NaN fails both comparisons in numpy, and in polars, where
    NaN sorts above every number, the second."""
    return ~((amount >= 0) & (amount <= MAX_AMOUNT))


# Chargeback windows run to about 540 days; ten years is past any of them, and keeps ts + delay a time that
# polars and Python both hold for every ts a dataset may have. The longest delay a setting may give a label.
MAX_LABEL_DELAY_DAYS = 3650

# Events of one account are ordered by (ts, event_id); the dataset as a whole is stored in that order too.
EVENT_ORDER: tuple[str, ...] = ("ts", "event_id")


def conform(frame: pl.DataFrame | pl.LazyFrame) -> pl.DataFrame | pl.LazyFrame:
    """Select the canonical columns present in `frame`, in canonical order, cast to canonical types.

    Unknown columns are refused rather than dropped, so nothing disappears without the caller knowing.
    """
    names = frame.collect_schema().names()
    unknown = [n for n in names if n not in TRANSACTION_SCHEMA]
    if unknown:
        raise ValueError(f"columns not in the canonical schema: {unknown}; known: {list(TRANSACTION_SCHEMA)}")
    missing = [n for n in REQUIRED_COLUMNS if n not in names]
    if missing:
        raise ValueError(f"required columns missing: {missing}")
    present = [n for n in TRANSACTION_SCHEMA if n in names]
    return frame.select(pl.col(n).cast(TRANSACTION_SCHEMA[n]) for n in present)
