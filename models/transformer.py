"""Softmax Transformer detector over a sliding window of the last W events, served from a ring-buffer KV cache.

Every attention layer sees the current event and the W - 1 before it (ALiBi-style linear distance bias per
head, no absolute positions), in training as in serving. That makes the per-layer cache of the last W keys
and values an exact state: layer l's key at event j depends only on events <= j, computed when j arrived,
so the cache holds exactly what the banded training mask lets a query see. State per account:
k, v [L, H, W, D] ring buffers (event i lives in slot i % W) and `events`, the count seen so far — bounded,
but 2W / (D + 1) times the linear Transformer's (S, Z): 64 KiB against 8.5 KiB at the default size. A slot
holds a key or value as the block's norm and projection made it, so within the bound their weights give
(state_faults), and a slot no event has reached yet (slot j while events <= j) holds 0.

Shapes: B accounts, T events, H heads, D head dim, W window, L layers, d = H * D.
"""

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from models.contract import DetectorConfig, RecurrentDetector, State, StateFault, beyond, event_count_fault
from models.encoder import EventEncoder, FeedForward, ScoreHead, dropout, key_value_bound

# Queries per block of the banded parallel attention: scores are [B, H, block, block + W - 1] rather than
# [B, H, T, T]. Memory only; results do not depend on it.
QUERY_BLOCK_EVENTS = 128


@dataclass(frozen=True)
class TransformerConfig(DetectorConfig):
    num_heads: int = 4
    window_events: int = 64  # W: events each attention layer sees, the current one included
    ffn_multiplier: int = 4

    TINY: ClassVar[dict[str, Any]] = {**DetectorConfig.TINY, "num_heads": 2, "window_events": 8}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model = {self.d_model} must be a multiple of num_heads = {self.num_heads}")


def alibi_slopes(num_heads: int) -> Tensor:
    """Per-head distance penalties 2^(-8 h / H), h = 1..H (Press et al. 2022): from sharply local to ~flat."""
    return torch.tensor([2.0 ** (-8.0 * h / num_heads) for h in range(1, num_heads + 1)])


class WindowBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)) over the window, then x + ffn(norm(x))."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.heads = config.num_heads
        self.window = config.window_events
        self.norm = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)
        self.dropout = config.dropout
        self.ffn = FeedForward(config.d_model, config.ffn_multiplier * config.d_model, config.dropout)

    def _qkv(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # h [..., d] -> q, k, v [..., H, D]
        return self.qkv(self.norm(h)).unflatten(-1, (3, self.heads, -1)).unbind(-3)

    def _finish(self, h: Tensor, att: Tensor) -> Tensor:
        # att [..., H, D]: project back, residual, then the FFN half of the block.
        h = h + dropout(self.out(att.flatten(-2)), self.dropout, self.training)
        return h + self.ffn(h)

    def forward(
        self, h: Tensor, k_cache: Tensor, v_cache: Tensor, valid_from: Tensor, slopes: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """h [B, T, d]; caches [B, H, W, D] oldest first; valid_from [B]: first cache slot holding an event.

        Returns the new h and k, v [B, H, W + T, D] (cache then chunk) for the caller's next ring buffer.
        """
        q, k, v = (t.transpose(1, 2) for t in self._qkv(h))  # [B, H, T, D]
        k = torch.cat([k_cache, k], 2)  # [B, H, W + T, D]
        v = torch.cat([v_cache, v], 2)
        att = self._banded_attention(q, k, v, valid_from, slopes)  # [B, H, T, D]
        return self._finish(h, att.transpose(1, 2)), k, v

    def _banded_attention(
        self, q: Tensor, k: Tensor, v: Tensor, valid_from: Tensor, slopes: Tensor
    ) -> Tensor:
        T, D = q.shape[2:]
        W = self.window
        outs = []
        for t0 in range(0, T, QUERY_BLOCK_EVENTS):
            t1 = min(T, t0 + QUERY_BLOCK_EVENTS)
            # Query t sits at index W + t of k/v; it sees indices W + t - (W - 1) .. W + t.
            qi = torch.arange(W + t0, W + t1, device=q.device)
            ki = torch.arange(t0 + 1, W + t1, device=q.device)
            dist = qi[:, None] - ki[None, :]  # [tq, tk] events back from the query
            allowed = ((dist >= 0) & (dist < W))[None] & (ki[None, None, :] >= valid_from[:, None, None])
            scores = q[:, :, t0:t1] @ k[:, :, t0 + 1 : W + t1].transpose(-1, -2) / math.sqrt(D)
            scores = scores - slopes[:, None, None] * dist.to(scores.dtype)  # [B, H, tq, tk]
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))  # never all -inf: dist 0 is allowed
            p = dropout(scores.softmax(-1), self.dropout, self.training)
            outs.append(p.to(v.dtype) @ v[:, :, t0 + 1 : W + t1])
        return torch.cat(outs, 2)

    def step(self, h: Tensor, k_ring: Tensor, v_ring: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """h [B, d]; rings [B, H, W, D] before this event; bias [B, H, W] per slot (-inf: empty or leaving).

        Attends to the cached events still in the window plus this one, and returns the new h and this
        event's k, v [B, H, D] for the caller to write into a copy of the rings (the input stays as it was).
        """
        q, k, v = self._qkv(h)  # [B, H, D]
        scale = 1.0 / math.sqrt(q.shape[-1])
        cached = (k_ring @ q[..., None].to(k_ring.dtype)).squeeze(-1) * scale + bias  # [B, H, W]
        current = (q * k).sum(-1, keepdim=True) * scale  # [B, H, 1]: distance 0, no bias
        p = dropout(torch.cat([cached, current], -1).softmax(-1), self.dropout, self.training)
        att = (p[:, :, None, :-1].to(v_ring.dtype) @ v_ring).squeeze(-2) + p[..., -1:] * v  # [B, H, D]
        return self._finish(h, att), k, v


class TransformerDetector(RecurrentDetector):
    name: ClassVar[str] = "transformer"

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.encoder = EventEncoder(config)
        self.blocks = nn.ModuleList(WindowBlock(config) for _ in range(config.num_layers))
        self.head = ScoreHead(config.d_model)
        self.register_buffer("slopes", alibi_slopes(config.num_heads), persistent=False)  # [H]

    def init_state(self, batch_size: int) -> State:
        c = self.config
        shape = (batch_size, c.num_layers, c.num_heads, c.window_events, c.d_model // c.num_heads)
        zeros = torch.zeros(shape, dtype=self.state_dtype, device=self.device)  # [B, L, H, W, D]
        events = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # [B]
        return {"k": zeros, "v": zeros.clone(), "events": events}

    def state_faults(self, state: State, most_events: Tensor | None = None) -> dict[str, StateFault]:
        events = state["events"]  # [B]
        unreached = torch.arange(self.config.window_events, device=events.device) >= events[:, None]  # [B, W]
        unreached = unreached[:, None, None, :, None]  # [B, 1, 1, W, 1] against [B, L, H, W, D]
        bounds = zip(
            *(key_value_bound(block.norm, block.qkv, block.heads) for block in self.blocks), strict=True
        )
        faults = {"events": event_count_fault(events, most_events)}
        for key, per_layer in zip(("k", "v"), bounds, strict=True):
            most = torch.stack(per_layer)[None, :, :, None, :]  # [1, L, H, 1, D]
            wrong = torch.where(unreached, state[key] != 0, beyond(state[key], most))
            expected = f"0 in a slot no event reached, else |{key}| within the bound its block's weights give"
            faults[key] = StateFault(wrong, expected, most)
        return faults

    def forward(
        self, x: Tensor, state: State | None = None, lengths: Tensor | None = None
    ) -> tuple[Tensor, State]:
        self._check_input(x, 3)
        x, lengths, _ = self._padding(x, lengths)
        B = x.shape[0]
        W = self.config.window_events
        state = self.init_state(B) if state is None else state
        seen = state["events"]  # [B]
        # Cache slots oldest first: position j holds event seen - W + j (an event only if that is >= 0).
        order = (seen[:, None] - W + torch.arange(W, device=x.device)) % W  # [B, W]
        valid_from = (W - seen).clamp(min=0)  # [B]
        h = self.encoder(x)
        rings_k, rings_v = [], []
        for layer, block in enumerate(self.blocks):
            k_ring, v_ring = state["k"][:, layer], state["v"][:, layer]  # [B, H, W, D]
            index = order[:, None, :, None].expand(-1, k_ring.shape[1], -1, k_ring.shape[3])
            k_cache, v_cache = k_ring.gather(2, index), v_ring.gather(2, index)
            h, k, v = block(h, k_cache.to(h.dtype), v_cache.to(h.dtype), valid_from, self.slopes)
            rings_k.append(self._ring(k, seen, lengths))
            rings_v.append(self._ring(v, seen, lengths))
        new_state = {
            "k": torch.stack(rings_k, 1).to(self.state_dtype),
            "v": torch.stack(rings_v, 1).to(self.state_dtype),
            "events": seen + lengths,
        }
        return self.head(h), new_state

    def _ring(self, kv: Tensor, seen: Tensor, lengths: Tensor) -> Tensor:
        # kv [B, H, W + T, D] (cache then chunk) -> ring [B, H, W, D] after each account's last valid event
        W = self.config.window_events
        last = (seen + lengths - 1)[:, None]  # [B, 1] index of the account's last event so far
        event = last - (last - torch.arange(W, device=kv.device)) % W  # [B, W] event held by each slot
        index = (event - seen[:, None] + W).clamp(min=0)  # where that event sits in kv
        ring = kv.gather(2, index[:, None, :, None].expand(-1, kv.shape[1], -1, kv.shape[3]))
        return ring.masked_fill((event < 0)[:, None, :, None], 0.0)  # empty slots stay zero, as init_state

    def step(self, x_t: Tensor, state: State) -> tuple[Tensor, State]:
        self._check_input(x_t, 2)
        W = self.config.window_events
        seen = state["events"][:, None]  # [B, 1]: this event is number `seen` (0-based), its slot seen % W
        # Events back from this one to the event in each slot (1..W); W is the one this event replaces.
        age = 1 + (seen - 1 - torch.arange(W, device=x_t.device)) % W  # [B, W]
        bias = -self.slopes[None, :, None] * age[:, None, :].to(self.state_dtype)  # [B, H, W]
        bias = bias.masked_fill(((age >= W) | (age > seen))[:, None, :], float("-inf"))
        h = self.encoder(x_t)
        ks, vs = [], []
        for layer, block in enumerate(self.blocks):
            h, k, v = block.step(h, state["k"][:, layer], state["v"][:, layer], bias)
            ks.append(k)
            vs.append(v)
        # One out-of-place write per tensor: new rings = old rings with slot seen % W of every layer and
        # head replaced ([B, L, H] index grid).
        B, L, H = x_t.shape[0], len(self.blocks), self.config.num_heads
        dev = x_t.device
        index = (
            torch.arange(B, device=dev)[:, None, None],
            torch.arange(L, device=dev)[None, :, None],
            torch.arange(H, device=dev)[None, None, :],
            (seen % W)[:, :, None],
        )
        new_state = {
            "k": state["k"].index_put(index, torch.stack(ks, 1).to(state["k"].dtype)),  # [B, L, H, W, D]
            "v": state["v"].index_put(index, torch.stack(vs, 1).to(state["v"].dtype)),
            "events": state["events"] + 1,
        }
        return self.head(h), new_state
