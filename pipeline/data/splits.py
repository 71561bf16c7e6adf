"""Time-ordered splits and the evaluation protocol's bookkeeping (Fraud Detection Handbook, Le Borgne et al.).

train period -> delay period (labels not yet known) -> test period. A model is trained at the start of the
test period, so it may only learn from labels known by then (`label_ts < test.start`); and on each test day,
accounts with a fraud already known before that day are left out of the ranking.
"""

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

import polars as pl

DAY = timedelta(days=1)


def _midnight(day: date | datetime) -> datetime:
    if isinstance(day, datetime):
        day = day.astimezone(UTC).date() if day.tzinfo else day.date()
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


@dataclass(frozen=True)
class Period:
    """Whole UTC days, start inclusive, end exclusive."""

    start: datetime
    end: datetime

    def __post_init__(self):
        if self.end <= self.start:
            raise ValueError(f"period ends ({self.end.date()}) before it starts ({self.start.date()})")

    @classmethod
    def parse(cls, text: str) -> "Period":
        """'2026-03-01:2026-03-15' -> [Mar 1, Mar 15) — the end date itself is not included."""
        try:
            first, last = text.split(":")
            return cls(_midnight(date.fromisoformat(first)), _midnight(date.fromisoformat(last)))
        except ValueError as error:
            raise ValueError(
                f"period {text!r}: expected START:END as ISO dates, e.g. 2026-03-01:2026-03-15 ({error})"
            ) from None

    @property
    def days(self) -> int:
        return (self.end - self.start) // DAY

    def day_starts(self) -> list[datetime]:
        return [self.start + i * DAY for i in range(self.days)]

    def contains(self, column: str = "ts") -> pl.Expr:
        return (pl.col(column) >= self.start) & (pl.col(column) < self.end)

    def shifted(self, by: timedelta) -> "Period":
        return Period(self.start + by, self.end + by)

    def __str__(self) -> str:
        return f"{self.start.date()}:{self.end.date()}"


@dataclass(frozen=True)
class Split:
    train: Period
    delay: Period | None
    test: Period

    def __post_init__(self):
        delay_end = self.delay.end if self.delay else self.train.end
        if self.delay and self.delay.start != self.train.end:
            raise ValueError(
                f"delay period {self.delay} must start where training ends ({self.train.end.date()})"
            )
        if self.test.start != delay_end:
            raise ValueError(
                f"test period {self.test} must start where the delay period ends ({delay_end.date()})"
            )

    @classmethod
    def from_periods(cls, train: Period, test: Period) -> "Split":
        """The gap between train and test (if any) is the delay period."""
        if test.start < train.end:
            raise ValueError(f"test period {test} overlaps the training period {train}")
        delay = Period(train.end, test.start) if test.start > train.end else None
        return cls(train, delay, test)

    @property
    def label_cutoff(self) -> datetime:
        """Labels known when the model is trained and deployed: label_ts < test.start."""
        return self.test.start


def prequential_test_periods(last: Period, folds: int, data_days: Period) -> list[Period]:
    """The test periods of `folds` prequential folds, the most recent (`last`) first, fold k shifted back by
    k test lengths; all of them inside `data_days`, the days of the dataset."""
    if folds < 1:
        raise ValueError(f"folds must be >= 1, got {folds}")
    length = last.end - last.start
    fitting = (last.end - data_days.start) // length  # checked before the periods are made: folds may be 1e20
    if folds > fitting or last.end > data_days.end:
        room = (
            "the test period ends after the data"
            if last.end > data_days.end
            else f"it has room for {max(fitting, 0)} fold(s) ending then"
        )
        raise ValueError(
            f"{folds} fold(s) of {last.days} test days ending {last.end.date()} do not fit the dataset, which "
            f"spans {data_days}: {room}. Use fewer --folds, a shorter or later test period."
        )
    return [last.shifted(-k * length) for k in range(folds)]


def known_target(cutoff: datetime) -> pl.Expr:
    """Training target: fraud whose label was known before `cutoff`; unknown labels count as legit."""
    return (pl.col("is_fraud") & (pl.col("label_ts") < cutoff)).fill_null(False)


def ranking_exclusions(frame: pl.DataFrame, test: Period) -> pl.DataFrame:
    """(day, account_id) pairs to leave out of each test day's ranking: a fraud of the account was known
    (label_ts) before that day started."""
    first_known = (
        frame.filter(pl.col("is_fraud") & pl.col("label_ts").is_not_null())
        .group_by("account_id")
        .agg(pl.col("label_ts").min().alias("first_known"))
    )
    days = pl.DataFrame({"day": test.day_starts()}, schema={"day": pl.Datetime("us", "UTC")})
    return (
        days.join(first_known, how="cross")
        .filter(pl.col("first_known") < pl.col("day"))
        .select("day", "account_id")
        .sort("day", "account_id")
    )


def dataset_days(frame: pl.DataFrame | pl.LazyFrame) -> Period:
    """The whole UTC days a dataset spans."""
    bounds = (
        frame.lazy().select(pl.col("ts").min().alias("first"), pl.col("ts").max().alias("last")).collect()
    )
    first, last = bounds["first"][0], bounds["last"][0]
    if first is None:
        raise ValueError("the dataset has no events")
    return Period(_midnight(first), _midnight(last) + DAY)
