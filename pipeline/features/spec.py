"""The feature spec: which features, in which order, and the normalisation fitted on the training period.

It travels inside every model artifact, so the service featurizes exactly as training did and refuses a
model whose features it cannot reproduce.
"""

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from pipeline.features.definitions import (
    FEATURE_NAMES,
    FEATURE_VERSION,
    SEEN_TERMINAL_BITS,
    TERMINAL_BUCKET_COLUMN,
    TERMINAL_BUCKETS,
    WINDOW_DAYS,
)
from pipeline.features.drift_reference import fit_references

# A feature that is constant on the training period (a flag that never fired) is centred but not scaled.
_MIN_STD = 1e-6


@dataclass(frozen=True)
class FeatureSpec:
    mean: tuple[float, ...]
    std: tuple[float, ...]
    names: tuple[str, ...] = FEATURE_NAMES
    version: int = FEATURE_VERSION
    window_days: tuple[int, ...] = WINDOW_DAYS
    terminal_buckets: int = TERMINAL_BUCKETS
    seen_terminal_bits: int = SEEN_TERMINAL_BITS
    fitted_on: dict[str, Any] = field(default_factory=dict)
    # name -> {"edges", "proportions"}: each feature's training distribution in quantile bins, what live drift
    # is measured against (pipeline/features/drift_reference.py); empty in specs written before it existed
    drift_reference: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    @property
    def num_features(self) -> int:
        return len(self.names)

    def normalize(self, features: np.ndarray) -> np.ndarray:
        """[N, F] float64 features -> [N, F] float32 standardised with the training-period statistics."""
        mean = np.asarray(self.mean)
        std = np.asarray(self.std)
        return ((features - mean) / std).astype(np.float32)

    def matrix(self, frame: pl.DataFrame) -> np.ndarray:
        """[N, F] normalised features of a feature frame (from batch.compute_features)."""
        return self.normalize(frame.select(self.names).to_numpy().astype(np.float64))

    def check_compatible(self) -> None:
        """Refuse a spec this code cannot reproduce (written by another feature version)."""
        expected = {
            "version": FEATURE_VERSION,
            "names": FEATURE_NAMES,
            "window_days": WINDOW_DAYS,
            "terminal_buckets": TERMINAL_BUCKETS,
            "seen_terminal_bits": SEEN_TERMINAL_BITS,
        }
        differs = [
            f"{k}: model has {getattr(self, k)!r}, code has {v!r}"
            for k, v in expected.items()
            if getattr(self, k) != v
        ]
        if differs:
            raise ValueError(
                "the model's feature spec does not match this txsentinel's features ("
                + "; ".join(differs)
                + "). Retrain the model with this version, or run the txsentinel version that trained it."
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FeatureSpec":
        tuples = ("mean", "std", "names", "window_days")
        return cls(**{k: tuple(v) if k in tuples else v for k, v in data.items()})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "FeatureSpec":
        spec = cls.from_dict(json.loads(Path(path).read_text()))
        spec.check_compatible()
        return spec


def fit_feature_spec(features: pl.DataFrame, start: datetime, end: datetime) -> FeatureSpec:
    """Fit normalisation and the drift reference on the events with start <= ts < end only (the training
    period)."""
    train = features.filter((pl.col("ts") >= start) & (pl.col("ts") < end))
    if train.height == 0:
        raise ValueError(f"no events in the training period {start.isoformat()} .. {end.isoformat()}")
    values = train.select(FEATURE_NAMES).to_numpy().astype(np.float64)
    std = values.std(axis=0)
    return FeatureSpec(
        mean=tuple(float(v) for v in values.mean(axis=0)),
        std=tuple(float(v) if v > _MIN_STD else 1.0 for v in std),
        fitted_on={"start": start.isoformat(), "end": end.isoformat(), "events": train.height},
        drift_reference=fit_references(values, FEATURE_NAMES),
    )


__all__ = ["TERMINAL_BUCKET_COLUMN", "FeatureSpec", "fit_feature_spec"]
