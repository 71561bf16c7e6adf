"""Reasons in words (pipeline/features/reasons.py): worded from the feature values the featurizer computes,
grouped so an input's columns add up, and only what raised the score, largest first."""

from datetime import UTC, datetime

import numpy as np
import pytest

from pipeline.features.definitions import FEATURE_NAMES, RAW_FIELDS, derive_features, feature_matrix
from pipeline.features.reasons import HISTORY, INPUTS, describe, explain, group_by_input

TS = datetime(2026, 3, 7, 3, 12, tzinfo=UTC)  # a Saturday, 03:12 UTC


def _values(**raw) -> dict[str, float]:
    # One event's features from its raw aggregates, as derive_features computes them for the model.
    base = dict.fromkeys(RAW_FIELDS, 0.0)
    base["ts_us"] = int(TS.timestamp() * 1_000_000)
    base.update(raw)
    columns = derive_features({k: np.array([v]) for k, v in base.items()})
    return {name: float(columns[name][0]) for name in FEATURE_NAMES}


def test_amount_in_sigma_above_the_accounts_mean():
    # ten earlier amounts with log1p mean 3.0 and variance 0.25 (+ the 0.25 prior): sigma = sqrt(0.5)
    values = _values(amount=523.10, prev_count=10, prev_sum_log_amount=30.0, prev_sumsq_log_amount=92.5)
    z = (np.log1p(523.10) - 3.0) / np.sqrt(0.5)
    assert describe("amount", values) == (
        f"amount 523.10, {z:.1f} sigma above this account's mean so far (log scale)"
    )
    assert describe("amount", _values(amount=12.0)) == "amount 12.00 on the account's first transaction"


def test_terminal_gap_and_calendar_wording():
    values = _values(
        prev_count=4,
        gap_s=43,
        terminal_seen=0,
        terminal_count_1d=20,
        terminal_count_7d=60,
        terminal_count_30d=200,
        terminal_reports_7d=3,
        terminal_reports_30d=5,
    )
    assert describe("new_terminal", values) == "first use of this terminal"
    assert describe("new_terminal", _values(terminal_seen=1)) == "a terminal this account used before"
    assert describe("terminal_risk", values) == (
        f"terminal reported 3 frauds in 7 days (5 in 30 days, risk {3 / 61:.2f})"
    )
    assert describe("terminal_risk", _values()) == "no fraud reported at this terminal in 30 days"
    assert (
        describe("terminal_activity", values)
        == "terminal's transactions: 20 today, 60 in 7 days, 200 in 30 days"
    )
    assert describe("gap", values) == "43 s since the account's previous transaction"
    assert describe("gap", _values(prev_count=2, gap_s=3 * 3600)) == (
        "3.0 h since the account's previous transaction"
    )
    assert describe("gap", _values()) == "first transaction of this account"
    assert describe("time_of_day", values) == "at 03:12 UTC (night)"
    assert describe("day_of_week", values) == "on a Saturday"
    assert describe(HISTORY, values) == "this account's history (its recurrent state)"
    with pytest.raises(ValueError, match="unknown input 'colour'"):
        describe("colour", values)


def test_every_input_is_worded_and_every_feature_belongs_to_one():
    assert sorted(n for names in INPUTS.values() for n in names) == sorted(FEATURE_NAMES)
    values = _values(amount=40.0, prev_count=3, prev_sum_log_amount=9.0, prev_sumsq_log_amount=27.5)
    assert all(describe(name, values) for name in INPUTS)


def test_columns_of_an_input_add_up_and_only_raising_inputs_are_reasons_largest_first():
    column = {n: i for i, n in enumerate(FEATURE_NAMES)}
    terms = np.zeros((1, len(FEATURE_NAMES)))
    terms[0, column["log_amount"]], terms[0, column["amount_z"]] = 0.5, 1.5  # amount: 2.0
    terms[0, column["terminal_risk_7d"]], terms[0, column["terminal_log_reports_7d"]] = 1.0, 0.2  # 1.2
    terms[0, column["new_terminal"]] = -3.0  # lowered the score: no reason for an alert
    terms[0, column["hour_sin"]] = 0.1
    grouped = group_by_input(terms)
    assert grouped[0, list(INPUTS).index("amount")] == pytest.approx(2.0)
    assert grouped.sum() == pytest.approx(terms.sum())
    features = feature_matrix({k: np.array([v]) for k, v in _values(amount=900.0).items()})
    (e,) = explain(terms, np.array([0.7]), np.array([-4.0]), features, top=5)
    assert [r.input for r in e.reasons] == ["amount", "terminal_risk", "time_of_day"]
    assert [r.logit for r in e.reasons] == pytest.approx([2.0, 1.2, 0.1])
    assert e.history.input == HISTORY and e.history.logit == pytest.approx(0.7)
    record = e.as_dict()
    assert record["reasons"][0] == {
        "input": "amount",
        "text": "amount 900.00 on the account's first transaction",
        "logit": 2.0,
    }
    assert record["base_logit"] == -4.0
    (two,) = explain(terms, np.array([0.7]), np.array([-4.0]), features, top=2)
    assert [r.input for r in two.reasons] == ["amount", "terminal_risk"]
    with pytest.raises(ValueError, match="FEATURE_NAMES order"):
        explain(terms[:, :3], np.array([0.7]), np.array([-4.0]), features)


@pytest.mark.parametrize(
    "input_name, raw",
    [
        # 179.33 / 2 = 89.665: a half cent, which sums in another order put just below or just above
        ("account_spend", {"account_amount_7d": 179.33, "account_count_7d": 2}),
        ("amount", {"amount": 0.125}),
        ("gap", {"prev_count": 1, "gap_s": 3 * 3600 + 180}),  # 3.05 h
        ("terminal_risk", {"terminal_reports_1d": 1, "terminal_count_1d": 7}),  # 1 / 8 = 0.125
    ],
)
def test_a_value_on_a_rounding_boundary_reads_the_same_whatever_its_last_bits(input_name, raw):
    # The stream and the backtest batch events differently, so a sum can differ in its last bit; an alert's
    # words must not.
    values = _values(**raw)
    texts = set()
    for ulps in range(-4, 5):
        nudged = {
            k: float(np.float64(v) + ulps * np.spacing(np.float64(v))) if v else v for k, v in values.items()
        }
        texts.add(describe(input_name, nudged))
    assert len(texts) == 1, texts
