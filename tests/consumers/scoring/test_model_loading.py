"""Files the service and training read back are data, never code: weights and checkpoints load with
torch.load(weights_only=True), so a tampered file cannot run anything (the service loads whatever model
URI it is given)."""

import ast
import os
import pickle
from pathlib import Path

import pytest
import torch

from models.registry import build_detector
from pipeline.features.definitions import FEATURE_NAMES
from pipeline.features.spec import FeatureSpec
from pipeline.registry.artifact import load_model_dir, save_model_dir

ROOT = Path(__file__).resolve().parents[3]


class Payload:
    """Unpickling this would create `marker`: what a hostile weights file would run instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_a_model_whose_weights_file_holds_code_is_refused_without_running_it(tmp_path):
    n = len(FEATURE_NAMES)
    detector = build_detector("lstm", {"num_features": n, "d_model": 8, "num_layers": 1})
    path = save_model_dir(tmp_path / "model", detector, FeatureSpec(mean=(0.0,) * n, std=(1.0,) * n), {})
    assert load_model_dir(path).detector.name == "lstm"  # the untampered artifact loads
    marker = tmp_path / "ran"
    torch.save({"weights": Payload(marker)}, path / "weights.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_model_dir(path)
    assert not marker.exists(), "the weights file's code ran"


def test_every_torch_load_in_the_code_is_weights_only():
    # Training checkpoints (pipeline/training/train.py) included: one place forgetting it is enough.
    calls = []
    for root in ("models", "pipeline", "consumers"):
        for file in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text(), str(file))):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                    weights_only = [k.value for k in node.keywords if k.arg == "weights_only"]
                    calls.append((f"{file.relative_to(ROOT)}:{node.lineno}", weights_only))
    assert calls, "no torch.load found: the scan looks in the wrong place"
    unsafe = [
        where for where, flag in calls if not (flag and isinstance(flag[0], ast.Constant) and flag[0].value)
    ]
    assert not unsafe, f"torch.load without weights_only=True at {unsafe}"
