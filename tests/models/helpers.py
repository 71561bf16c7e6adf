"""Shared pieces of the detector tests: tiny detectors, random events, stepping and chunking drivers."""

import torch
from torch import Tensor

from models.contract import RecurrentDetector, State, detach_state, gather_states, scatter_states
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


def make_events(detector: RecurrentDetector, batch: int, events: int, seed: int = 0) -> Tensor:
    """Valid random events [B, T, F] in the detector's dtype: normal features, then a terminal bucket."""
    config = detector.config
    g = generator(seed)
    numeric = torch.randn(batch, events, config.num_features, generator=g, dtype=torch.float64)
    bucket = torch.randint(0, config.terminal_buckets, (batch, events, 1), generator=g).double()
    return torch.cat([numeric, bucket], -1).to(next(detector.parameters()).dtype)


def step_through(
    detector: RecurrentDetector, x: Tensor, state: State | None = None, lengths: Tensor | None = None
) -> tuple[Tensor, State]:
    """Serving path: one `step` per event. With lengths, each account's state is taken after its own last
    event and its scores past that are NaN."""
    B, T, _ = x.shape
    state = detector.init_state(B) if state is None else state
    final = clone_state(state)
    ends: dict[int, list[int]] = {}
    for account, length in enumerate([T] * B if lengths is None else lengths.tolist()):
        ends.setdefault(length - 1, []).append(account)
    scores = torch.empty(B, T, dtype=x.dtype)
    for t in range(T):
        scores[:, t], state = detector.step(x[:, t], state)
        if t in ends:
            index = torch.tensor(ends[t])
            scatter_states(final, index, gather_states(state, index))
    return scores.masked_fill(~valid_mask(lengths, B, T), float("nan")), final


def forward_in_chunks(
    detector: RecurrentDetector,
    x: Tensor,
    chunk_events: int | list[int],
    state: State | None = None,
    lengths: Tensor | None = None,
    detach: bool = False,
) -> tuple[Tensor, State]:
    """Training path: forward over consecutive chunks with the state carried (detached if asked).

    chunk_events: one size for every chunk, or a list of sizes (what they leave over is one last chunk).
    """
    T = x.shape[1]
    sizes = list(chunk_events) if isinstance(chunk_events, list) else [chunk_events] * (-(-T // chunk_events))
    scores, start = [], 0
    for size in sizes:
        if start >= T:
            break
        stop = min(T, start + size)
        chunk_lengths = None if lengths is None else (lengths - start).clamp(0, stop - start)
        score, state = detector(x[:, start:stop], state, chunk_lengths)
        state = detach_state(state) if detach else state
        scores.append(score)
        start = stop
    if start < T:
        score, state = detector(
            x[:, start:], state, None if lengths is None else (lengths - start).clamp(min=0)
        )
        scores.append(score)
    return torch.cat(scores, 1), state


def valid_mask(lengths: Tensor | None, batch: int, events: int) -> Tensor:
    if lengths is None:
        return torch.ones(batch, events, dtype=torch.bool)
    return torch.arange(events)[None, :] < lengths[:, None]


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
