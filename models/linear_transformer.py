"""Linear-attention Transformer detector ("Transformers are RNNs", Katharopoulos et al. 2020).

Causal attention with feature map phi(x) = elu(x) + 1 is an RNN with state per head
S = sum phi(k) v^T [D, D] and Z = sum phi(k) [D]; out = phi(q) S / (phi(q) . Z). Each head forgets at its
own fixed rate (RetNet, Sun et al. 2023): per event its sums shrink by g in (0, 1], S_t = g S_{t-1} +
phi(k_t) v_t^T and Z_t = g Z_{t-1} + phi(k_t), so event j weighs g^(t - j) at event t (config
`decay_per_event`; g = 1 remembers the whole history equally). Its forms live in
models/linear_attention/ (the slow reference is naive.py there). Training runs the chunked parallel form,
serving the recurrence; both sit in LinearAttentionBlock. Serving on CPU, the step's attention runs as one
compiled pass per layer (linear_attention/fused.py), and step_in_place takes a whole micro-batch at once,
straight on the rows of the service's state table. Shapes: B accounts, T events, H heads, D head dim,
L layers, d = H * D.

Numerics.
- phi is computed as exp(min(x, 0)) + max(x, 0), in float32 at least, floored at PHI_FLOOR. Written as
  elu(x) + 1 = (exp(x) - 1) + 1 it cancels: in bf16 (8 significant bits) exp(x) - 1 rounds to -1 once
  exp(x) < 2^-9, so phi = 0 from x < -6.2 on (float32: x < -17); a query or key whose features are all 0
  makes phi(q) . Z = 0 and the output 0/0. The rewritten form is the same function without the
  subtraction, float32 moves exp's underflow out to x < -87, and the floor keeps phi(q) . Z >= D *
  PHI_FLOOR^2 > 0 for any input. All attention arithmetic (phi, S, Z, the chunk matmuls) runs in
  float32 or wider with autocast off, whatever the activations' dtype.
- The state keeps the decayed running means S / n_g and Z / n_g plus the count n rather than the sums
  (n_g = g n_g + 1 per event, a function of n and g: S / n for an undecayed head), so the stored numbers
  stay O(1) however long the stream (models/linear_attention/state.py). The contract suite measures
  100,000 events in float32 against float64 (tests/models/test_contract.py).
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
from torch import Tensor, nn

from models.contract import (
    DetectorConfig,
    RecurrentDetector,
    State,
    StateFault,
    earlier_occurrences,
    event_count_fault,
)
from models.encoder import EventEncoder, FeedForward, ScoreHead, dropout, key_value_bound
from models.linear_attention.parallel import linear_attention_parallel
from models.linear_attention.recurrent import recurrent_step
from models.linear_attention.state import LinearAttentionState, decayed_mean_faults, update_shares

PHI_FLOOR = 1e-6

# Each head's decay g per event, by rule: H heads -> H values in (0, 1].
DECAY_RULES: dict[str, Callable[[int], list[float]]] = {
    # Heads 0..H-2 forget fast to slowly, g = 1 - 2^-(2 + 2h) (3/4, 15/16, 63/64: horizons of about 4, 16
    # and 64 events), and the last head not at all. The best measured (1,200 accounts x 120 days, the
    # published protocol): test AP 0.807 (one seed) against 0.787 / 0.790 with no decay and 0.797 / 0.803
    # with "retnet" (two seeds each), gained mostly on account takeover and card testing.
    "mixed": lambda heads: [1 - 2.0 ** -(2 + 2 * h) for h in range(heads - 1)] + [1.0],
    "retnet": lambda heads: [1 - 2.0 ** -(5 + h) for h in range(heads)],  # RetNet's: horizons 32..256
    "none": lambda heads: [1.0] * heads,  # plain linear attention, every event of the history alike
}


@dataclass(frozen=True)
class LinearTransformerConfig(DetectorConfig):
    # No dropout: at the Handbook's scale it changed nothing measurable (test AP 0.782 +- 0.003 without,
    # 0.780 +- 0.003 with 0.1, three seeds each) and cost 10-15% of a training step (docs/benchmarks.md).
    dropout: float = 0.0
    num_heads: int = 4
    ffn_multiplier: int = 4
    # g per head, the factor each head's sums S and Z shrink by per event: a rule of DECAY_RULES by name,
    # or num_heads numbers in (0, 1], head 0 first.
    decay_per_event: str | tuple[float, ...] = "mixed"

    TINY: ClassVar[dict[str, Any]] = {**DetectorConfig.TINY, "num_heads": 2}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model = {self.d_model} must be a multiple of num_heads = {self.num_heads}")
        decay = self.decay_per_event
        expected = (
            f"expected one of {sorted(DECAY_RULES)} or {self.num_heads} numbers in (0, 1], one per head"
        )
        if isinstance(decay, str):
            if decay not in DECAY_RULES:
                raise ValueError(f"LinearTransformerConfig.decay_per_event = {decay!r}: {expected}")
            return
        try:
            values = tuple(float(g) for g in decay)  # a list, when the config comes from JSON or YAML
        except (TypeError, ValueError):
            values = ()
        if len(values) != self.num_heads or not all(0 < g <= 1 for g in values):
            raise ValueError(f"LinearTransformerConfig.decay_per_event = {decay!r}: {expected}")
        object.__setattr__(self, "decay_per_event", values)  # frozen: hashable, whatever it came as

    def head_decays(self) -> tuple[float, ...]:
        """g of each head, H values in (0, 1]."""
        if isinstance(self.decay_per_event, str):
            return tuple(DECAY_RULES[self.decay_per_event](self.num_heads))
        return self.decay_per_event

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Self:
        # A config saved before decay_per_event existed belongs to weights trained without decay: it must
        # rebuild that detector, not one with today's default.
        return super().from_dict({"decay_per_event": "none", **values})


@functools.cache
def _decay_tensor(decays: tuple[float, ...], device: torch.device) -> Tensor:
    # [H] float64, made once per config and device (a step makes no host-to-device copy for it); outside
    # inference mode, so that training may use it after a step under inference_mode made it.
    with torch.inference_mode(False):
        return torch.tensor(decays, dtype=torch.float64, device=device)


def phi(x: Tensor) -> Tensor:
    """elu(x) + 1 without cancellation, in float32 or wider, never below PHI_FLOOR (see module docstring)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return (torch.exp(x.clamp(max=0.0)) + x.clamp(min=0.0)).clamp(min=PHI_FLOOR)


