"""The drift window: binned per batch, sliding over the last N events, PSI and alert rate as gauges; the state
health of held states; both as Prometheus samples."""

import math

import numpy as np
import pytest
import torch

from consumers.runtime.drift import DAY_US, DriftWindow
from consumers.runtime.metrics import Metrics
from consumers.runtime.state_health import publish_state_health, state_health
from pipeline.features.drift_reference import fit_reference
from tests.consumers.runtime.test_metrics import parse

NAMES = ("amount", "hour")


def window(rng, window_events=1000, scores=True, budget=10.0) -> DriftWindow:
    train = np.stack([rng.lognormal(3, 1, 20_000), rng.uniform(0, 24, 20_000)], axis=1)
    references = {name: fit_reference(train[:, f]) for f, name in enumerate(NAMES)}
    score_reference = fit_reference(rng.beta(1, 20, 20_000)) if scores else None
    return DriftWindow(NAMES, references, score_reference, 0.5, budget, window_events)


def batch(rng, m=100, amount_scale=1.0, day=0):
    features = np.stack([amount_scale * rng.lognormal(3, 1, m), rng.uniform(0, 24, m)], axis=1)
    ts_us = day * DAY_US + np.sort(rng.integers(0, DAY_US, m))
    return features, rng.beta(1, 20, m), ts_us


def test_a_stable_stream_stays_low_and_a_shifted_amount_moves_only_the_amount():
    rng = np.random.default_rng(0)
    drift = window(rng)
    for _ in range(10):
        drift.observe(*batch(rng))
    stable = drift.feature_psi()
    assert max(stable.values()) < 0.05 and drift.score_psi() < 0.05
    for _ in range(10):  # the window (1,000 events) now holds shifted events only
        drift.observe(*batch(rng, amount_scale=10))
    shifted = drift.feature_psi()
    assert shifted["amount"] > 1.0 and shifted["hour"] < 0.05
    assert drift.events == 1000


def test_the_window_slides_by_whole_batches_and_keeps_at_least_its_size():
    rng = np.random.default_rng(1)
    drift = window(rng, window_events=250)
    for _ in range(5):
        drift.observe(*batch(rng, m=100))
    assert drift.events == 300 and len(drift.batches) == 3
    assert drift.counts.sum() == 300 * 3  # two features and the scores, one bin each per event
    assert sum(len(b.ts_us) for b in drift.batches) == 300  # the event times leave with their batches


NOW_US = 1_772_323_200_000_000  # 2026-03-01T00:00:00Z
REPLAYED_US = 1_559_347_200_000_000  # 2019-06-01T00:00:00Z: history a backtest replays
Y2000_US = 946_684_800_000_000  # 2000-01-01T00:00:00Z, the earliest ts the service accepts by default


def storm(rng, start_us, batches=40, m=500, per_day=10_000, alert_share=0.2):
    """Batches of a stream of per_day events a day of event time from start_us, arriving at random within each
    batch's stretch, alert_share of each batch alerts: alert_share * per_day alerts a day (2,000)."""
    out = []
    for b in range(batches):
        features, _, _ = batch(rng, m)
        scores = np.where(rng.permutation(m) < round(alert_share * m), 0.9, 0.1)
        stretch_us = m * DAY_US // per_day
        out.append((features, scores, start_us + b * stretch_us + np.sort(rng.integers(0, stretch_us, m))))
    return out


def storm_rate(batches) -> float:
    drift = window(np.random.default_rng(0), window_events=20_000)
    for features, scores, ts_us in batches:
        drift.observe(features, scores, ts_us)
    return drift.alerts_per_day()


