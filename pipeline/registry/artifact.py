"""The model artifact: weights, detector config, feature spec and versions in one directory, logged to MLflow.

The loader here is what the scoring service and the backtest use. It needs models/ and the feature spec
only — not Lightning, not the training code — and refuses an artifact whose state or feature version this
code cannot serve, saying what differs and what to do.

Directory layout (also the MLflow model's `model_dir` artifact):
    detector.json      {"name", "config", "state_version", "artifact_version"}
    weights.pt         the detector's state_dict
    feature_spec.json  names, order, normalisation, feature version
    meta.json          threshold, training run facts, test metrics
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from models.contract import RecurrentDetector
from models.registry import build_detector
from models.state_codec import STATE_VERSION
from pipeline.features.spec import FeatureSpec

ARTIFACT_VERSION = 1
MODEL_DIR_ARTIFACT = "model_dir"
DEFAULT_THRESHOLD = 0.5  # on the probability, when neither the caller nor the model's meta gives one


@dataclass
class LoadedModel:
    detector: RecurrentDetector
    spec: FeatureSpec
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def name(self) -> str:
        return self.detector.name


def save_model_dir(path: Path, detector: RecurrentDetector, spec: FeatureSpec, meta: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "detector.json").write_text(
        json.dumps(
            {
                "name": detector.name,
                "config": detector.config.to_dict(),
                "state_version": STATE_VERSION,
                "artifact_version": ARTIFACT_VERSION,
            },
            indent=2,
        )
        + "\n"
    )
    torch.save({k: v.detach().cpu() for k, v in detector.state_dict().items()}, path / "weights.pt")
    spec.save(path / "feature_spec.json")
    (path / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return path


def load_model_dir(path: Path, source: str = "") -> LoadedModel:
    where = source or str(path)
    described = json.loads((path / "detector.json").read_text())
    problems = []
    if described.get("artifact_version") != ARTIFACT_VERSION:
        problems.append(
            f"artifact version {described.get('artifact_version')} (this code reads {ARTIFACT_VERSION})"
        )
    if described.get("state_version") != STATE_VERSION:
        problems.append(f"state version {described.get('state_version')} (this code serves {STATE_VERSION})")
    if problems:
        raise ValueError(
            f"model {where} cannot be served by this txsentinel: {'; '.join(problems)}. Retrain it with this "
            "version, or run the txsentinel version that trained it."
        )
    spec = FeatureSpec.load(path / "feature_spec.json")  # refuses another feature version itself
    detector = build_detector(described["name"], described["config"])
    detector.load_state_dict(torch.load(path / "weights.pt", map_location="cpu", weights_only=True))
    detector.eval()
    meta = json.loads((path / "meta.json").read_text()) if (path / "meta.json").exists() else {}
    return LoadedModel(detector=detector, spec=spec, meta=meta, source=where)