class LinearAttentionBlock(nn.Module):
    """Pre-norm block: x + linear_attn(norm(x)), then x + ffn(norm(x)); parallel `forward` and `step`."""

    def __init__(self, config: LinearTransformerConfig):
        super().__init__()
        self.heads = config.num_heads
        self.decay = config.head_decays()  # g per head [H]
        self.norm = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)
        self.dropout = config.dropout
        self.ffn = FeedForward(config.d_model, config.ffn_multiplier * config.d_model, config.dropout)

    def _projections(self, h: Tensor) -> Tensor:
        # h [..., d] -> q, k, v before the feature map [..., 3, H, D]
        return self.qkv(self.norm(h)).unflatten(-1, (3, self.heads, -1))

    @staticmethod
    def _feature_map(qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # qkv [..., 3, H, D] -> phi(q), phi(k), v [..., H, D] in float32 or wider
        phi_qk = phi(qkv[..., :2, :, :])  # one call for q and k
        return phi_qk[..., 0, :, :], phi_qk[..., 1, :, :], qkv[..., 2, :, :].to(phi_qk.dtype)

    def _finish(self, h: Tensor, att: Tensor) -> Tensor:
        # att [..., H, D]: project back, residual, then the FFN half of the block.
        h = h + dropout(self.out(att.flatten(-2).to(h.dtype)), self.dropout, self.training)
        return h + self.ffn(h)

    def forward(self, h: Tensor, s_mean: Tensor, z_mean: Tensor, seen: Tensor, valid: Tensor):
        """h [B, T, d]; s_mean [B, H, D, D], z_mean [B, H, D], the decayed means over `seen` [B] events;
        valid [B, T].

        Returns the new h and the decayed means after each account's last valid event.
        """
        with torch.autocast(h.device.type, enabled=False):
            # Autocast off, so h comes in the weights' dtype: under bf16 autocast the encoder may hand on bf16.
            qkv = self._projections(h.to(self.qkv.weight.dtype))  # [B, T, 3, H, D]
            phi_q, phi_k, v = (t.transpose(1, 2) for t in self._feature_map(qkv))  # [B, H, T, D]
            carried = LinearAttentionState(s_mean, z_mean, seen)
            decay = _decay_tensor(self.decay, h.device)
            att, final = linear_attention_parallel(phi_q, phi_k, v, carried, valid, decay)  # att [B, H, T, D]
        return self._finish(h, att.transpose(1, 2)), final.s, final.z

    def step(self, h: Tensor, s_mean: Tensor, z_mean: Tensor, share: Tensor, out=None):
        """h [B, d]; s_mean [B, H, D, D], z_mean [B, H, D]; share [B, H, 1]: 1 / n_g counting this event
        (linear_attention/state.py's update_shares).

        Returns the new h and means (written into `out`, a pair of tensors, when given; never the inputs).
        """
        # No autocast guard needed: the step uses no matmul, and _feature_map casts to float32 or wider.
        phi_q, phi_k, v = self._feature_map(self._projections(h))  # [B, H, D]
        att, s_mean, z_mean = recurrent_step(phi_q, phi_k, v, s_mean, z_mean, share, out)
        return self._finish(h, att), s_mean, z_mean

    def step_compiled(
        self,
        h: Tensor,
        source: tuple[State, Tensor],
        destination: tuple[State, Tensor],
        layer: int,
        share: Tensor,
    ) -> Tensor:
        """`step` for serving on CPU, its attention one compiled pass (models/linear_attention/fused.py).

        h [B, d], one event each; source and destination: (states {"s": [*, L, H, D, D], "z": [*, L, H,
        D]}, rows [B]): event b's means of this layer are read at source row b, the new ones written at
        destination row b (the same table and rows for an update in place, where a row may repeat: the
        events then apply in order); share [B, H]: 1 / n_g counting this event. Returns the new h.
        """
        from models.linear_attention.fused import (
            fused_step_rows,  # numba loads only when a model serves on CPU
        )

        qkv = self._projections(h)  # [B, 3, H, D]
        phi_qk = phi(qkv[:, :2])  # [B, 2, H, D], in torch (see linear_attention/fused.py)
        return self._finish(h, fused_step_rows(phi_qk, qkv, source, destination, layer, share))


def _compiled_step_applies(h: Tensor, state: State) -> bool:
    # The compiled step: CPU, no autograd, activations and state in one float32 or float64 dtype.
    return (
        not torch.is_grad_enabled()
        and h.device.type == "cpu"
        and h.dtype in (torch.float32, torch.float64)
        and h.dtype == state["s"].dtype == state["z"].dtype
    )


class LinearTransformerDetector(RecurrentDetector):
    name: ClassVar[str] = "linear_transformer"

    def __init__(self, config: LinearTransformerConfig):
        super().__init__()
        self.config = config
        self.encoder = EventEncoder(config)
        self.blocks = nn.ModuleList(LinearAttentionBlock(config) for _ in range(config.num_layers))
        self.head = ScoreHead(config.d_model)

    def _update_shares(self, seen: Tensor, dtype: torch.dtype) -> Tensor:
        # [B, H]: 1 / n_g of each head after one more event, `seen` [B] the events before it
        return update_shares(seen, _decay_tensor(self.config.head_decays(), seen.device), dtype)

    def init_state(self, batch_size: int) -> State:
        c = self.config
        D = c.d_model // c.num_heads
        kwargs = {"dtype": self.state_dtype, "device": self.device}
        # The decayed means S / n_g [B, L, H, D, D] and Z / n_g [B, L, H, D] (linear_attention/state.py).
        return {
            "s": torch.zeros(batch_size, c.num_layers, c.num_heads, D, D, **kwargs),
            "z": torch.zeros(batch_size, c.num_layers, c.num_heads, D, **kwargs),
            "events": torch.zeros(batch_size, dtype=torch.long, device=self.device),  # [B] n
        }

    def state_faults(self, state: State, most_events: Tensor | None = None) -> dict[str, StateFault]:
        """The decayed means against what each layer's weights let phi(k) and v be (linear_attention/state.py's
        decayed_mean_faults): phi(k) = elu(k) + 1 lies in PHI_FLOOR..1 + |k|, increasing in k."""
        bounds = [key_value_bound(block.norm, block.qkv, block.heads) for block in self.blocks]
        phi_k_most = 1 + torch.stack([k for k, _ in bounds])  # [L, H, D]
        v_most = torch.stack([v for _, v in bounds])  # [L, H, D]
        eps = max(torch.finfo(self.state_dtype).eps, torch.finfo(self.blocks[0].qkv.weight.dtype).eps)
        s, z = decayed_mean_faults(
            state["s"], state["z"], state["events"], (PHI_FLOOR, phi_k_most), v_most, eps
        )
        # z before s: a wrong z makes its s's bound wrong too, and is what to name.
        return {"events": event_count_fault(state["events"], most_events), "z": z, "s": s}

    def forward(
        self, x: Tensor, state: State | None = None, lengths: Tensor | None = None
    ) -> tuple[Tensor, State]:
        self._check_input(x, 3)
        x, lengths, valid = self._padding(x, lengths)
        state = self.init_state(x.shape[0]) if state is None else state
        h = self.encoder(x)
        s_means, z_means = [], []
        for layer, block in enumerate(self.blocks):
            h, s, z = block(h, state["s"][:, layer], state["z"][:, layer], state["events"], valid)
            s_means.append(s)
            z_means.append(z)
        new_state = {
            "s": torch.stack(s_means, 1).to(self.state_dtype),
            "z": torch.stack(z_means, 1).to(self.state_dtype),
            "events": state["events"] + lengths,
        }
        return self.head(h), new_state

    def step(self, x_t: Tensor, state: State) -> tuple[Tensor, State]:
        self._check_input(x_t, 2)
        seen = state["events"]
        share = self._update_shares(seen, self.state_dtype)  # [B, H]
        h = self.encoder(x_t)
        if torch.is_grad_enabled():  # out= cannot be differentiated: fresh tensors per layer, then stacked
            s_means, z_means = [], []
            for layer, block in enumerate(self.blocks):
                h, s, z = block.step(h, state["s"][:, layer], state["z"][:, layer], share[..., None])
                s_means.append(s)
                z_means.append(z)
            new_state = {"s": torch.stack(s_means, 1), "z": torch.stack(z_means, 1)}
        else:  # serving: each layer writes straight into one new state, saving the stack's copy (~7% of a step)
            new_state = {"s": torch.empty_like(state["s"]), "z": torch.empty_like(state["z"])}
            compiled = _compiled_step_applies(h, state)
            # account b: row b of `state` in, row b of `new_state` out
            every = torch.arange(len(h)) if compiled else None
            for layer, block in enumerate(self.blocks):
                if compiled:
                    h = block.step_compiled(h, (state, every), (new_state, every), layer, share)
                    continue
                into = (new_state["s"][:, layer], new_state["z"][:, layer])
                h, _, _ = block.step(h, state["s"][:, layer], state["z"][:, layer], share[..., None], into)
        new_state["events"] = seen + 1
        return self.head(h), new_state

    def step_in_place(self, x: Tensor, table: State, rows: Tensor) -> Tensor:
        """The serving step on CPU, for a whole micro-batch at once, straight on the rows of a state table.

        Only the attention's running means carry anything from one event to the next; everything else
        in a block works on each event alone. So each layer runs its projections and FFN as one call over
        all N events, and its recurrence as one compiled walk over them in order, each event reading the
        means its account's previous event wrote. Per micro-batch that is a few dozen torch calls instead
        of as many per round of one event an account, and no gather or scatter of the 8 KiB states.
        Elsewhere (a GPU, autograd on, another dtype) the rounds of the base class.
        """
        if not _compiled_step_applies(x, table):
            return super().step_in_place(x, table, rows)
        self._check_input(x, 2)
        seen = table["events"][rows] + earlier_occurrences(rows)  # [N] events before each one
        share = self._update_shares(seen, table["s"].dtype)  # [N, H]
        h = self.encoder(x)
        for layer, block in enumerate(self.blocks):
            h = block.step_compiled(h, (table, rows), (table, rows), layer, share)
        table["events"].index_add_(0, rows, torch.ones_like(rows))
        return self.head(h)
