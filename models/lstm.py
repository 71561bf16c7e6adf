"""LSTM detector: the recurrent baseline. State (h, c) per layer; O(1) work and memory per event.

One nn.LSTM holds the weights. Training runs it over packed sequences (right-padding never enters the
state, and the final (h, c) is each account's state after its own last event); serving runs the same
parameters one event at a time through torch.lstm_cell, layer by layer (the same math as nn.LSTM, ~25%
less overhead per call than nn.LSTM over a sequence of one).
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from models.contract import DetectorConfig, RecurrentDetector, State, where_state
from models.encoder import EventEncoder, ScoreHead, dropout


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
