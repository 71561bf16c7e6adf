"""Layers every detector shares: the event encoder in front, the score head behind, the Transformers' FFN; and
the most their outputs can be, from their weights, which bounds what a detector's state can hold.

The bounds (all [out] float64, per output unit, for any input) hold for the arithmetic of a dtype with machine
epsilon `eps`, not only for exact arithmetic: a dot product of n terms rounds by at most about n eps / 2 of
the sum of its terms' magnitudes (Higham's gamma_n), and each bound adds (n + 4) eps of that sum.
"""

import math

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

    def output_bound(self, eps: float) -> Tensor:
        """[d_model] the most |forward(x)| can be, for any x: the norm's, whatever went in, plus the FFN's."""
        normed = layer_norm_bound(self.norm, eps)
        return normed if self.ffn is None else normed + self.ffn.output_bound(eps)

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

    def output_bound(self, eps: float) -> Tensor:
        """[d_model] the most |forward(h)| can be, for any h (in eval mode: dropout scales nothing)."""
        hidden = normed_linear_bound(self.norm, self.up, eps)  # relu leaves 0..this
        return linear_bound(self.down.weight, self.down.bias, hidden, eps)


def linear_bound(weight: Tensor, bias: Tensor | None, inputs: Tensor, eps: float) -> Tensor:
    """[out] the most |weight x + bias| can be, weight [out, in], for any x with |x| <= inputs [in]."""
    total = weight.detach().double().abs() @ inputs.double()
    if bias is not None:
        total = total + bias.detach().double().abs()
    return total * (1 + (weight.shape[1] + 4) * eps)


def layer_norm_bound(norm: nn.LayerNorm, eps: float) -> Tensor:
    """[d] the most |norm(x)| can be, for any x: a normalised value u = (x - mean) / sqrt(var + norm.eps) has
    sum(u^2) <= d, so |u_m| <= sqrt(d - 1) (one value apart from d - 1 equal ones), times |gamma| plus
    |beta|."""
    d = norm.normalized_shape[-1]
    gamma, beta = _affine(norm)
    return (gamma.abs() * math.sqrt(d - 1) + beta.abs()) * (1 + (d + 4) * eps)


def normed_linear_bound(norm: nn.LayerNorm, linear: nn.Linear, eps: float) -> Tensor:
    """[out] the most |linear(norm(x))| can be, for any x. norm(x) = gamma u + beta with sum(u^2) <= d
    (layer_norm_bound), so linear's row w adds at most sqrt(d) ||w gamma||_2 (Cauchy-Schwarz) to the
    constant w beta + b; or at most layer_norm_bound term by term, whichever is less."""
    d = norm.normalized_shape[-1]
    gamma, beta = _affine(norm)
    weight = linear.weight.detach().double()  # [out, d]
    bias = torch.zeros(len(weight), dtype=torch.float64, device=weight.device)
    if linear.bias is not None:
        bias = linear.bias.detach().double()
    normed = layer_norm_bound(norm, 0.0)
    termwise = weight.abs() @ normed + bias.abs()
    least = torch.minimum(
        math.sqrt(d) * (weight * gamma).norm(dim=1) + (weight @ beta + bias).abs(), termwise
    )
    return least + termwise * 2 * (d + 4) * eps  # the rounding of the norm, then of the dot product


def key_value_bound(norm: nn.LayerNorm, qkv: nn.Linear, heads: int) -> tuple[Tensor, Tensor]:
    """The most |k| and |v| [H, D] of a pre-norm attention block's qkv(norm(h)) ([..., 3, H, D]), any h."""
    eps = torch.finfo(qkv.weight.dtype).eps
    _, k, v = normed_linear_bound(norm, qkv, eps).unflatten(0, (3, heads, -1)).unbind(0)
    return k, v


def _affine(norm: nn.LayerNorm) -> tuple[Tensor, Tensor]:
    """gamma and beta [d] float64 of a LayerNorm, 1 and 0 where it has none."""
    d = norm.normalized_shape[-1]
    gamma = torch.ones(d, dtype=torch.float64) if norm.weight is None else norm.weight.detach().double()
    beta = torch.zeros(d, dtype=torch.float64, device=gamma.device)
    if norm.bias is not None:
        beta = norm.bias.detach().double()
    return gamma, beta
