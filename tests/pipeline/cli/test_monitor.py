"""monitor's judgement without a service: which rows are past, what "no reference" and too few events say,
and the alert rate over the scores read."""

import math

import pytest

from pipeline.cli.errors import OperatorError
from pipeline.cli.main import main
from pipeline.cli.monitor import MonitorConfig, alert_rows, format_rows, instance_rows, monitor

CFG = MonitorConfig(metrics_urls=("u",))


def metrics(**more) -> dict[str, float]:
    return {
        "txsentinel_drift_window_events": 2000.0,
        'txsentinel_drift_reference{of="features"}': 1.0,
        'txsentinel_drift_reference{of="scores"}': 1.0,
        'txsentinel_feature_psi{feature="log_amount"}': 0.02,
        'txsentinel_feature_psi{feature="hour_sin"}': 0.05,
        "txsentinel_score_psi": 0.01,
        "txsentinel_states_initial_ratio": 0.0,
        "txsentinel_states_nonfinite": 0.0,
        **more,
    }


def statuses(rows) -> dict[str, str]:
    return {r.check: r.status for r in rows}


def test_a_calm_instance_shows_its_largest_psi_and_passes():
    rows = instance_rows("u", metrics(), CFG)
    assert statuses(rows)["feature psi hour_sin"] == "ok"
    assert "PAST" not in statuses(rows).values()


def test_every_feature_past_the_limit_gets_its_row():
    m = metrics(
        **{
            'txsentinel_feature_psi{feature="log_amount"}': 2.0,
            'txsentinel_feature_psi{feature="hour_sin"}': 0.3,
        }
    )
    got = statuses(instance_rows("u", m, CFG))
    assert got["feature psi log_amount"] == got["feature psi hour_sin"] == "PAST"


def test_no_reference_and_too_few_events_are_not_past():
    m = metrics(**{
        'txsentinel_drift_reference{of="features"}': 0.0, 'txsentinel_drift_reference{of="scores"}': 0.0,
    })  # fmt: skip
    got = statuses(instance_rows("u", m, CFG))
    assert got["feature psi"] == got["score psi"] == "no reference"
    few = metrics(txsentinel_drift_window_events=10.0, txsentinel_score_psi=3.0)
    assert statuses(instance_rows("u", few, CFG))["score psi"] == "too few events"


def test_non_finite_states_and_lost_states_are_past():
    got = statuses(
        instance_rows("u", metrics(txsentinel_states_nonfinite=1.0, txsentinel_states_initial_ratio=0.9), CFG)
    )
    assert got["non-finite states"] == got["states at initial share"] == "PAST"


def test_alerts_per_day_against_twice_the_budget():
    # 1,000 scores, one every 172.8 s: 500 a day, of which 50 of 1,000 alert: 25 a day
    records = [{"ts": i * 172_800, "alert": i < 50} for i in range(1000)]
    (read, rate) = alert_rows(records, 10.0, CFG)
    assert read.value == 1000 and rate.value == pytest.approx(25.0) and rate.status == "PAST"
    assert alert_rows(records, 20.0, CFG)[1].status == "ok"
    assert alert_rows(records, None, CFG)[1].status == "no reference"
    assert alert_rows([], 10.0, CFG)[1].status == "too few events"
    iso = [{"ts": "2026-03-01T00:00:00Z", "alert": True}, {"ts": "2026-03-02T00:00:00.000Z", "alert": True}]
    assert alert_rows(iso, None, MonitorConfig(metrics_urls=("u",), min_events=1))[1].value == pytest.approx(
        1.0
    )


def test_a_score_dated_years_away_does_not_hide_the_alerts():
    # as read: sorted by ts, so the stragglers sit at the ends of a storm of 25 alerts a day
    storm = [{"ts": 1_772_323_200_000 + i * 172_800, "alert": i < 50} for i in range(1000)]
    records = [
        {"ts": "2000-01-01T00:00:00Z", "alert": False},
        *storm,
        {"ts": 1_900_000_000_000, "alert": False},
    ]
    (_, rate) = alert_rows(records, 10.0, CFG)
    assert rate.value == pytest.approx(25.0, rel=0.01) and rate.status == "PAST"


def test_the_table_has_a_header_and_a_row_each():
    rows = instance_rows("u", metrics(), CFG)
    table = format_rows(rows).splitlines()
    assert table[0].split() == ["source", "check", "value", "limit", "status"] and len(table) == len(rows) + 1
    assert not math.isnan(rows[0].value)


def test_an_instance_that_does_not_answer_is_an_error_naming_it(capsys):
    assert main(["monitor", "--metrics-url", "http://127.0.0.1:9/metrics", "--timeout-s", "2"]) == 1
    assert "could not read http://127.0.0.1:9/metrics" in capsys.readouterr().err
    with pytest.raises(OperatorError, match="at least one"):
        monitor(MonitorConfig(metrics_urls=()))
