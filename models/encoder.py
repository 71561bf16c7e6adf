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

    def projected_bound(self, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
        """[out] the most |weight forward(x) + bias| can be, for any x, weight [out, d_model]: through the
        norm by Cauchy-Schwarz (normed_linear_bound; term by term on the norm's own bound, sqrt(d) ||w||_1
        against sqrt(d) ||w||_2, is several times looser), plus the FFN's (FeedForward.projected_bound)."""
        bound = normed_linear_bound(self.norm, weight, bias, eps)
        return bound if self.ffn is None else bound + self.ffn.projected_bound(weight, eps)

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
        hidden = normed_linear_bound(self.norm, self.up.weight, self.up.bias, eps)  # relu leaves 0..this
        return linear_bound(self.down.weight, self.down.bias, hidden, eps)

    def projected_bound(self, weight: Tensor, eps: float) -> Tensor:
        """[out] the most |weight forward(h)| can be, for any h, weight [out, d_model]. forward(h) = down r + b
        with r = relu(up(norm(h))) in [0, R] (R [hidden]: normed_linear_bound), so weight forward(h) = M r +
        weight b, M = weight down, lies in weight b + [-relu(-M) R, relu(M) R]: far tighter than |weight|
        times output_bound where M's rows mix signs. Rounding adds at most (hidden + d + 10) eps of the
        latter: forward's own (hidden + 4), the product's (d + 4), the sum with the norm's output (1)."""
        hidden = normed_linear_bound(self.norm, self.up.weight, self.up.bias, eps)  # [hidden]
        weight = weight.detach().double()  # [out, d]
        m = weight @ self.down.weight.detach().double()  # [out, hidden]
        constant = weight @ self.down.bias.detach().double()  # [out]
        highest = constant + m.clamp(min=0) @ hidden
        lowest = constant - (-m).clamp(min=0) @ hidden
        rounding = (weight.abs() @ self.output_bound(eps)) * (len(hidden) + weight.shape[1] + 10) * eps
        return torch.maximum(highest.abs(), lowest.abs()) + rounding


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


def normed_linear_bound(norm: nn.LayerNorm, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """[out] the most |weight norm(x) + bias| can be, for any x, weight [out, d]. norm(x) = gamma u + beta
    with sum(u^2) <= d (layer_norm_bound), so a row w adds at most sqrt(d) ||w gamma||_2 (Cauchy-Schwarz) to
    the constant w beta + b; or at most layer_norm_bound term by term, whichever is less."""
    d = norm.normalized_shape[-1]
    gamma, beta = _affine(norm)
    weight = weight.detach().double()  # [out, d]
    bias = torch.zeros(len(weight), dtype=torch.float64, device=weight.device) if bias is None else bias
    bias = bias.detach().double()
    normed = layer_norm_bound(norm, 0.0)
    termwise = weight.abs() @ normed + bias.abs()
    least = torch.minimum(
        math.sqrt(d) * (weight * gamma).norm(dim=1) + (weight @ beta + bias).abs(), termwise
    )
    return least + termwise * 2 * (d + 4) * eps  # the rounding of the norm, then of the dot product


def key_value_bound(norm: nn.LayerNorm, qkv: nn.Linear, heads: int) -> tuple[Tensor, Tensor]:
    """The most |k| and |v| [H, D] of a pre-norm attention block's qkv(norm(h)) ([..., 3, H, D]), any h."""
    eps = torch.finfo(qkv.weight.dtype).eps
    _, k, v = normed_linear_bound(norm, qkv.weight, qkv.bias, eps).unflatten(0, (3, heads, -1)).unbind(0)
    return k, v


def _affine(norm: nn.LayerNorm) -> tuple[Tensor, Tensor]:
    """gamma and beta [d] float64 of a LayerNorm, 1 and 0 where it has none."""
    d = norm.normalized_shape[-1]
    gamma = torch.ones(d, dtype=torch.float64) if norm.weight is None else norm.weight.detach().double()
    beta = torch.zeros(d, dtype=torch.float64, device=gamma.device)
    if norm.bias is not None:
        beta = norm.bias.detach().double()
    return gamma, beta
