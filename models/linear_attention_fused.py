"""The serving step of linear attention as one compiled pass per layer (numba, CPU): the fast path of
models/linear_transformer.py `linear_attention_step`, which stays the reference it is tested against.

In torch the step's attention is a dozen small operations per layer (two lerps, an outer product, two
products and sums, a division, the views between them), each with its own call overhead and its own pass
over the [B, H, D, D] state: at 280 accounts a layer's state is 2.3 MB, written and read again five times.
Here one loop per (account, head) reads S / n once, writes the new S / n once, and forms phi(q) S and
phi(q) . Z from the values it has just written; on the service's state table it reads and writes the
accounts' rows where they lie, so no gather or scatter copies the states around the step. The feature map
phi stays in torch: computed in the loop with a scalar exp, it made the kernel 3.7x slower at 283
accounts.

The arithmetic is the reference's, term for term: torch.lerp's two branches (start + w (end - start) for
w < 0.5, end - (end - start)(1 - w) from 0.5 on), the same products. Only the order of the sums over D
differs, so the results agree to float rounding (tests/models/test_linear_attention_fused.py), not bit
for bit. Shapes: B accounts, L layers, H heads, D head dim.
"""

import numpy as np
from numba import njit
from torch import Tensor


@njit(cache=True)
def _attention_step(phi_qk, qkv, s_src, z_src, src_rows, s_dst, z_dst, dst_rows, layer, share, rest, att):
    # phi_qk [B, 2, H, D]: phi(q), phi(k); qkv [B, 3, H, D]: v is qkv[:, 2]. Account b's means of this layer
    # are read from row src_rows[b] of s_src [*, L, H, D, D] and z_src [*, L, H, D] and the new ones written
    # to row dst_rows[b] of s_dst and z_dst (which may be the same arrays and rows: every element is read
    # before it is written). In place, a row may repeat: b runs in order, so an account's events apply one
    # after the other. share [B] = 1 / (n + 1), rest [B] = 1 - share; att [B, H, D] is written.
    B, _, H, D = qkv.shape
    numerator = np.empty(D, dtype=s_dst.dtype)
    for b in range(B):
        src, dst = src_rows[b], dst_rows[b]
        w, w_rest = share[b], rest[b]
        small = abs(w) < 0.5  # torch.lerp's branch, the same for every element of this account
        for h in range(H):
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


def fused_step(
    phi_qk: Tensor,
    qkv: Tensor,
    source: tuple[dict, Tensor],
    destination: tuple[dict, Tensor],
    layer: int,
    share: Tensor,
) -> Tensor:
    """linear_attention_step for one layer, from phi_qk [B, 2, H, D] (phi(q), phi(k)) and qkv [B, 3, H, D]
    (v is qkv[:, 2]). source and destination: (states {"s": [*, L, H, D, D], "z": [*, L, H, D]}, rows [B]
    int64): account b's means are read at source row b and the new ones written at destination row b.
    share [B] = 1 / (n + 1). Returns the attention output [B, H, D]. Every tensor on CPU, in one float
    dtype."""
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
