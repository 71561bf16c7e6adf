"""The two paths through a detector side by side, and inputs to drive them: what the contract suite, the
training diagnostics and the GPU check all measure (serving must reproduce training).

- `random_events`: valid random events [B, T, F] for a detector;
- `step_through`: the serving path, one `step` per event;
- `forward_in_chunks`: the training path, forward over consecutive chunks with the state carried;
- `both_paths`: the scores of one whole forward and of stepping through, for a caller that reads both;
- `step_vs_forward_error`: how far the two are apart (`paths_error` of what `both_paths` gives).
"""

import torch
from torch import Tensor

from models.contract import RecurrentDetector, State, detach_state, gather_states, scatter_states


def random_events(detector: RecurrentDetector, batch: int, events: int, seed: int = 0) -> Tensor:
    """[B, T, F] on the detector's device and in its dtype: normal numeric features, then a terminal bucket
    in range. Drawn in float64 from a generator seeded with `seed`, so a seed gives the same events in any
    dtype."""
    config, device = detector.config, detector.device
    g = torch.Generator(device).manual_seed(seed)
    numeric = torch.randn(batch, events, config.num_features, generator=g, dtype=torch.float64, device=device)
    bucket = torch.randint(0, config.terminal_buckets, (batch, events, 1), generator=g, device=device)
    return torch.cat([numeric, bucket.double()], -1).to(next(detector.parameters()).dtype)


def valid_mask(lengths: Tensor | None, batch: int, events: int, device: torch.device | None = None) -> Tensor:
    """[B, T] bool: True where event t of account b is within lengths[b] (everywhere when None)."""
    if lengths is None:
        return torch.ones(batch, events, dtype=torch.bool, device=device)
    return torch.arange(events, device=lengths.device)[None, :] < lengths[:, None]


def step_through(
    detector: RecurrentDetector, x: Tensor, state: State | None = None, lengths: Tensor | None = None
) -> tuple[Tensor, State]:
    """Serving path over x [B, T, F]: one `step` per event; scores [B, T] and the final state. With lengths
    [B], each account's state is taken after its own last event and its scores past that are NaN."""
    B, T, _ = x.shape
    state = detector.init_state(B) if state is None else state
    final = {key: value.clone() for key, value in state.items()}
    ends: dict[int, list[int]] = {}  # event index -> the accounts whose last event it is
    for account, length in enumerate([T] * B if lengths is None else lengths.tolist()):
        ends.setdefault(length - 1, []).append(account)
    scores = torch.empty(B, T, dtype=x.dtype, device=x.device)
    for t in range(T):
        scores[:, t], state = detector.step(x[:, t], state)
        if t in ends:
            index = torch.tensor(ends[t], device=x.device)
            scatter_states(final, index, gather_states(state, index))
    valid = valid_mask(None if lengths is None else lengths.to(x.device), B, T, x.device)
    return scores.masked_fill(~valid, float("nan")), final


def forward_in_chunks(
    detector: RecurrentDetector,
    x: Tensor,
    chunk_events: int | list[int],
    state: State | None = None,
    lengths: Tensor | None = None,
    detach: bool = False,
) -> tuple[Tensor, State]:
    """Training path over x [B, T, F]: forward over consecutive chunks with the state carried (detached if
    asked); scores [B, T] and the final state.

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


@torch.inference_mode()
def both_paths(
    detector: RecurrentDetector, x: Tensor, lengths: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Scores [B, T] of one forward over x [B, T, F] and of stepping through it (NaN past lengths[b])."""
    whole, _ = detector(x, lengths=lengths)
    stepped, _ = step_through(detector, x, lengths=lengths)
    return whole, stepped


def paths_error(whole: Tensor, stepped: Tensor, lengths: Tensor | None = None) -> float:
    """Max |whole - stepped| of scores [B, T] over the valid events (all, or each account's first lengths[b])."""
    valid = valid_mask(None if lengths is None else lengths.to(whole.device), *whole.shape, whole.device)
    return (whole[valid].double() - stepped[valid].double()).abs().max().item()


def step_vs_forward_error(detector: RecurrentDetector, x: Tensor, lengths: Tensor | None = None) -> float:
    """Max |score difference| between one forward over x [B, T, F] and stepping through it, over the valid
    events (all, or each account's first lengths[b])."""
    return paths_error(*both_paths(detector, x, lengths), lengths)
