"""Linear attention's recurrence compiled (numba, CPU): the serving step's fast path, the arithmetic of
recurrent.py's `recurrent_step` in one pass per layer (the shared signature: models/linear_attention/__init__.py).

In torch the step's attention is a dozen small operations per layer (two lerps, an outer product, two
products and sums, a division, the views between them), each with its own call overhead and its own pass
over the [B, H, D, D] state: at 280 accounts a layer's state is 2.3 MB, written and read again five times.
Here one loop per (event, head) reads S / n_g once, writes the new S / n_g once, and forms phi(q) S and
phi(q) . Z from the values it has just written; on the service's state table it reads and writes the
accounts' rows where they lie (`fused_step_rows`), so no gather or scatter copies the states around the
step. The feature map phi stays in torch: computed in the loop with a scalar exp, it made the kernel 3.7x
slower at 283 accounts.

The arithmetic is recurrent_step's, term for term: torch.lerp's two branches (start + w (end - start) for
w < 0.5, end - (end - start)(1 - w) from 0.5 on), the same products. Only the order of the sums over D
differs, so the results agree to float rounding (tests/models/test_linear_attention.py,
test_linear_attention_fused.py), not bit for bit. The decay adds no arithmetic to the loop: it lives in
the lerp's weight w (state.py), read per (event, head) rather than per event. Shapes: B accounts, N
events, L layers, H heads, D head dim (the kernel takes Dv = D).
"""

import numpy as np
import torch
from numba import njit
from torch import Tensor

from models.contract import earlier_occurrences
from models.linear_attention.state import LinearAttentionState, inputs_with_defaults, update_shares


@njit(cache=True)
def _attention_step(phi_qk, qkv, s_src, z_src, src_rows, s_dst, z_dst, dst_rows, layer, share, rest, att):
    # phi_qk [B, 2, H, D]: phi(q), phi(k); qkv [B, 3, H, D]: v is qkv[:, 2]. Account b's means of this layer
    # are read from row src_rows[b] of s_src [*, L, H, D, D] and z_src [*, L, H, D] and the new ones written
    # to row dst_rows[b] of s_dst and z_dst (which may be the same arrays and rows: every element is read
    # before it is written). In place, a row may repeat: b runs in order, so an account's events apply one
    # after the other. share [B, H] = 1 / n_g counting this event (the decay lives there alone), rest
    # [B, H] = 1 - share; att [B, H, D] is written.
    B, _, H, D = qkv.shape
    numerator = np.empty(D, dtype=s_dst.dtype)
    for b in range(B):
        src, dst = src_rows[b], dst_rows[b]
        for h in range(H):
            w, w_rest = share[b, h], rest[b, h]
            small = abs(w) < 0.5  # torch.lerp's branch, the same for every element of this head
            q, k, v = phi_qk[b, 0, h], phi_qk[b, 1, h], qkv[b, 2, h]  # [D] each
            numerator[:] = 0.0
            denominator = numerator[0]  # a zero of the state's dtype (a literal 0.0 would be float64)
            for i in range(D):
                z_old = z_src[src, layer, h, i]
                z = z_old + w * (k[i] - z_old) if small else k[i] - (k[i] - z_old) * w_rest
                z_dst[dst, layer, h, i] = z
                denominator += q[i] * z
                s_old, s_new, k_i, q_i = s_src[src, layer, h, i], s_dst[dst, layer, h, i], k[i], q[i]
                if small:  # two copies of the inner loop keep the branch out of it (it vectorises)
                    for j in range(D):
                        s = s_old[j] + w * (k_i * v[j] - s_old[j])
                        s_new[j] = s
                        numerator[j] += q_i * s
                else:
                    for j in range(D):
                        kv = k_i * v[j]
                        s = kv - (kv - s_old[j]) * w_rest
                        s_new[j] = s
                        numerator[j] += q_i * s
            for j in range(D):
                att[b, h, j] = numerator[j] / denominator


def fused_step_rows(
    phi_qk: Tensor,
    qkv: Tensor,
    source: tuple[dict, Tensor],
    destination: tuple[dict, Tensor],
    layer: int,
    share: Tensor,
) -> Tensor:
    """recurrent_step for N events of one layer, on the rows of state tables: the attention output [N, H, D].

    phi_qk [N, 2, H, D]: phi(q), phi(k); qkv [N, 3, H, D]: v is qkv[:, 2]. source and destination: (states
    {"s": [*, L, H, D, D], "z": [*, L, H, D]}, rows [N] int64): event i reads its account's means at
    source row i and writes the new ones at destination row i (the same table and rows for an update in
    place, where a row may repeat: the events then apply in order). share [N, H]: 1 / n_g counting this
    event, per head (state.py's update_shares). Every tensor on CPU, in one float dtype, outside autograd."""
    (src, src_rows), (dst, dst_rows) = source, destination
    att = qkv.new_empty(qkv.shape[0], qkv.shape[2], qkv.shape[3])
    _attention_step(
        phi_qk.numpy(),
        qkv.numpy(),
        src["s"].numpy(),
        src["z"].numpy(),
        src_rows.numpy(),
        dst["s"].numpy(),
        dst["z"].numpy(),
        dst_rows.numpy(),
        layer,
        share.numpy(),
        (1 - share).numpy(),
        att.numpy(),
    )
    return att


@torch.no_grad()
def linear_attention_fused(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    state: LinearAttentionState | None = None,
    valid: Tensor | None = None,
    decay: Tensor | None = None,
) -> tuple[Tensor, LinearAttentionState]:
    """Outputs [B, H, T, D] (zeros where not valid) and the state after the last valid event of each
    account; decay [H]. CPU only, float32 or float64, no gradients; v's dim must be D."""
    state, valid, decay = inputs_with_defaults(phi_k, v, state, valid, decay)
    B, H, T, D = phi_q.shape
    if v.shape[-1] != D or phi_q.device.type != "cpu":
        raise ValueError(
            f"the fused form runs on CPU with v [B, H, T, D]; got v {list(v.shape)} on {v.device}"
        )
    # The valid events in the order they apply, event t of every account before event t + 1: the kernel's
    # in-place walk over one table of B rows, an account's row repeating once per event.
    t, rows = valid.t().nonzero(as_tuple=True)  # [N] each
    qkv = torch.stack([phi_q, phi_k, v], 1)[rows, :, :, t]  # [N, 3, H, D]
    seen = state.n[rows] + earlier_occurrences(rows)  # [N] events of the account before this one
    share = update_shares(seen, decay, phi_k.dtype)  # [N, H]
    table = {"s": state.s.to(phi_k.dtype)[:, None].clone(), "z": state.z.to(phi_k.dtype)[:, None].clone()}
    att = fused_step_rows(qkv[:, :2].contiguous(), qkv, (table, rows), (table, rows), 0, share)
    out = v.new_zeros(B, H, T, D)
    out[rows, :, t] = att
    return out, LinearAttentionState(table["s"][:, 0], table["z"][:, 0], state.n + valid.sum(1))
