"""Causal linear attention one event at a time, written to be read: the reference the other forms are tested
against (the shared signature: models/linear_attention/__init__.py).

With feature map phi(x) = elu(x) + 1 (Katharopoulos et al. 2020, eq. 7) and a fixed decay g in (0, 1] per
head (RetNet, Sun et al. 2023; g = 1: no decay), per head:

    S_t = g S_{t-1} + phi(k_t) v_t^T        [D, Dv]  decayed sum of key-value outer products so far
    Z_t = g Z_{t-1} + phi(k_t)              [D]      decayed sum of feature-mapped keys so far
    out_t = phi(q_t)^T S_t / (phi(q_t)^T Z_t)        a weighted mean of v_1..v_t, weights
                                                     g^(t - j) phi(q_t).phi(k_j)

so attention over the whole history is an RNN with state (S, Z). A padded event neither adds to the sums
nor decays them. No chunking, no running means, no precision tricks: the carried decayed means become
plain decayed sums on the way in and means again on the way out (state.py), the decayed count n_g kept
beside them as the state defines it, n_g = g n_g + 1 per event; the arithmetic runs in the inputs' dtype
(use float64 when comparing).
"""

import torch
from torch import Tensor
from torch.nn.functional import elu

from models.linear_attention.state import LinearAttentionState, decayed_count, inputs_with_defaults


def phi_naive(x: Tensor) -> Tensor:
    """The textbook feature map; positive everywhere in exact arithmetic."""
    return elu(x) + 1


def linear_attention_naive(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    state: LinearAttentionState | None = None,
    valid: Tensor | None = None,
    decay: Tensor | None = None,
) -> tuple[Tensor, LinearAttentionState]:
    """The plain decayed sums S and Z, one event at a time: outputs [B, H, T, Dv] and the state after each
    account's last valid event, the decayed means the other forms must reproduce. decay [H]."""
    state, valid, decay = inputs_with_defaults(phi_k, v, state, valid, decay)
    B, H, T, _ = phi_q.shape
    g = decay.to(phi_k.dtype)  # [H]
    n, count = state.n, decayed_count(state.n, decay).to(phi_k.dtype)  # [B] events, [B, H] n_g
    s = state.s.to(phi_k.dtype) * count[..., None, None]  # [B, H, D, Dv] S
    z = state.z.to(phi_k.dtype) * count[..., None]  # [B, H, D] Z
    out = v.new_empty(B, H, T, v.shape[-1])
    for t in range(T):
        q, k = phi_q[:, :, t], phi_k[:, :, t]  # [B, H, D]
        keep = valid[:, t, None]  # [B, 1]
        g_t = torch.where(keep, g, 1.0)  # [B, H]: padding decays nothing
        added = keep.to(k.dtype)[..., None]  # [B, 1, 1]: and adds nothing
        s = g_t[..., None, None] * s + added[..., None] * k[..., :, None] * v[:, :, t, None, :]
        z = g_t[..., None] * z + added * k
        count = g_t * count + added[..., 0]
        n = n + valid[:, t]
        numerator = (q[..., None, :] @ s).squeeze(-2)  # [B, H, Dv]
        denominator = (q * z).sum(-1, keepdim=True)  # [B, H, 1]
        out[:, :, t] = numerator / denominator
    count = count.clamp(min=1)  # no events: the sums are 0 and so the means
    return out, LinearAttentionState(s / count[..., None, None], z / count[..., None], n)
