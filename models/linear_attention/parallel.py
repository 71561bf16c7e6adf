"""Causal linear attention over whole sequences, chunked: training's form (the shared signature:
models/linear_attention/__init__.py).

Inside a chunk of C events the attention is quadratic (a masked [C, C] product, matmul-friendly); between
chunks the sums S and Z carry it, so the cost is O(T C) rather than O(T^2) and the result is the
recurrence's whatever C is. The arithmetic runs in the inputs' dtype; callers run it in float32 or wider
(models/linear_transformer.py).
"""

import torch
from torch import Tensor, nn

from models.linear_attention.state import LinearAttentionState, inputs_with_defaults

# Events per chunk: quadratic (masked) inside a chunk, (S, Z) carried between chunks. Speed and memory only;
# results do not depend on it.
CHUNK_EVENTS = 64


def linear_attention_parallel(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    state: LinearAttentionState | None = None,
    valid: Tensor | None = None,
    *,
    chunk_events: int = CHUNK_EVENTS,
) -> tuple[Tensor, LinearAttentionState]:
    """Outputs [B, H, T, Dv] and the state after the last valid event of each account; chunk_events: C."""
    state, valid = inputs_with_defaults(phi_k, v, state, valid)
    keep = valid[:, None, :, None].to(phi_k.dtype)  # [B, 1, T, 1]: padding adds nothing to S and Z
    phi_k, v = phi_k * keep, v * keep
    n = state.n.to(phi_k.dtype)[:, None, None]  # [B, 1, 1]
    s0, z0 = state.s.to(phi_k.dtype) * n[..., None], state.z.to(phi_k.dtype) * n  # the sums carried in
    out, s, z = _chunked(phi_q, phi_k, v, s0, z0, chunk_events)
    events = state.n + valid.sum(1)  # [B]
    n_end = events.clamp(min=1).to(s.dtype)[:, None, None]  # no events: the sums are 0 and so the means
    return out, LinearAttentionState(s / n_end[..., None], z / n_end, events)


def _chunked(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, s0: Tensor, z0: Tensor, chunk_events: int
) -> tuple[Tensor, Tensor, Tensor]:
    # -> outputs [B, H, T, Dv] and the final sums S [B, H, D, Dv], Z [B, H, D], from the sums s0, z0. An
    # event with phi_k = 0 and v = 0 adds nothing (how padding is kept out of the state).
    T = phi_q.shape[2]
    C = min(chunk_events, T)
    N = -(-T // C)  # chunks
    pad = N * C - T
    if pad:
        # Padded keys/values are 0 (no contribution); padded queries 1 so their (discarded) rows divide by
        # a positive number rather than 0, which would turn gradients into NaN.
        phi_q = nn.functional.pad(phi_q, (0, 0, 0, pad), value=1.0)
        phi_k = nn.functional.pad(phi_k, (0, 0, 0, pad))
        v = nn.functional.pad(v, (0, 0, 0, pad))
    q = phi_q.unflatten(2, (N, C))  # [B, H, N, C, D]
    k = phi_k.unflatten(2, (N, C))
    vc = v.unflatten(2, (N, C))  # [B, H, N, C, Dv]
    # Sums up to the start of each chunk: s0, then the running total of each chunk's k^T v.
    s = torch.cat([s0[:, :, None], k.transpose(-1, -2) @ vc], 2).cumsum(2)  # [B, H, N + 1, D, Dv]
    z = torch.cat([z0[:, :, None], k.sum(-2)], 2).cumsum(2)  # [B, H, N + 1, D]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    a = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0.0)  # [B, H, N, C, C] within-chunk weights
    numerator = q @ s[:, :, :-1] + a @ vc  # [B, H, N, C, Dv]
    denominator = (q * z[:, :, :-1, None, :]).sum(-1) + a.sum(-1)  # [B, H, N, C]
    out = numerator / denominator.clamp(min=torch.finfo(q.dtype).tiny)[..., None]
    return out.flatten(2, 3)[:, :, :T], s[:, :, -1], z[:, :, -1]
