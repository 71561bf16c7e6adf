"""Causal linear attention over whole sequences, chunked: training's form (the shared signature:
models/linear_attention/__init__.py).

Inside a chunk of C events the attention is quadratic (a masked [C, C] product, matmul-friendly); between
chunks the decayed sums S and Z carry it, so the cost is O(T C) rather than O(T^2) and the result is the
recurrence's whatever C is. With decay g per head, event i of a chunk weighs the chunk's event j <= i by
g^(i - j) and the sums carried into the chunk by g^(i + 1); the carried sums pass from chunk to chunk as
S <- g^C S + (the chunk's sum, decayed to its end), a scan over the chunks (a cumulative sum where g = 1).
Exponents count valid events, not positions, so padding ages nothing. The weights are one exp per [C, C]
entry, worked out whatever g is (exp(0) = 1 where g = 1): measured on one CPU thread, 56.5 -> 64.5 ms per
forward and backward of 32 accounts x 256 events, H = 4, D = 16. Folding g^(+-i) into the queries and
keys instead would save that but overflows once C |log g| passes float32's exponent range. The arithmetic
runs in the inputs' dtype; callers run it in float32 or wider (models/linear_transformer.py).
"""

import torch
from torch import Tensor, nn

from models.linear_attention.state import LinearAttentionState, decayed_count, inputs_with_defaults

# Events per chunk: quadratic (masked) inside a chunk, (S, Z) carried between chunks. Speed and memory only;
# results do not depend on it.
CHUNK_EVENTS = 64


def linear_attention_parallel(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    state: LinearAttentionState | None = None,
    valid: Tensor | None = None,
    decay: Tensor | None = None,
    *,
    chunk_events: int = CHUNK_EVENTS,
) -> tuple[Tensor, LinearAttentionState]:
    """Outputs [B, H, T, Dv] and the state after the last valid event of each account; decay [H];
    chunk_events: C."""
    state, valid, decay = inputs_with_defaults(phi_k, v, state, valid, decay)
    keep = valid[:, None, :, None].to(phi_k.dtype)  # [B, 1, T, 1]: padding adds nothing to S and Z
    phi_k, v = phi_k * keep, v * keep
    count = decayed_count(state.n, decay).to(phi_k.dtype)  # [B, H] n_g
    s0, z0 = state.s.to(phi_k.dtype) * count[..., None, None], state.z.to(phi_k.dtype) * count[..., None]
    log_g = torch.log(decay.to(phi_k.dtype))  # [H], 0 where g = 1
    out, s, z = _chunked(phi_q, phi_k, v, s0, z0, valid, log_g, chunk_events)
    events = state.n + valid.sum(1)  # [B]
    n_end = (
        decayed_count(events, decay).clamp(min=1).to(s.dtype)
    )  # no events: the sums are 0 and so the means
    return out, LinearAttentionState(s / n_end[..., None, None], z / n_end[..., None], events)


def _chunked(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    s0: Tensor,
    z0: Tensor,
    valid: Tensor,
    log_g: Tensor,
    chunk_events: int,
) -> tuple[Tensor, Tensor, Tensor]:
    # -> outputs [B, H, T, Dv] and the final decayed sums S [B, H, D, Dv], Z [B, H, D], from the sums s0,
    # z0. An event with phi_k = 0 and v = 0 adds nothing, and one with valid False ages nothing (how
    # padding is kept out of the state). log_g [H].
    T = phi_q.shape[2]
    counted = valid.to(phi_q.dtype)  # [B, T] 1 for an event that ages the sums, 0 for padding
    C = min(chunk_events, T)
    N = -(-T // C)  # chunks
    pad = N * C - T
    if pad:
        # Padded keys/values are 0 (no contribution); padded queries 1 so their (discarded) rows divide by
        # a positive number rather than 0, which would turn gradients into NaN.
        phi_q = nn.functional.pad(phi_q, (0, 0, 0, pad), value=1.0)
        phi_k = nn.functional.pad(phi_k, (0, 0, 0, pad))
        v = nn.functional.pad(v, (0, 0, 0, pad))
        counted = nn.functional.pad(counted, (0, pad))
    q = phi_q.unflatten(2, (N, C))  # [B, H, N, C, D]
    k = phi_k.unflatten(2, (N, C))
    vc = v.unflatten(2, (N, C))  # [B, H, N, C, Dv]
    # Ages count valid events: e = log(g) times the valid events of the chunk up to and including each one,
    # so g^(valid events in (j, i]) = exp(e_i - e_j).
    upto = counted.unflatten(1, (N, C)).cumsum(-1)[:, None]  # [B, 1, N, C]
    e = log_g[:, None, None] * upto  # [B, H, N, C]
    carried = torch.exp(e)  # the carried sums' weight at event i, g^(i + 1)
    to_end = torch.exp(e[..., -1:] - e)  # event j's weight at the chunk's end
    through = carried[..., -1]  # [B, H, N]: the carried sums' weight at the chunk's end, g^C
    # The sums carried into each chunk: s0, then a scan over the chunks of S <- g^C S + the chunk's sum.
    k_end = k * to_end[..., None]  # [B, H, N, C, D]
    chunk_s, chunk_z = k_end.transpose(-1, -2) @ vc, k_end.sum(-2)  # [B, H, N, D, Dv], [B, H, N, D]
    s, z = [s0], [z0]
    for c in range(N):
        s.append(through[:, :, c, None, None] * s[-1] + chunk_s[:, :, c])
        z.append(through[:, :, c, None] * z[-1] + chunk_z[:, :, c])
    s, z = torch.stack(s, 2), torch.stack(z, 2)  # [B, H, N + 1, D, Dv], [B, H, N + 1, D]
    # Within a chunk, event j's weight at event i: exp(e_i - e_j) for j <= i, 0 for j > i (exp(-inf)).
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    weights = (e[..., :, None] - e[..., None, :]).masked_fill_(~causal, -torch.inf).exp_()  # [B, H, N, C, C]
    a = (q @ k.transpose(-1, -2)) * weights  # [B, H, N, C, C] within-chunk weights
    q_carried = q * carried[..., None]  # phi(q_i) g^(i + 1): event i's view of the carried sums
    numerator = q_carried @ s[:, :, :-1] + a @ vc  # [B, H, N, C, Dv]
    denominator = (q_carried * z[:, :, :-1, None, :]).sum(-1) + a.sum(-1)  # [B, H, N, C]
    out = numerator / denominator.clamp(min=torch.finfo(q.dtype).tiny)[..., None]
    return out.flatten(2, 3)[:, :, :T], s[:, :, -1], z[:, :, -1]
