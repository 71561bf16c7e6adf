"""Time splits, the evaluation protocol's exclusions, the feature spec and account sequences."""

from datetime import UTC, date, datetime, timedelta

import numpy as np
import polars as pl
import pytest

from pipeline.data.generate import GenerateConfig, generate
from pipeline.data.splits import (
    DAY,
    Period,
    Split,
    dataset_days,
    known_target,
    prequential_test_periods,
    ranking_exclusions,
)
from pipeline.features import compute_features, fit_feature_spec
from pipeline.features.definitions import FEATURE_NAMES
from pipeline.features.spec import FeatureSpec
from pipeline.training.sequences import build_sequences


def utc(*args) -> datetime:
    return datetime(*args, tzinfo=UTC)


def split_ending_at(end: date, train_days: int, delay_days: int, test_days: int) -> Split:
    """The split whose test period ends at the start of `end` (UTC), the delay and training before it."""
    test_end = utc(end.year, end.month, end.day)
    test = Period(test_end - test_days * DAY, test_end)
    train_end = test.start - delay_days * DAY
    return Split.from_periods(Period(train_end - train_days * DAY, train_end), test)


@pytest.fixture(scope="module")
def dataset() -> pl.DataFrame:
    return generate(GenerateConfig(accounts=300, days=60, seed=5))


def test_period_parse_is_half_open_and_errors_name_the_input():
    period = Period.parse("2026-03-01:2026-03-15")
    assert (period.start, period.end, period.days) == (utc(2026, 3, 1), utc(2026, 3, 15), 14)
    with pytest.raises(ValueError, match=r"'2026-03-01': expected START:END"):
        Period.parse("2026-03-01")
    with pytest.raises(ValueError, match="before it starts"):
        Period.parse("2026-03-15:2026-03-01")


def test_a_split_lays_train_delay_test_end_to_end():
    split = split_ending_at(date(2026, 5, 1), train_days=28, delay_days=7, test_days=7)
    assert split.test == Period(utc(2026, 4, 24), utc(2026, 5, 1))
    assert split.delay == Period(utc(2026, 4, 17), utc(2026, 4, 24))
    assert split.train == Period(utc(2026, 3, 20), utc(2026, 4, 17))
    assert split.label_cutoff == utc(2026, 4, 24)
    with pytest.raises(ValueError, match="overlaps"):
        Split.from_periods(Period.parse("2026-01-01:2026-02-01"), Period.parse("2026-01-20:2026-02-10"))


def test_prequential_folds_shift_back_by_the_test_length():
    last = Period.parse("2026-04-24:2026-05-01")
    folds = prequential_test_periods(last, 4, data_days=Period.parse("2026-01-01:2026-05-01"))
    assert [f.start for f in folds] == [utc(2026, 4, 24) - k * 7 * DAY for k in range(4)]
    assert all(f.days == 7 for f in folds)
    with pytest.raises(ValueError, match="folds must be >= 1"):
        prequential_test_periods(last, 0, data_days=Period.parse("2026-01-01:2026-05-01"))


def test_training_targets_only_hold_labels_known_before_the_cutoff(dataset):
    cutoff = dataset["ts"].min() + timedelta(days=30)
    targets = dataset.with_columns(known_target(cutoff).alias("target"))
    late = targets.filter(pl.col("is_fraud") & (pl.col("label_ts") >= cutoff))
    early = targets.filter(pl.col("is_fraud") & (pl.col("label_ts") < cutoff))
    assert late.height > 0 and early.height > 0
    assert not late["target"].any()
    assert early["target"].all()
    # Flipping any label known only after the cutoff changes no target.
    flipped = dataset.with_columns(
        pl.when(pl.col("label_ts") >= cutoff)
        .then(~pl.col("is_fraud"))
        .otherwise(pl.col("is_fraud"))
        .alias("is_fraud")
    ).with_columns(known_target(cutoff).alias("target"))
    assert flipped["target"].to_list() == targets["target"].to_list()


def test_accounts_with_known_fraud_leave_the_ranking_from_the_next_day_on():
    frame = pl.DataFrame(
        {
            "account_id": ["a", "b", "c"],
            "is_fraud": [True, True, False],
            "label_ts": [utc(2026, 1, 2, 15), utc(2026, 1, 9), utc(2026, 1, 1)],
        }
    )
    out = ranking_exclusions(frame, Period.parse("2026-01-02:2026-01-05"))
    assert out.rows() == [(utc(2026, 1, 3), "a"), (utc(2026, 1, 4), "a")]


def test_feature_spec_is_fitted_on_the_training_period_only(dataset, tmp_path):
    features = compute_features(dataset)
    first_day = dataset_days(dataset).start
    train = Period(first_day, first_day + 20 * DAY)
    spec = fit_feature_spec(features, train.start, train.end)
    inside = features.filter(train.contains()).select(FEATURE_NAMES).to_numpy()
    np.testing.assert_allclose(spec.mean, inside.mean(axis=0))
    # Changing anything after the training period changes nothing in the spec.
    later = features.with_columns(
        pl.when(train.contains()).then(pl.col("log_amount")).otherwise(99.0).alias("log_amount")
    )
    assert fit_feature_spec(later, train.start, train.end) == spec
    spec.save(tmp_path / "spec.json")
    assert FeatureSpec.load(tmp_path / "spec.json") == spec
    normalised = spec.normalize(inside)
    assert normalised.dtype == np.float32
    assert np.abs(normalised.mean(axis=0)).max() < 1e-3


def test_feature_spec_of_another_version_is_refused(tmp_path):
    spec = FeatureSpec(mean=(0.0,) * len(FEATURE_NAMES), std=(1.0,) * len(FEATURE_NAMES), version=0)
    spec.save(tmp_path / "spec.json")
    with pytest.raises(ValueError, match="version: model has 0"):
        FeatureSpec.load(tmp_path / "spec.json")


def test_sequences_are_per_account_in_event_order_with_known_targets(dataset):
    features = compute_features(dataset)
    start = dataset["ts"].min()
    spec = fit_feature_spec(features, start, start + timedelta(days=30))
    cutoff = start + timedelta(days=40)
    seqs = build_sequences(features, spec, label_cutoff=cutoff)
    assert seqs.offsets[-1] == features.height == len(seqs.x)
    assert len(seqs) == features["account_id"].n_unique()
    for a in (0, len(seqs) // 2, len(seqs) - 1):
        rows = seqs.rows(a)
        expected = features.filter(pl.col("account_id") == seqs.account_ids[a]).sort("ts", "event_id")
        assert seqs.event_ids[rows].tolist() == expected["event_id"].to_list()
        assert np.all(np.diff(seqs.ts_us[rows]) >= 0)
    known = dataset.filter(pl.col("is_fraud") & (pl.col("label_ts") < cutoff)).height
    assert seqs.target.sum() == known < seqs.is_fraud.sum()
