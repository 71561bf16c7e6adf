"""What linear attention carries from one event to the next: the running means of its two sums.

Per head the attention's history is two sums, S = sum of phi(k) v^T [D, Dv] and Z = sum of phi(k) [D], and
they grow linearly with history. The state keeps their running means S / n and Z / n plus the count n
(int64): the output ratio phi(q) S / (phi(q) . Z) is unchanged, the stored numbers stay O(1) however long
the stream (no overflow in any float format, the same scale for an account with 10 events and one with
10 million), and one event's update is one lerp, S_n / n = S_{n-1} / (n - 1) + (phi(k) v^T - S_{n-1} /
(n - 1)) / n. Rounding is ~eps per update, so float32 serving stays close to float64 (the contract suite
measures 100,000 events). Past ~2^24 events per account a float32 mean can no longer register one
event's 1/n share; a card account never gets near that.
"""

from typing import NamedTuple

import torch
from torch import Tensor


class LinearAttentionState(NamedTuple):
    s: Tensor  # [B, H, D, Dv] S / n
    z: Tensor  # [B, H, D] Z / n
    n: Tensor  # [B] int64: events so far (0: no history, s and z are zeros)


def inputs_with_defaults(
    phi_k: Tensor, v: Tensor, state: LinearAttentionState | None, valid: Tensor | None
) -> tuple[LinearAttentionState, Tensor]:
    """The state carried in (no history when None) and valid [B, T] (every event when None)."""
    B, H, T, D = phi_k.shape
    if state is None:
        state = LinearAttentionState(
            phi_k.new_zeros(B, H, D, v.shape[-1]),
            phi_k.new_zeros(B, H, D),
            torch.zeros(B, dtype=torch.long, device=phi_k.device),
        )
    if valid is None:
        valid = torch.ones(B, T, dtype=torch.bool, device=phi_k.device)
    return state, valid
