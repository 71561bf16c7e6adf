"""Causal linear attention one event at a time, written to be read: the reference the other forms are tested
against (the shared signature: models/linear_attention/__init__.py).

With feature map phi(x) = elu(x) + 1 (Katharopoulos et al. 2020, eq. 7), per head:

    S_t = S_{t-1} + phi(k_t) v_t^T          [D, Dv]  sum of key-value outer products so far
    Z_t = Z_{t-1} + phi(k_t)                [D]      sum of feature-mapped keys so far
    out_t = phi(q_t)^T S_t / (phi(q_t)^T Z_t)        a weighted mean of v_1..v_t, weights phi(q_t).phi(k_j)

so attention over the whole history is an RNN with state (S, Z). No chunking, no running means, no
precision tricks: the carried means become plain sums on the way in and means again on the way out, and
the arithmetic runs in the inputs' dtype (use float64 when comparing).
"""

from torch import Tensor
from torch.nn.functional import elu

from models.linear_attention.state import LinearAttentionState, inputs_with_defaults


def phi_naive(x: Tensor) -> Tensor:
    """The textbook feature map; positive everywhere in exact arithmetic."""
    return elu(x) + 1


def linear_attention_naive(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    state: LinearAttentionState | None = None,
    valid: Tensor | None = None,
) -> tuple[Tensor, LinearAttentionState]:
    """The plain sums S and Z, one event at a time: outputs [B, H, T, Dv] and the state after each account's
    last valid event, the means the other forms must reproduce."""
    state, valid = inputs_with_defaults(phi_k, v, state, valid)
    B, H, T, _ = phi_q.shape
    n = state.n  # [B]
    count = n.to(phi_k.dtype)[:, None, None]  # [B, 1, 1]
    s = state.s.to(phi_k.dtype) * count[..., None]  # [B, H, D, Dv] S
    z = state.z.to(phi_k.dtype) * count  # [B, H, D] Z
    out = v.new_empty(B, H, T, v.shape[-1])
    for t in range(T):
        q, k = phi_q[:, :, t], phi_k[:, :, t]  # [B, H, D]
        keep = valid[:, t, None, None].to(k.dtype)  # [B, 1, 1]: 0 for padding, which adds nothing
        s = s + keep[..., None] * k[..., :, None] * v[:, :, t, None, :]  # [B, H, D, Dv]
        z = z + keep * k  # [B, H, D]
        n = n + valid[:, t]
        numerator = (q[..., None, :] @ s).squeeze(-2)  # [B, H, Dv]
        denominator = (q * z).sum(-1, keepdim=True)  # [B, H, 1]
        out[:, :, t] = numerator / denominator
    events = n.clamp(min=1).to(s.dtype)[:, None, None]  # no events: the sums are 0 and so the means
    return out, LinearAttentionState(s / events[..., None], z / events, n)
