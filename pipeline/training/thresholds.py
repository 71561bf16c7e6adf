"""The alert threshold: chosen on the validation period for a target alert budget, stored with the model.

A fraud team staffs for a number of alerts per day, so the threshold is the score that would have raised
`budget_per_day` alerts per day on the validation period; the service and the backtest read it from the
model's meta.
"""

from dataclasses import asdict, dataclass

import numpy as np

DAY_US = 86_400_000_000


@dataclass(frozen=True)
class Threshold:
    value: float  # on the probability (sigmoid of the logit)
    alert_budget_per_day: float
    validation_alerts_per_day: float  # what the threshold raised on validation (ties can add a few)
    validation_precision: float  # fraud share among those alerts, with the labels known at training

    def as_meta(self) -> dict[str, float]:
        return asdict(self)


def choose_threshold(
    scores: np.ndarray, is_fraud: np.ndarray, ts_us: np.ndarray, budget_per_day: float
) -> Threshold:
    """scores [N] probabilities, is_fraud [N], ts_us [N] of the validation events."""
    if len(scores) == 0:
        raise ValueError("no validation events to choose an alert threshold on")
    if budget_per_day <= 0:
        raise ValueError(f"alert budget must be > 0 alerts per day, got {budget_per_day}")
    days = max(len(np.unique(ts_us // DAY_US)), 1)
    alerts = min(round(budget_per_day * days), len(scores))
    value = float(np.sort(scores)[::-1][max(alerts - 1, 0)])
    alerted = scores >= value
    return Threshold(
        value=value,
        alert_budget_per_day=float(budget_per_day),
        validation_alerts_per_day=float(alerted.sum() / days),
        validation_precision=float(np.asarray(is_fraud, dtype=bool)[alerted].mean())
        if alerted.any()
        else 0.0,
    )
