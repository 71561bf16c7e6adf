"""Event-level detection metrics (scikit-learn only, so training can import them without polars)."""

import numpy as np
from sklearn.metrics import average_precision_score, roc_auc_score


def event_metrics(scores: np.ndarray, is_fraud: np.ndarray) -> tuple[float, float]:
    """(ROC AUC, AP) over events; NaN when the events hold a single class (the metrics are undefined)."""
    is_fraud = np.asarray(is_fraud, dtype=bool)
    if is_fraud.all() or not is_fraud.any():
        return float("nan"), float("nan")
    return float(roc_auc_score(is_fraud, scores)), float(average_precision_score(is_fraud, scores))
