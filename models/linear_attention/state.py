"""What linear attention carries from one event to the next: the decayed running means of its two sums.

Per head the attention's history is two sums, each shrunk by a fixed decay g in (0, 1] per event (RetNet's
fixed per-head decay, Sun et al. 2023; g = 1 is plain causal linear attention, which forgets nothing):

    S_t = g S_{t-1} + phi(k_t) v_t^T   [D, Dv]        Z_t = g Z_{t-1} + phi(k_t)   [D]

The state keeps both divided by the decayed count of events, n_g = g n_g + 1 per event, so that after n
events n_g = 1 + g + ... + g^(n-1): n when g = 1, (1 - g^n) / (1 - g) otherwise (`decayed_count`). It
stores s = S / n_g and z = Z / n_g, the decayed means (weighted means of phi(k) v^T and phi(k), event j's
weight g^(events since j)), plus the plain count n (int64). Why this representation:

- The output ratio phi(q) S / (phi(q) . Z) is unchanged when S and Z are divided by the same n_g.
- n_g follows from n and g alone, so the record holds what it always did: per account s [H, D, Dv], z
  [H, D] and n, whatever the decay. A head with g = 1 stores exactly the running means S / n of plain
  linear attention, updated by the same arithmetic as before the decay existed.
- One event's update is one lerp per head: s' = s + (phi(k) v^T - s) / n_g', where n_g' = g n_g + 1
  counts the new event (`update_shares`: 1 / n_g' is 1 / (n + 1) for g = 1; for g < 1 it falls from 1
  towards 1 - g and stays there).
- Bounded: a decayed mean is a convex combination of the events' phi(k) v^T, so the stored numbers stay
  O(1) however long the stream (no overflow in any float format, the same scale for an account with 10
  events and one with 10 million). The decayed sums themselves would stay bounded too (by 1 / (1 - g)
  times the largest term) but grow without bound at g = 1; one representation for every head keeps one
  update. Rounding is ~eps per update, and for g < 1 an old rounding error fades by g per event like
  the event that made it, so float32 serving stays close to float64 (the contract suite measures 100,000
  events). At g = 1, past ~2^24 events per account a float32 mean can no longer register one event's
  1/n share; a card account never gets near that, and a decayed head's share never falls below 1 - g.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from models.contract import StateFault, beyond


class LinearAttentionState(NamedTuple):
    s: Tensor  # [B, H, D, Dv] S / n_g
    z: Tensor  # [B, H, D] Z / n_g
    n: Tensor  # [B] int64: events so far (0: no history, s and z are zeros)


def decayed_count(n: Tensor, decay: Tensor) -> Tensor:
    """n_g [B, H] float64 = 1 + g + ... + g^(n-1), for n [B] events and decay g [H]: n where g = 1."""
    events = n.to(torch.float64)[:, None]  # [B, 1]
    g = decay.to(dtype=torch.float64, device=n.device)  # [H]
    # (1 - g^n) / (1 - g), with 1 - g^n as -expm1(n log g): no cancellation however close g is to 1.
    geometric = torch.expm1(events * torch.log(g)) / (g - 1)  # NaN where g = 1, replaced below
    return torch.where(g == 1, events, geometric)


def update_shares(n: Tensor, decay: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, H] in `dtype`: 1 / n_g after one more event, the weight of an account's next event in its decayed
    means, n [B] the events before it. Worked out in float64, so exactly 1 / (n + 1) where g = 1."""
    return (1.0 / decayed_count(n + 1, decay)).to(dtype)


def inputs_with_defaults(
    phi_k: Tensor, v: Tensor, state: LinearAttentionState | None, valid: Tensor | None, decay: Tensor | None
) -> tuple[LinearAttentionState, Tensor, Tensor]:
    """The state carried in (no history when None), valid [B, T] (every event when None) and decay [H]
    (1, no decay, when None)."""
    B, H, T, D = phi_k.shape
    if state is None:
        state = LinearAttentionState(
            phi_k.new_zeros(B, H, D, v.shape[-1]),
            phi_k.new_zeros(B, H, D),
            torch.zeros(B, dtype=torch.long, device=phi_k.device),
        )
    if valid is None:
        valid = torch.ones(B, T, dtype=torch.bool, device=phi_k.device)
    if decay is None:
        decay = torch.ones(H, dtype=torch.float64, device=phi_k.device)
    elif decay.shape != (H,):  # its values, in (0, 1], are the config's to check (no device sync here)
        raise ValueError(f"decay must be [H] = [{H}] values in (0, 1], got shape {list(decay.shape)}")
    return state, valid, decay


def decayed_mean_faults(
    s: Tensor, z: Tensor, n: Tensor, phi_k: tuple[float, Tensor], v_most: Tensor, eps: float
) -> tuple[StateFault, StateFault]:
    """Where decayed means s [B, ..., D, Dv] and z [B, ..., D] after n [B] events hold what no events give,
    for keys with phi(k) in phi_k = (least, most [..., D]) and values |v| <= v_most [..., Dv] (what the
    weights allow); eps: the arithmetic's machine epsilon. With no event both are 0. Otherwise each is a
    convex combination of its events' terms (module docstring): least <= z_i <= most_i, and |s_ij| <= z_i
    v_most_j (the same weights over phi(k)_i |v_j| <= phi(k)_i v_most_j). Both widened by what n lerps may
    round, about eps / 2 of the mean's size each: (n + 4) eps, relative (no bound once that reaches 1)."""
    least, most = phi_k
    events = n.reshape(-1, *[1] * (z.dim() - 1)).double()  # [B, 1, ...] against z
    slack = (events + 4) * eps
    none = events == 0  # then z is 0, and so s: its bound z_i v_most_j is 0
    z_least = torch.where(none, 0.0, least * (1 - slack)).to(z.dtype)
    z_most = torch.where(none, 0.0, most.to(z.device) * (1 + slack))
    z_wrong = ~((z >= z_least) & (z <= z_most.to(z.dtype)))
    # z widened, [B, ..., D]: one multiply over s's size then (the check's cost), and no bound past slack 1.
    widened = torch.where(slack < 1, z * ((1 + slack) / (1 - slack)), torch.finfo(s.dtype).max).to(s.dtype)
    s_most = widened[..., None] * v_most.to(s)[..., None, :]  # [B, ..., D, Dv]
    s_wrong = beyond(s, s_most)
    return (
        StateFault(
            s_wrong, "0 with no events, else |s_ij| <= z_i x the largest |v_j| the weights give", s_most
        ),
        StateFault(z_wrong, f"0 with no events, else {least:g} .. the most phi(k) the weights give", z_most),
    )
