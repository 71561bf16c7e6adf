"""`txsentinel bench reasons`: do alerts' reasons mean something, and what do they cost?

A check on generated data, whose scenario column says why each fraud is fraud: among a scenario's alerted
events, the share whose top reason is that scenario's own signal (amount for high-amount fraud, terminal
risk for compromised terminals, time since the previous transaction for card testing, ...), and each
scenario's most frequent top reason beside it. Alerts at the model's own threshold, the history replayed
through the live scorer (Scorer.replay, the backtest's path) with reasons.

The cost: the same replay's events/s without reasons and with them, at a threshold that alerts on
`alert_share` of the events (about 1% live), on one core.
"""

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import torch

from consumers.scoring.scorer import Scorer
from pipeline.data.dataset import read_dataset
from pipeline.data.generate import FRAUD_SCENARIOS
from pipeline.registry.tracking import load_model

# Each fraud scenario's own signal: the inputs (pipeline/features/reasons.py) its generator changes.
SCENARIO_SIGNALS: dict[str, tuple[str, ...]] = {
    "high_amount": ("amount",),  # amount > 220
    "compromised_terminal": ("terminal_risk",),  # every transaction at the terminal is fraud, and reported
    "compromised_account": ("amount",),  # a third of the transactions at 5x the amount
    "account_takeover": ("new_terminal", "amount"),  # far terminals, larger amounts
    "card_testing": ("gap",),  # probes seconds apart, cash-outs minutes to hours after
}
if set(SCENARIO_SIGNALS) != set(FRAUD_SCENARIOS):
    raise AssertionError(f"SCENARIO_SIGNALS must name every fraud scenario: {FRAUD_SCENARIOS}")


@dataclass(frozen=True)
class ReasonsBench:
    shares: pl.DataFrame  # scenario, alerts, signal, top_is_signal, most_frequent_top, its_share, then
    cost: dict[str, float]  # events/s without and with reasons, alert share, ms per alert


def top_reason_shares(scored: pl.DataFrame, scenarios: pl.DataFrame) -> pl.DataFrame:
    """Per fraud scenario: its alerted events, the share whose top reason is its signal, the most frequent
    top reason and its share, then the next two with theirs. `scored`: Scorer.replay(..., reasons=True); `scenarios`: event_id, scenario."""
    alerts = (
        scored.filter(pl.col("alert"))
        .join(scenarios, on="event_id")
        .with_columns(pl.col("reasons").list.first().struct.field("input").alias("top"))
    )
    rows = []
    for scenario, signal in SCENARIO_SIGNALS.items():
        mine = alerts.filter(pl.col("scenario") == scenario)
        n = mine.height
        counts = mine.group_by("top").len().sort(["len", "top"], descending=[True, False])
        rows.append(
            {
                "scenario": scenario,
                "alerts": n,
                "signal": " or ".join(signal),
                "top_is_signal": mine["top"].is_in(list(signal)).mean() if n else None,
                "most_frequent_top": counts["top"][0] if n else None,
                "its_share": counts["len"][0] / n if n else None,
                "then": ", ".join(f"{t} {k / n:.2f}" for t, k in counts.rows()[1:3]),
            }
        )
    return pl.DataFrame(rows)


def run_reasons_bench(
    data: Path, model_uri: str, alert_share: float = 0.01, batch_events: int = 500
) -> ReasonsBench:
    """The check and the cost (module docstring), printed and returned."""
    torch.set_num_threads(1)
    if not 0 < alert_share < 1:
        raise ValueError(f"alert_share = {alert_share!r}: expected a share of the events in (0, 1)")
    frame = read_dataset(data)
    if "scenario" not in frame.columns:
        raise ValueError(
            f"dataset {data} has no scenario column: the check needs generated data (txsentinel generate)"
        )
    model = load_model(model_uri)

    plain, plain_s = _timed(Scorer(model), frame, batch_events, reasons=False)
    threshold = float(np.quantile(plain["score"].to_numpy(), 1 - alert_share))
    explained, explained_s = _timed(Scorer(model, threshold), frame, batch_events, reasons=True)
    alerts = int(explained["alert"].sum())
    cost = {
        "events": float(frame.height),
        "alert_share": alerts / frame.height,
        "events_per_s_without": frame.height / plain_s,
        "events_per_s_with": frame.height / explained_s,
        "ms_per_alert": 1000 * (explained_s - plain_s) / max(alerts, 1),
    }
    at_model, _ = _timed(Scorer(model), frame, batch_events, reasons=True)
    shares = top_reason_shares(at_model, frame.select("event_id", "scenario"))

    print(
        f"reasons of {model_uri} on {data} ({frame.height:,} events), threshold {Scorer(model).threshold:.3f}"
    )
    with pl.Config(
        tbl_rows=-1, float_precision=2, tbl_width_chars=200, fmt_str_lengths=60, tbl_hide_dataframe_shape=True
    ):
        print(shares)
    print(
        f"cost at {cost['alert_share']:.2%} alerts, one core, batches of {batch_events}: "
        f"{cost['events_per_s_without']:,.0f} events/s without reasons, {cost['events_per_s_with']:,.0f} with "
        f"({cost['ms_per_alert']:.1f} ms an alert)"
    )
    return ReasonsBench(shares, cost)


def _timed(
    scorer: Scorer, frame: pl.DataFrame, batch_events: int, reasons: bool
) -> tuple[pl.DataFrame, float]:
    started = time.perf_counter()
    scored = scorer.replay(frame, batch_events=batch_events, reasons=reasons)
    return scored, time.perf_counter() - started