def test_evenly_spaced_events_give_their_rate_exactly_and_steady_traffic_its_rate():
    rng = np.random.default_rng(2)
    drift = window(rng, window_events=10_000)
    features, _, _ = batch(rng, m=4)  # an event every 6 hours is 4 a day; 2 of 4 alert: 2 alerts a day
    drift.observe(features, np.array([0.9, 0.1, 0.6, 0.2]), np.arange(4) * DAY_US // 4)
    assert drift.alerts_per_day() == pytest.approx(2.0)
    drift = window(rng, window_events=10_000)
    features, _, _ = batch(rng, m=1000)  # one every 86.4 s is 1,000 a day; one in ten alerts
    drift.observe(
        features, np.where(np.arange(1000) % 10 == 0, 0.9, 0.1), NOW_US + np.arange(1000) * 86_400_000
    )
    assert drift.alerts_per_day() == pytest.approx(100.0)
    assert storm_rate(storm(rng, NOW_US)) == pytest.approx(2_000, rel=0.03)


def test_one_event_dated_years_back_does_not_hide_an_alert_storm():
    rng = np.random.default_rng(4)
    batches = storm(rng, NOW_US)
    features, scores, ts_us = batches[20]
    batches[20] = (features, scores, np.concatenate([ts_us[:7], [Y2000_US], ts_us[8:]]))
    assert storm_rate(batches) == pytest.approx(2_000, rel=0.03)


def test_a_whole_batch_of_late_events_does_not_hide_an_alert_storm():
    rng = np.random.default_rng(5)
    batches = storm(rng, NOW_US)
    late = storm(rng, NOW_US - 5 * DAY_US, batches=1)  # a partition's 500 events, five days behind
    assert storm_rate([*batches[:20], *late, *batches[20:39]]) == pytest.approx(2_000, rel=0.03)


def test_an_event_dated_ahead_of_a_replay_does_not_hide_an_alert_storm():
    rng = np.random.default_rng(6)
    batches = storm(rng, REPLAYED_US)  # history replayed in minutes: event time, not the clock, is the basis
    features, scores, ts_us = batches[-1]
    future = (
        NOW_US + 1_800_000_000
    )  # within max_ts_skew_s of the clock, seven years after the replayed stream
    batches[-1] = (features, scores, np.concatenate([ts_us[:-1], [future]]))
    assert storm_rate(batches) == pytest.approx(2_000, rel=0.03)


def test_no_rate_until_the_bulk_of_the_window_spans_a_minute():
    rng = np.random.default_rng(7)
    drift = window(rng, window_events=10_000)
    assert math.isnan(drift.alerts_per_day())  # no events
    features, scores, _ = batch(rng, m=1000)
    ts_us = NOW_US + np.sort(rng.integers(0, 50_000_000, 1000))  # 1,000 events within 50 s
    drift.observe(features[:1], scores[:1], ts_us[:1])
    assert math.isnan(drift.alerts_per_day())  # one event
    drift.observe(features[1:], scores[1:], ts_us[1:])
    assert math.isnan(drift.alerts_per_day())
    drift.observe(features[:1], scores[:1], np.array([NOW_US - DAY_US]))  # a straggler does not make it a day
    assert math.isnan(drift.alerts_per_day())
    drift.observe(features, scores, ts_us + 60_000_000)  # the next 1,000 take it past a minute
    assert math.isfinite(drift.alerts_per_day())


def test_gauges_and_no_reference():
    rng = np.random.default_rng(3)
    drift = window(rng, scores=False, budget=None)
    drift.observe(*batch(rng))
    metrics = Metrics()
    drift.publish(metrics)
    values = parse(metrics.render())
    assert values['txsentinel_feature_psi{feature="amount"}'] < 0.2
    assert values["txsentinel_feature_psi_max"] == max(drift.feature_psi().values())
    assert math.isnan(values["txsentinel_score_psi"]) and math.isnan(
        values["txsentinel_alert_budget_per_day"]
    )
    assert values['txsentinel_drift_reference{of="features"}'] == 1.0
    assert values['txsentinel_drift_reference{of="scores"}'] == 0.0
    assert values["txsentinel_drift_window_events"] == 100

    bare = DriftWindow(NAMES, {}, None, 0.5, None, 100)
    bare.observe(*batch(rng))
    assert bare.feature_psi() == {} and math.isnan(bare.score_psi())


def test_a_reference_without_every_feature_is_refused():
    with pytest.raises(ValueError, match="lacks hour"):
        DriftWindow(NAMES, {"amount": fit_reference(np.arange(100.0))}, None, 0.5, None, 100)


def test_state_health_norms_initial_share_and_nonfinite():
    init = {"h": torch.zeros(1, 4), "n": torch.zeros(1, 1)}
    states = {"h": torch.zeros(8, 4), "n": torch.zeros(8, 1)}
    states["h"][0] = torch.tensor([3.0, 4.0, 0.0, 0.0])  # norm 5
    states["h"][1] = torch.tensor([0.0, 0.0, 0.0, 12.0])
    states["n"][1] = 5.0  # norm 13
    states["h"][2, 0] = float("nan")
    rows = np.array([0, 1, 2, 3])  # 3 is held and still initial; 4..7 are not held
    health = state_health(states, rows, init, np.random.default_rng(0))
    assert health.nonfinite == 1 and health.accounts == 4
    assert health.initial_ratio == pytest.approx(0.25)
    assert health.norms["1"] == pytest.approx(13.0) and health.norms["0.5"] == pytest.approx(5.0)
    metrics = Metrics()
    publish_state_health(health, metrics)
    values = parse(metrics.render())
    assert values['txsentinel_state_norm{quantile="1"}'] == pytest.approx(13.0)
    assert values["txsentinel_states_nonfinite"] == 1


def test_state_health_samples_many_accounts():
    init = {"h": torch.zeros(1, 2)}
    states = {"h": torch.ones(10_000, 2)}
    health = state_health(states, np.arange(10_000), init, np.random.default_rng(0), sample_rows=500)
    assert health.accounts == 10_000 and health.initial_ratio == 0.0
    assert health.norms["0.5"] == pytest.approx(math.sqrt(2))
