"""Shared pieces of the detector tests: tiny detectors and comparisons of scores and states.

Random events and the stepping and chunking drivers are models/parity.py's, shared with the diagnostics."""

import torch
from torch import Tensor

from models.contract import RecurrentDetector, State
from models.parity import valid_mask
from models.registry import REGISTRY, build_detector

DETECTORS = sorted(REGISTRY)  # every registered detector, no exemptions
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
TRAIN_CHUNK_EVENTS = 256  # what training feeds forward at a time (pipeline's default chunk)


def make_detector(
    name: str, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides
) -> RecurrentDetector:
    """The tiny config of `name`, seeded, in eval mode and in `dtype`."""
    torch.manual_seed(seed)
    config = REGISTRY[name][0].tiny(**overrides)
    return build_detector(name, config).to(dtype).eval()


def generator(seed: int) -> torch.Generator:
    """A seeded generator on the device the tests run on (see tests/models/conftest.py)."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


def max_score_diff(a: Tensor, b: Tensor, lengths: Tensor | None = None) -> float:
    """Largest |a - b| over valid (non-padding) positions; padding scores are don't-care."""
    mask = valid_mask(lengths, *a.shape)
    return (a[mask].double() - b[mask].double()).abs().max().item()


def max_state_diff(a: State, b: State) -> float:
    """Largest difference over float tensors; integer tensors (counters) must be equal."""
    assert sorted(a) == sorted(b)
    worst = 0.0
    for key in a:
        assert a[key].shape == b[key].shape, key
        if a[key].is_floating_point():
            worst = max(worst, (a[key].double() - b[key].double()).abs().max().item())
        else:
            assert torch.equal(a[key], b[key]), key
    return worst


def states_equal(a: State, b: State) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def states_close(a: State, b: State, atol: float = 1e-6) -> bool:
    """Equal up to float rounding: a batch of another size may take another BLAS kernel and round apart."""
    return sorted(a) == sorted(b) and all(torch.allclose(a[k], b[k], rtol=0.0, atol=atol) for k in a)


def clone_state(state: State) -> State:
    return {k: v.clone() for k, v in state.items()}


def concat_states(states: list[State]) -> State:
    """One batch out of several (e.g. single accounts decoded one by one)."""
    return {key: torch.cat([s[key] for s in states]) for key in states[0]}
