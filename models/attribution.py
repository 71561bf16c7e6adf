"""Why a detector scored an event as it did: its logit split into terms that add up, the account state held fixed.

For one event x [F] (normalised numeric features, then the terminal bucket column) of an account whose state
before it is s, with f(x, s) the logit `step` gives:

    f(x, s) = base + history + sum_i inputs[i] + residual

    base     = f(x0, s0): an average event of an account with no history. x0 puts every normalised feature
               at 0, its training-period mean; s0 = init_state.
    history  = f(x0, s) - f(x0, s0): what the account's history, its recurrent state, adds to that event.
    inputs   = integrated gradients of f(., s) along the straight path x0 -> x (Sundararajan et al. 2017),
               the gradient x input of every numeric column averaged over the path: input i's share of
               f(x, s) - f(x0, s). An input at its mean gets exactly 0; an event that differs from x0 in one
               input gives that input the whole difference.
    residual = f(x, s) - f(x0, s) - sum_i inputs[i]: the quadrature's error (midpoint rule, `steps` points),
               returned so the terms add up to the logit exactly; it shrinks as steps grows.

One function for every detector: it needs only the contract's `step` and `init_state`, with autograd. The
terminal bucket column is an index, not a quantity: x0 keeps the event's own, so where a detector learns a
terminal embedding its effect lands in base and history. Shape letters: B events (one per account), S path
points, F numeric input columns.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from models.contract import RecurrentDetector, State

DEFAULT_STEPS = 32


class Attribution(NamedTuple):
    logit: Tensor  # [B] f(x, s)
    base: Tensor  # [B] f(x0, s0)
    history: Tensor  # [B] f(x0, s) - f(x0, s0)
    inputs: Tensor  # [B, F] each numeric column's share of f(x, s) - f(x0, s)
    residual: Tensor  # [B] what the path integral's quadrature leaves over


def attribute(
    detector: RecurrentDetector, x: Tensor, state: State, steps: int = DEFAULT_STEPS
) -> Attribution:
    """Split the logit of events x [B, F + 1], one per account with states `state` (a batch of B, each the
    state before its event), into base, history, per-input and residual terms (module docstring).

    Costs one `step` and its backward over B x steps rows, and one more step over 3B; nothing is modified.
    The detector must be in eval mode: dropout would make the terms random."""
    if detector.training:
        raise ValueError(
            f"{detector.name}: attribute() needs the detector in eval mode (detector.eval()); in training "
            "mode dropout makes every term random"
        )
    if steps < 1:
        raise ValueError(f"steps = {steps!r}: expected an integer >= 1 (points on the path x0 -> x)")
    B = len(x)
    # Serving code calls this under inference_mode, whose tensors cannot be saved for backward: fresh copies.
    with torch.inference_mode(False), torch.enable_grad():
        x = x.clone()
        state = {key: value.clone() for key, value in state.items()}
        x0 = torch.zeros_like(x)
        x0[:, -1] = x[:, -1]  # the terminal bucket stays the event's own
        alphas = (torch.arange(steps, dtype=x.dtype, device=x.device) + 0.5) / steps  # [S] midpoints
        path = (x0[None] + alphas[:, None, None] * (x - x0)[None]).reshape(steps * B, -1)  # [S * B, F + 1]
        path.requires_grad_(True)
        # row s * B + b of the path is event b's: its state repeated in the same order
        repeated = {key: value.repeat(steps, *([1] * (value.dim() - 1))) for key, value in state.items()}
        scores, _ = detector.step(path, repeated)  # [S * B]
        (grad,) = torch.autograd.grad(scores.sum(), path)
    with torch.no_grad():
        mean_grad = grad.view(steps, B, -1).mean(0)[:, :-1]  # [B, F]
        inputs = mean_grad * (x - x0)[:, :-1]
        empty = detector.init_state(B)
        both = {key: torch.cat([state[key], state[key], empty[key].to(state[key].dtype)]) for key in state}
        ends, _ = detector.step(torch.cat([x, x0, x0]), both)  # [3B]: f(x, s), f(x0, s), f(x0, s0)
        logit, at_mean, base = ends.view(3, B)
        residual = logit - at_mean - inputs.sum(-1)
    return Attribution(logit, base, at_mean - base, inputs, residual)
