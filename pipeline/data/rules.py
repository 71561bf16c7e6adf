"""What a canonical transaction may hold: the rules `txsentinel ingest` holds its input's rows to, and every
dataset's transactions are held to again when they are read (`pipeline.data.dataset.read_dataset`), so that
a dataset edited after it was made cannot train, score or test on rows ingest would have refused.

A rule is a polars expression over the canonical columns, True on each row that breaks it. `value_rules`
judge a row by itself; `dataset_rules` add those that judge a row against the rows before it, as a dataset
stores them. `broken_rules` evaluates any of them over a frame in one pass.
"""

from collections.abc import Collection
from dataclasses import dataclass

import polars as pl

from pipeline.data.ids import MAX_ID_CHARS, id_problem
from pipeline.data.schema import (
    AMOUNT_RANGE,
    EARLIEST_TS,
    EVENT_ORDER,
    LATEST_TS,
    MAX_AMOUNT,
    OPTIONAL_COLUMNS,
    TS_RANGE,
)

ID_COLUMNS = ("event_id", "account_id", "terminal_id")
TIMESTAMP_COLUMNS = ("ts", "label_ts")
ID_EXPECTED = f"printable, visible characters, at most {MAX_ID_CHARS}, as the service reads them"


@dataclass(frozen=True)
class Rule:
    column: str  # the canonical column judged, e.g. "amount"
    key: str  # unique within the column, e.g. "negative"
    title: str  # what is wrong, for a person, e.g. "negative amount"
    failed: pl.Expr  # [N] True where a row breaks the rule (null: it does not)
    expected: str  # what a value should be, e.g. "a time in 1970-01-01 .. 2099-12-31 UTC"

    @property
    def flag(self) -> str:
        """The name of the rule's boolean column when several rules are evaluated side by side."""
        return f"__bad_{self.column}_{self.key}"


def value_rules(columns: Collection[str]) -> list[Rule]:
    """The rules judging one row by itself, for the canonical `columns` a frame has."""
    rules = []
    for c in ID_COLUMNS:
        blank = pl.col(c).is_null() | (pl.col(c).str.strip_chars() == "")
        rules.append(Rule(c, "empty", "empty id", blank, "a non-empty id"))
        rules.append(Rule(c, "unfit", "id the service refuses", _unfit(c), ID_EXPECTED))
    # The service reads category, channel and country by the id rule, an empty one aside (ids.py).
    for c in OPTIONAL_COLUMNS:
        if c in columns:
            rules.append(Rule(c, "unfit", "text the service refuses", _unfit(c), ID_EXPECTED))
    for c in TIMESTAMP_COLUMNS:
        if c in columns:
            rules.append(Rule(c, "missing", "missing timestamp", pl.col(c).is_null(), "a timestamp"))
            outside = (pl.col(c) < EARLIEST_TS) | (pl.col(c) >= LATEST_TS)
            rules.append(Rule(c, "out_of_range", "timestamp out of range", outside, f"a time in {TS_RANGE}"))
    amount = pl.col("amount")
    rules += [
        Rule("amount", "missing", "missing amount", amount.is_null(), AMOUNT_RANGE),
        Rule("amount", "not_finite", "amount not finite", ~amount.is_finite(), AMOUNT_RANGE),
        Rule("amount", "negative", "negative amount", amount.is_finite() & (amount < 0), AMOUNT_RANGE),
        Rule(
            "amount",
            "too_large",
            "amount too large",
            amount.is_finite() & (amount > MAX_AMOUNT),
            AMOUNT_RANGE,
        ),
    ]
    if "is_fraud" in columns:
        missing = pl.col("is_fraud").is_null()
        rules.append(Rule("is_fraud", "missing", "missing fraud label", missing, "true or false"))
    if "label_ts" in columns:
        early = pl.col("label_ts") < pl.col("ts")
        rules.append(Rule("label_ts", "before_ts", "label_ts before ts", early, "label_ts >= ts"))
    return rules


def dataset_rules(columns: Collection[str]) -> list[Rule]:
    """value_rules, and what a dataset's rows keep among themselves: unique event ids, in event order."""
    ts, event_id = (pl.col(c) for c in EVENT_ORDER)
    before = (ts < ts.shift(1)) | ((ts == ts.shift(1)) & (event_id < event_id.shift(1)))
    return [
        *value_rules(columns),
        Rule(
            "event_id", "duplicate", "duplicate event_id", ~event_id.is_first_distinct(), "unique event ids"
        ),
        Rule("ts", "order", "not in event order", before, "rows sorted by (ts, event_id)"),
    ]


@dataclass(frozen=True)
class Broken:
    rule: Rule
    rows: int
    first_row: int  # 0-based
    first_event_id: str | None

    def describe(self) -> str:
        """'negative amount (column amount): 2 rows, the first row 6 (event_id 'E7'); expected ...'"""
        rows = f"{self.rows} row{'s' if self.rows != 1 else ''}"
        return (
            f"{self.rule.title} (column {self.rule.column}): {rows}, the first row {self.first_row + 1} "
            f"(event_id {self.first_event_id!r}); expected {self.rule.expected}"
        )


def broken_rules(frame: pl.DataFrame, rules: list[Rule]) -> list[Broken]:
    """Each of `rules` that a row of `frame` breaks, with how many rows and the first; one pass over `frame`."""
    flags = [r.failed.fill_null(False).alias(r.flag) for r in rules]
    counts = [pl.col(r.flag).sum().alias(f"{r.flag}_rows") for r in rules]
    firsts = [pl.col(r.flag).arg_max().alias(f"{r.flag}_first") for r in rules]
    found = frame.lazy().with_columns(flags).select(*counts, *firsts).collect().row(0, named=True)
    broken = []
    for r in rules:
        if found[f"{r.flag}_rows"]:
            first = found[f"{r.flag}_first"]
            broken.append(Broken(r, found[f"{r.flag}_rows"], first, frame["event_id"][first]))
    return broken


def _unfit(column: str) -> pl.Expr:
    return pl.col(column).map_batches(_unfit_ids, return_dtype=pl.Boolean)


def _unfit_ids(ids: pl.Series) -> pl.Series:
    """[N] whether each id breaks pipeline/data/ids.py's rule, which the service's decoder applies."""
    # Ids of printable ASCII within the length limit are fine: polars settles those, Python the rest. One
    # character class and a byte count cost less than an anchored, counted pattern, and mean the same.
    plain = ~ids.str.contains("[^ -~]") & (ids.str.len_bytes() <= MAX_ID_CHARS)
    others = ids.filter(~plain).unique().drop_nulls()
    return ids.is_in([value for value in others.to_list() if id_problem(value)])
