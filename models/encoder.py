"""Layers every detector shares: the event encoder in front, the score head behind, the Transformers' FFN."""

import torch
from torch import Tensor, nn

from models.contract import DetectorConfig


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """nn.functional.dropout, minus its call overhead when it would do nothing (serving steps)."""
    return nn.functional.dropout(x, p, True) if training and p > 0 else x


class EventEncoder(nn.Module):
    """One event [..., F] -> [..., d_model]: numeric columns projected (plus the terminal bucket's embedding
    where the config has one), normed, then (config.encoder_ffn) h + FFN(h), a per-event MLP in front of the
    sequence layers.

    The last input column holds the terminal bucket index as a float, checked to be in range whether or not
    it is embedded; the others are normalised features, clamped to [-input_clip, input_clip] first so an
    extreme value (an amount of 1e9 that normalisation did not tame, an inf) cannot blow up activations or
    the recurrent state.
    """

    def __init__(self, config: DetectorConfig):
        super().__init__()
        self.clip = float(config.input_clip)
        self.buckets = config.terminal_buckets
        self.numeric = nn.Linear(config.num_features, config.d_model)
        self.embeds_terminal = config.terminal_embedding
        if self.embeds_terminal:
            self.terminal = nn.Embedding(config.terminal_buckets, config.d_model)
        self.norm = nn.LayerNorm(config.d_model)
        self.ffn = (
            FeedForward(config.d_model, 4 * config.d_model, config.dropout) if config.encoder_ffn else None
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.numeric(x[..., :-1].clamp(-self.clip, self.clip))
        bucket = x[..., -1].long()
        # On CPU an embedding's lookup raises on an out-of-range index at no cost. Elsewhere it is checked
        # first (one reduction and a sync): on CUDA a bad index is a device-side assert that poisons the whole
        # CUDA context. Without an embedding the column is checked all the same: it is part of the input.
        checked_by_lookup = self.embeds_terminal and bucket.device.type == "cpu"
        if not checked_by_lookup and self._out_of_range(bucket).any():
            raise self._bad_bucket(bucket)
        if self.embeds_terminal:
            try:
                h = h + self.terminal(bucket)
            except IndexError:
                raise self._bad_bucket(bucket) from None
        h = self.norm(h)
        return h if self.ffn is None else h + self.ffn(h)

    def _out_of_range(self, bucket: Tensor) -> Tensor:
        return (bucket < 0) | (bucket >= self.buckets)

    def _bad_bucket(self, bucket: Tensor) -> ValueError:
        bad = bucket[self._out_of_range(bucket)][0].item()
        return ValueError(
            f"terminal bucket index {bad} is outside [0, {self.buckets}): the last input column must hold "
            "the terminal bucket (pipeline.features TERMINAL_BUCKET_COLUMN) as an integer, and the model "
            "must be built with the feature spec's number of buckets (config.terminal_buckets)"
        )


class ScoreHead(nn.Module):
    """[..., d_model] -> logit [...]."""

    def __init__(self, d_model: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, 1)

    def forward(self, h: Tensor) -> Tensor:
        return self.out(self.norm(h)).squeeze(-1)


class FeedForward(nn.Module):
    """Position-wise MLP of a pre-norm Transformer block (its own LayerNorm in front).

    ReLU, as in fast-transformers' layers for the linear Transformer paper: on CPU at serving batch sizes
    exact GELU costs ~4x as much per call, and the step budget is a few milliseconds.
    """

    def __init__(self, d_model: int, hidden: int, dropout_p: float):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.up = nn.Linear(d_model, hidden)
        self.down = nn.Linear(hidden, d_model)
        self.dropout = dropout_p

    def forward(self, h: Tensor) -> Tensor:
        out = self.down(torch.relu(self.up(self.norm(h))))
        return dropout(out, self.dropout, self.training)
