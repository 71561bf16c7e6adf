"""Causal linear attention one event at a time, written to be read: the reference the fast paths are tested against.

With feature map phi(x) = elu(x) + 1 (Katharopoulos et al. 2020, eq. 7), per head:

    S_t = S_{t-1} + phi(k_t) v_t^T          [D, Dv]  sum of key-value outer products so far
    Z_t = Z_{t-1} + phi(k_t)                [D]      sum of feature-mapped keys so far
    out_t = phi(q_t)^T S_t / (phi(q_t)^T Z_t)        a weighted mean of v_1..v_t, weights phi(q_t).phi(k_j)

so attention over the whole history is an RNN with state (S, Z). Shapes: B accounts, H heads, T events,
D key dim, Dv value dim. No chunking, no normalised state, no precision tricks: plain sums in the inputs'
dtype (use float64 when comparing).
"""

from torch import Tensor
from torch.nn.functional import elu


def phi_naive(x: Tensor) -> Tensor:
    """The textbook feature map; positive everywhere in exact arithmetic."""
    return elu(x) + 1


def linear_attention_naive(
    q: Tensor, k: Tensor, v: Tensor, s0: Tensor | None = None, z0: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Outputs [B, H, T, Dv] and the final sums S [B, H, D, Dv], Z [B, H, D].

    q, k: [B, H, T, D] before the feature map; v: [B, H, T, Dv]; s0, z0: sums carried in from earlier
    events (zeros when None).
    """
    B, H, T, D = q.shape
    Dv = v.shape[-1]
    s = q.new_zeros(B, H, D, Dv) if s0 is None else s0.clone()
    z = q.new_zeros(B, H, D) if z0 is None else z0.clone()
    out = q.new_empty(B, H, T, Dv)
    for t in range(T):
        phi_q = phi_naive(q[:, :, t])  # [B, H, D]
        phi_k = phi_naive(k[:, :, t])  # [B, H, D]
        s = s + phi_k[..., :, None] * v[:, :, t, None, :]  # [B, H, D, Dv]
        z = z + phi_k  # [B, H, D]
        numerator = (phi_q[..., None, :] @ s).squeeze(-2)  # [B, H, Dv]
        denominator = (phi_q * z).sum(-1, keepdim=True)  # [B, H, 1]
        out[:, :, t] = numerator / denominator
    return out, s, z
