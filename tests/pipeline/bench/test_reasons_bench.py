"""bench reasons' check: per fraud scenario, the share of its alerts whose top reason is its own signal."""

import polars as pl
import pytest

from consumers.scoring.history_replay import REASONS_DTYPE
from pipeline.bench.reasons import SCENARIO_SIGNALS, top_reason_shares


def _reasons(*inputs: str) -> list[dict]:
    return [{"input": name, "text": name, "logit": 1.0 / (i + 1)} for i, name in enumerate(inputs)]


def test_share_of_alerts_whose_top_reason_is_the_scenarios_signal():
    scored = pl.DataFrame(
        {
            "event_id": ["a", "b", "c", "d", "e", "f"],
            "alert": [True, True, True, False, True, True],
            "reasons": [
                _reasons("amount", "gap"),
                _reasons("gap", "amount"),
                _reasons("amount"),
                None,  # not an alert: not counted
                _reasons("terminal_risk"),
                _reasons("gap"),
            ],
        },
        schema_overrides={"reasons": REASONS_DTYPE},
    )
    scenarios = pl.DataFrame(
        {
            "event_id": ["a", "b", "c", "d", "e", "f"],
            "scenario": ["high_amount"] * 4 + ["compromised_terminal", "legit"],
        }
    )
    shares = {r["scenario"]: r for r in top_reason_shares(scored, scenarios).iter_rows(named=True)}
    assert set(shares) == set(SCENARIO_SIGNALS)
    high = shares["high_amount"]
    assert high["alerts"] == 3 and high["top_is_signal"] == pytest.approx(2 / 3)
    assert (high["most_frequent_top"], high["its_share"], high["then"]) == (
        "amount",
        pytest.approx(2 / 3),
        "gap 0.33",
    )
    assert shares["compromised_terminal"]["top_is_signal"] == 1.0
    assert shares["card_testing"]["alerts"] == 0 and shares["card_testing"]["top_is_signal"] is None
