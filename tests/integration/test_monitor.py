"""Drift and state health through the real broker: a stream like the reference period keeps every drift gauge
low and `txsentinel monitor` exits 0; the next week with amounts x10 sends the amount features' PSI high and
`monitor` exits 1.

The tiny model's reference period is days 30-44 of the generated history (a 30-day feature needs 30 days of
history behind it to be stationary), and its threshold, alert budget and score reference come from its own
scores there, as training takes them from validation. The service reads days 0-51 (the window then holds
days 44-51, unshifted), then days 51-58 with every amount x10. No labels arrive, and the history has none
either (its is_fraud is cleared): the terminals' fraud reports are 0 on both sides. A reference with reports
and a stream without them is drift too, which monitor would rightly report, but not the one tested here.
"""

from __future__ import annotations

import time
from datetime import date, timedelta

import numpy as np
import polars as pl
import pytest
import torch

from consumers.runtime.metrics import free_port, scrape
from consumers.scoring.messages import encode_transaction, transactions_from_frame
from consumers.scoring.scorer import Scorer
from models.registry import build_detector
from pipeline.cli.main import main
from pipeline.data.generate import GenerateConfig, generate
from pipeline.features import compute_features, fit_feature_spec
from pipeline.features.drift_reference import fit_reference
from pipeline.registry.artifact import LoadedModel, save_model_dir
from pipeline.training.thresholds import choose_threshold
from tests.integration.service_helpers import (
    Running,
    create_topic,
    prefixed_configs,
    produce,
    wait_for_metric,
    wait_for_scores,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(300)]

REFERENCE_DAYS = (30, 44)
UNSHIFTED_END, SHIFTED_END = 51, 58


@pytest.fixture(scope="module")
def frame() -> pl.DataFrame:
    cfg = GenerateConfig(accounts=200, days=SHIFTED_END, seed=5, start_date=date(2025, 6, 1))
    return generate(cfg).sort("ts", "event_id").with_columns(pl.lit(False).alias("is_fraud"))


def day(frame: pl.DataFrame, n: int):
    return frame["ts"].min().replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(days=n)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, frame) -> str:
    start, end = day(frame, REFERENCE_DAYS[0]), day(frame, REFERENCE_DAYS[1])
    spec = fit_feature_spec(compute_features(frame), start, end)
    torch.manual_seed(0)
    tiny = {"num_features": spec.num_features, "d_model": 8, "num_layers": 1, "dropout": 0.0}
    detector = build_detector("lstm", tiny)
    scored = Scorer(LoadedModel(detector=detector, spec=spec), reasons=0).replay(
        frame.filter(pl.col("ts") < end)
    )
    validation = scored.filter(pl.col("ts") >= start)
    scores = validation["score"].to_numpy()
    threshold = choose_threshold(
        scores, validation["is_fraud"].to_numpy(), validation["ts"].dt.epoch("us").to_numpy(), 5.0
    )
    meta = {
        "model_version": "drift-1",
        "threshold": threshold.value,
        "alert_budget": threshold.as_meta(),
        "score_reference": fit_reference(scores),
    }
    return str(save_model_dir(tmp_path_factory.mktemp("model") / "model", detector, spec, meta))


def monitor(capsys, bootstrap: str, port: int, scores_topic: str, window: int) -> tuple[int, str]:
    capsys.readouterr()
    code = main(
        [
            "monitor", f"--metrics-url=http://127.0.0.1:{port}/metrics", f"--bootstrap-servers={bootstrap}",
            f"--scores-topic={scores_topic}", f"--window-events={window}",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    print(out)
    return code, out


def psi_of(port: int, feature: str) -> float:
    return scrape(port, f'txsentinel_feature_psi{{feature="{feature}"}}')


def test_an_unshifted_stream_stays_and_amounts_times_ten_move_the_amount_psi(
    kafka_bootstrap, frame, model_dir, capsys
):
    unshifted = frame.filter(pl.col("ts") < day(frame, UNSHIFTED_END))
    week = unshifted.filter(pl.col("ts") >= day(frame, REFERENCE_DAYS[1])).height
    shifted = frame.filter(pl.col("ts") >= day(frame, UNSHIFTED_END)).with_columns(pl.col("amount") * 10)
    port = free_port()
    with prefixed_configs(
        kafka_bootstrap, "drift", max_poll_records=500, poll_timeout_ms=200, metrics_port=port,
        drift_window_events=week, drift_refresh_s=0.05,
    ) as make:  # fmt: skip
        cfg = make()
        create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=2)
        events = transactions_from_frame(unshifted)
        produce(
            kafka_bootstrap,
            cfg.topic("transactions"),
            [(t.account_id, encode_transaction(t)) for t in events],
        )
        running = Running(cfg, model_dir, kafka_bootstrap)
        try:
            wait_for_scores(kafka_bootstrap, cfg.topic("scores"), len(events), running, timeout_s=180)
            wait_for_metric(port, "txsentinel_events_scored_total", len(events), running)
            time.sleep(0.5)  # the idle loop's refresh, drift_refresh_s after the last batch
            assert scrape(port, "txsentinel_drift_window_events") >= week
            before = {f: psi_of(port, f) for f in ("log_amount", "amount_z", "hour_sin", "weekday_sin")}
            # a window of whole batches holds a little more than a week, so the weekday is a little off
            assert before["log_amount"] < 0.1 and before["amount_z"] < 0.1 and before["hour_sin"] < 0.1, (
                before
            )
            assert before["weekday_sin"] < 0.25, before
            assert scrape(port, "txsentinel_feature_psi_max") < 0.25
            assert scrape(port, "txsentinel_score_psi") < 0.25
            assert scrape(port, "txsentinel_states_initial_ratio") == 0.0
            assert scrape(port, "txsentinel_states_nonfinite") == 0.0
            assert 0 < scrape(port, 'txsentinel_state_norm{quantile="0.5"}') < np.inf
            assert scrape(port, 'txsentinel_drift_reference{of="features"}') == 1.0
            code, out = monitor(capsys, kafka_bootstrap, port, cfg.topic("scores"), week)
            assert code == 0, out
            assert "PAST" not in out and "alerts per day" in out

            moved = transactions_from_frame(shifted)
            produce(
                kafka_bootstrap,
                cfg.topic("transactions"),
                [(t.account_id, encode_transaction(t)) for t in moved],
            )
            wait_for_metric(
                port, "txsentinel_events_scored_total", len(events) + len(moved), running, timeout_s=120
            )
            time.sleep(0.5)
            after = {f: psi_of(port, f) for f in ("log_amount", "amount_z", "hour_sin", "weekday_sin")}
            assert after["log_amount"] > 1.0 and after["amount_z"] > 1.0, after
            assert after["hour_sin"] < 0.1 and after["weekday_sin"] < 0.25, after  # time did not move
            code, out = monitor(capsys, kafka_bootstrap, port, cfg.topic("scores"), len(moved))
            assert code == 1, out
            assert "feature psi log_amount" in out and "PAST" in out
        finally:
            running.stop()
