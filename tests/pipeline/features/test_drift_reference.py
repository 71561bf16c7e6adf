"""The drift reference and PSI: quantile bins fitted on training values, a stable stream near 0, a shifted one
far above 0.25, and specs written before references existed still loading."""

import json
from datetime import UTC, datetime

import numpy as np
import polars as pl
import pytest

from pipeline.features.definitions import FEATURE_NAMES
from pipeline.features.drift_reference import bin_index, check_reference, fit_reference, psi
from pipeline.features.spec import FeatureSpec, fit_feature_spec


def counts_of(reference: dict, values: np.ndarray) -> np.ndarray:
    edges, proportions = check_reference("x", reference)
    return np.bincount(bin_index(edges, values), minlength=len(proportions))


def test_deciles_hold_a_tenth_each_and_the_same_values_again_have_psi_zero():
    values = np.random.default_rng(0).lognormal(3.0, 1.0, 50_000)
    reference = fit_reference(values)
    assert len(reference["edges"]) == 9
    assert np.allclose(reference["proportions"], 0.1, atol=1e-3)
    assert psi(np.asarray(reference["proportions"]), counts_of(reference, values)) == pytest.approx(
        0, abs=1e-9
    )


def test_a_sample_of_the_same_distribution_stays_low_and_amounts_times_ten_go_high():
    rng = np.random.default_rng(1)
    reference = fit_reference(rng.lognormal(3.0, 1.0, 50_000))
    expected = np.asarray(reference["proportions"])
    same = psi(expected, counts_of(reference, rng.lognormal(3.0, 1.0, 5_000)))
    shifted = psi(expected, counts_of(reference, 10 * rng.lognormal(3.0, 1.0, 5_000)))
    assert same < 0.02
    assert shifted > 1.0


def test_psi_by_hand_and_nothing_counted_is_nan():
    expected = np.array([0.5, 0.5])
    # (0.8 - 0.5) ln(0.8 / 0.5) + (0.2 - 0.5) ln(0.2 / 0.5)
    by_hand = 0.3 * np.log(1.6) - 0.3 * np.log(0.4)
    assert psi(expected, np.array([80, 20])) == pytest.approx(by_hand)
    assert np.isnan(psi(expected, np.array([0, 0])))
    assert psi(expected, np.array([100, 0])) < 10  # an empty bin is floored, not infinite


def test_a_flag_gets_two_bins_and_a_value_on_an_edge_goes_into_the_bin_it_closes():
    flags = np.r_[np.zeros(900), np.ones(100)]
    reference = fit_reference(flags)
    assert reference["edges"] == [0.0]
    assert reference["proportions"] == pytest.approx([0.9, 0.1])
    assert counts_of(reference, np.array([0.0, 1.0, 1.0])).tolist() == [1, 2]


def test_a_broken_reference_is_refused_naming_the_feature():
    with pytest.raises(ValueError, match="drift reference of amount: 2 edges"):
        check_reference("amount", {"edges": [1.0, 2.0], "proportions": [0.5, 0.5]})
    with pytest.raises(ValueError, match="drift reference of amount: expected"):
        check_reference("amount", {"edges": [1.0]})


def test_the_fitted_spec_carries_a_reference_per_feature_and_an_old_spec_loads_without_one(tmp_path):
    n = 200
    start = datetime(2026, 1, 1, tzinfo=UTC)
    rng = np.random.default_rng(2)
    frame = pl.DataFrame({name: rng.normal(size=n) for name in FEATURE_NAMES}).with_columns(
        pl.datetime_range(start, start.replace(day=2), interval="432s", time_zone="UTC", eager=True)
        .head(n)
        .alias("ts")
    )
    spec = fit_feature_spec(frame, start, start.replace(day=3))
    assert set(spec.drift_reference) == set(FEATURE_NAMES)
    spec.save(tmp_path / "spec.json")
    assert FeatureSpec.load(tmp_path / "spec.json").drift_reference == spec.drift_reference

    old = spec.to_dict()
    del old["drift_reference"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert FeatureSpec.load(tmp_path / "old.json").drift_reference == {}
