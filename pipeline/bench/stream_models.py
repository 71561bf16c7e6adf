"""The stream bench's models: untrained detectors at their default size, for the cost of serving them.

Imported by pipeline/bench/stream.py's harness only, never at the top of a spawned child's modules: torch
and polars are imported inside (stream.py's docstring says why).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path


def build_default_model(
    name: str, out_dir: Path, seed: int = 0, alert_rate: float = 0.01, version: str | None = None
) -> str:
    """An untrained detector at its default size with a feature spec fitted on generated data (for cost only).

    Its threshold is set so that `alert_rate` of the generated events alert, as a trained model's would be:
    an untrained one's scores sit around 0.5, and at the default threshold it alerted on up to half the
    events, an extra record per event that no real deployment writes. Saved in out_dir/`version` (default
    bench-NAME, also its model_version).
    """
    # torch and polars, never in a child (module docstring)
    import torch

    from consumers.scoring.scorer import Scorer
    from models.registry import build_detector
    from pipeline.data.generate import GenerateConfig, generate
    from pipeline.features import compute_features, fit_feature_spec
    from pipeline.registry.artifact import LoadedModel, save_model_dir

    frame = generate(GenerateConfig(accounts=200, days=30, seed=seed))
    start = frame["ts"].min()
    spec = fit_feature_spec(compute_features(frame), start, start + timedelta(days=20))
    torch.manual_seed(seed)
    detector = build_detector(
        name, {"num_features": spec.num_features, "terminal_buckets": spec.terminal_buckets}
    )
    scores = Scorer(LoadedModel(detector=detector, spec=spec)).replay(frame)["score"]
    version = version or f"bench-{name}"
    meta = {"model_version": version, "threshold": float(scores.quantile(1.0 - alert_rate))}
    return str(save_model_dir(out_dir / version, detector, spec, meta))
