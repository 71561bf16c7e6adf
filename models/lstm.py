"""LSTM detector: the recurrent baseline. State (h, c) per layer; O(1) work and memory per event.

One nn.LSTM holds the weights. Training runs it over packed sequences (right-padding never enters the
state, and the final (h, c) is each account's state after its own last event); serving runs the same
parameters one event at a time through torch.lstm_cell, layer by layer (the same math as nn.LSTM, ~25%
less overhead per call than nn.LSTM over a sequence of one).

What a state can hold (state_faults): h = o tanh(c) with the output gate o in [0, 1], so |h| <= 1. And
c' = f c + i g with f, i in [0, 1] and |g| <= 1: c moves by at most 1 an event, and shrinks by f. The weights
bound the gates' pre-activations, so f <= F < 1 and |i g| <= A per unit, and from c = 0 on,
|c| <= A / (1 - F) (cell_bound, rounding included). The first layer reads the encoder's output, a LayerNorm's
(plus an FFN's of it), bounded through the norm by Cauchy-Schwarz (EventEncoder.projected_bound: term by term
its F would round to 1); a layer above reads the h below (|h| <= 1). Where F rounds to 1 all the same, the
float format still bounds c: once |c| is 2^p (p the significand's bits, 2^24 in float32), adding at most 1
rounds back to it. And after n events |c| <= n, where the caller knows n.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from models.contract import (
    DetectorConfig,
    RecurrentDetector,
    State,
    StateFault,
    beyond,
    rounded_up,
    where_state,
)
from models.encoder import EventEncoder, ScoreHead, dropout, linear_bound


@dataclass(frozen=True)
class LSTMConfig(DetectorConfig):
    pass


class LSTMDetector(RecurrentDetector):
    name: ClassVar[str] = "lstm"

    def __init__(self, config: LSTMConfig):
        super().__init__()
        self.config = config
        self.encoder = EventEncoder(config)
        # Dropout between layers only: nn.LSTM applies it to every layer's output but the last.
        self.lstm = nn.LSTM(
            config.d_model,
            config.d_model,
            num_layers=config.num_layers,
            batch_first=True,
            dropout=config.dropout if config.num_layers > 1 else 0.0,
        )
        self.head = ScoreHead(config.d_model)

    def init_state(self, batch_size: int) -> State:
        shape = (batch_size, self.config.num_layers, self.config.d_model)  # [B, L, d]
        zeros = torch.zeros(shape, dtype=self.state_dtype, device=self.device)
        return {"h": zeros, "c": zeros.clone()}

    def forward(
        self, x: Tensor, state: State | None = None, lengths: Tensor | None = None
    ) -> tuple[Tensor, State]:
        self._check_input(x, 3)
        B, T, _ = x.shape
        state = self.init_state(B) if state is None else state
        hx = (state["h"].transpose(0, 1).contiguous(), state["c"].transpose(0, 1).contiguous())  # [L, B, d]
        if lengths is None:
            out, (h, c) = self.lstm(self.encoder(x), hx)  # out [B, T, d]
            return self.head(out), self._state(h, c)
        x, lengths, _ = self._padding(x, lengths)
        # pack_padded_sequence rejects empty sequences: run those on one (zeroed) event, then keep their
        # old state below. It also wants lengths on the CPU.
        packed = pack_padded_sequence(
            self.encoder(x), lengths.clamp(min=1).cpu(), batch_first=True, enforce_sorted=False
        )
        out, (h, c) = self.lstm(packed, hx)  # h, c [L, B, d] in the input's account order
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=T)  # [B, T, d], zeros past lengths
        return self.head(out), where_state(lengths > 0, self._state(h, c), state)

    def _state(self, h: Tensor, c: Tensor) -> State:
        # [L, B, d] -> [B, L, d], in the serving dtype (autocast may have computed them in bf16)
        return {"h": h.transpose(0, 1).to(self.state_dtype), "c": c.transpose(0, 1).to(self.state_dtype)}

    def step(self, x_t: Tensor, state: State) -> tuple[Tensor, State]:
        self._check_input(x_t, 2)
        inp = self.encoder(x_t)  # [B, d]
        hs, cs = [], []
        last = self.config.num_layers - 1
        for layer, weights in enumerate(self.lstm.all_weights):  # weights: w_ih, w_hh, b_ih, b_hh
            h, c = torch.lstm_cell(inp, (state["h"][:, layer], state["c"][:, layer]), *weights)
            hs.append(h)
            cs.append(c)
            inp = dropout(h, self.lstm.dropout, self.training) if layer < last else h
        return self.head(hs[-1]), {"h": torch.stack(hs, 1), "c": torch.stack(cs, 1)}

    def state_faults(self, state: State, most_events: Tensor | None = None) -> dict[str, StateFault]:
        c = state["c"]
        cell = rounded_up(self.cell_bound(), c)  # [L, d]
        if most_events is not None:  # c moves by at most 1 an event, from 0
            cell = torch.minimum(cell, rounded_up(most_events.double(), c)[:, None, None])  # [B, L, d]
        return {
            "h": StateFault(beyond(state["h"], 1.0), "|h| <= 1 (an output gate in [0, 1] times a tanh)"),
            "c": StateFault(beyond(c, cell), "|c| within what the gates' weights let it reach", cell),
        }

    def cell_bound(self) -> Tensor:
        """[L, d] float64: the most |c| reaches from no history, whatever the events (module docstring)."""
        weights_eps = torch.finfo(self.encoder.norm.weight.dtype).eps
        eps = max(weights_eps, torch.finfo(self.state_dtype).eps)
        most = 2 / torch.finfo(self.state_dtype).eps  # 2^p: where adding at most 1 rounds back
        bounds = []
        for layer, (w_ih, w_hh, b_ih, b_hh) in enumerate(self.lstm.all_weights):
            h = torch.ones(w_hh.shape[1], dtype=torch.float64, device=w_hh.device)  # |h| <= 1, any layer's
            if layer == 0:  # the encoder's output
                reads = self.encoder.projected_bound(w_ih, b_ih, weights_eps)
            else:  # the h of the layer below
                reads = linear_bound(w_ih, b_ih, h, weights_eps)
            z = reads + linear_bound(w_hh, b_hh, h, weights_eps)
            z_i, z_f, z_g, _ = z.chunk(4)  # [d] each: the gates' pre-activations at most, nn.LSTM's order
            step = torch.sigmoid(z_i) * torch.tanh(z_g)  # the most |i g|
            # c' = f c + i g, each of its four roundings by at most eps: |c'| <= r (F |c| + A), r = 1 + 4 eps,
            # whose fixed point is r A / (1 - r F), with 1 - F as sigmoid(-z) (no cancellation).
            keep = torch.sigmoid(z_f)
            room = torch.sigmoid(-z_f) - 4 * eps * keep
            fixed = (1 + 4 * eps) * step / room.clamp(min=torch.finfo(torch.float64).tiny)
            bounds.append(torch.where(room > 0, fixed.clamp(max=most), most))
        return torch.stack(bounds)
