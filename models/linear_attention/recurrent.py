"""Causal linear attention one event at a time on the decayed running means: the serving step's arithmetic in
torch (the shared signature: models/linear_attention/__init__.py; the means and their shares: state.py).

`recurrent_step` is one event, the detector's torch step (GPU serving, and any step with autograd on);
`linear_attention_recurrent` walks it over T events.
"""

import torch
from torch import Tensor

from models.linear_attention.state import LinearAttentionState, inputs_with_defaults, update_shares


def recurrent_step(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    s_mean: Tensor,
    z_mean: Tensor,
    share: Tensor,
    out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One event: output [B, H, Dv] and the new decayed running means (into `out` when given).

    phi_q, phi_k: [B, H, D], feature-mapped; v: [B, H, Dv]; s_mean [B, H, D, Dv] = S / n_g and z_mean
    [B, H, D] = Z / n_g over the events before this one; share [B, H, 1] (or [B, 1, 1], one for every
    head) = 1 / n_g counting this event (state.py's update_shares): 1 / (n + 1) for an undecayed head.
    """
    s_out, z_out = (None, None) if out is None else out
    # S' = g S + phi(k) v^T and n_g' = g n_g + 1, as decayed means: S / n_g moves 1 / n_g' of the way
    # towards phi(k) v^T (g S / n_g' = (1 - 1 / n_g') S / n_g). The decay lives in the share alone.
    s_mean = torch.lerp(s_mean, phi_k[..., :, None] * v[..., None, :], share[..., None], out=s_out)
    z_mean = torch.lerp(z_mean, phi_k, share, out=z_out)
    # phi(q) S as a broadcast multiply and sum: as B * H tiny matrix-vector products (bmm) it is ~4x slower
    # on CPU. Dividing S and Z by the same n_g leaves the ratio as it was.
    numerator = (phi_q[..., :, None] * s_mean).sum(-2)  # [B, H, Dv]
    denominator = (phi_q * z_mean).sum(-1, keepdim=True)  # [B, H, 1], >= D * PHI_FLOOR^2 (the detector's phi)
    return numerator / denominator, s_mean, z_mean


def linear_attention_recurrent(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    state: LinearAttentionState | None = None,
    valid: Tensor | None = None,
    decay: Tensor | None = None,
) -> tuple[Tensor, LinearAttentionState]:
    """recurrent_step walked over the T events, padding skipped: outputs [B, H, T, Dv] and the state after
    each account's last valid event. decay [H]."""
    state, valid, decay = inputs_with_defaults(phi_k, v, state, valid, decay)
    s, z, n = state.s.to(phi_k.dtype), state.z.to(phi_k.dtype), state.n
    out = v.new_empty(*phi_q.shape[:3], v.shape[-1])
    for t in range(phi_q.shape[2]):
        share = update_shares(n, decay, s.dtype)[..., None]  # [B, H, 1]
        out[:, :, t], s_new, z_new = recurrent_step(phi_q[:, :, t], phi_k[:, :, t], v[:, :, t], s, z, share)
        keep = valid[:, t]  # [B]: padding leaves the state as it was
        s = torch.where(keep[:, None, None, None], s_new, s)
        z = torch.where(keep[:, None, None], z_new, z)
        n = n + keep
    return out, LinearAttentionState(s, z, n)
