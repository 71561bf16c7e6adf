"""Why a detector scored an event as it did: its logit split into terms that add up, the account state held fixed.

For one event x [F] (normalised numeric features, then the terminal bucket column) of an account whose state
before it is s, with f(x, s) the logit `step` gives:

    f(x, s) = base + history + sum_i inputs[i] + residual

    base     = f(x0, s0): an average event of an account with no history. x0 puts every normalised feature
               at 0, its training-period mean; s0 = init_state.
    history  = f(x0, s) - f(x0, s0): what the account's history, its recurrent state, adds to that event.
    inputs   = input i's share of f(x, s) - f(x0, s). An input at its mean gets exactly 0; an event that
               differs from x0 in one input gives that input the whole difference. Two ways, by the
               detector's `score_has_gradient`:
               - a network: integrated gradients of f(., s) along the straight path x0 -> x (Sundararajan et
                 al. 2017), the gradient x input of every numeric column averaged over the path;
               - a score that is piecewise constant in its inputs (a hybrid's fitted trees, whose gradient is
                 0 almost everywhere and which run without autograd): one input moved at a time, half what
                 setting it to the event's value adds to the average event, half what setting it back to
                 its mean takes from this event,
                     inputs[i] = (f(x0 with x_i, s) - f(x0, s) + f(x, s) - f(x with x0_i, s)) / 2,
                 the Shapley value of input i over the empty and the full coalitions only: exact for a score
                 that adds its inputs' effects, and what inputs do only together lands in the residual.
    residual = f(x, s) - f(x0, s) - sum_i inputs[i], returned so the terms add up to the logit exactly:
               integrated gradients' quadrature error (midpoint rule, `steps` points), which shrinks as steps
               grows; moving one input at a time, the interactions of the inputs, however many steps.

One function for every detector: it needs only the contract's `step` and `init_state`, with autograd where
the score has a gradient. The terminal bucket column is an index, not a quantity: x0 keeps the event's own,
so where a detector learns a terminal embedding its effect lands in base and history. Shape letters: B
events (one per account), S path points, F numeric input columns.
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
    residual: Tensor  # [B] what the inputs' terms leave over (quadrature error, or their interactions)


def attribute(
    detector: RecurrentDetector, x: Tensor, state: State, steps: int = DEFAULT_STEPS
) -> Attribution:
    """Split the logit of events x [B, F + 1], one per account with states `state` (a batch of B, each the
    state before its event), into base, history, per-input and residual terms (module docstring).

    Integrated gradients cost one `step` and its backward over B x steps rows; moving one input at a time
    (a detector whose score has no gradient: `steps` is not used), one step over B x 2F rows. Then one more
    step over 3B; nothing is modified. The detector must be in eval mode: dropout would make the terms
    random."""
    if detector.training:
        raise ValueError(
            f"{detector.name}: attribute() needs the detector in eval mode (detector.eval()); in training "
            "mode dropout makes every term random"
        )
    if steps < 1:
        raise ValueError(f"steps = {steps!r}: expected an integer >= 1 (points on the path x0 -> x)")
    with torch.no_grad():
        x0 = torch.zeros_like(x)
        x0[:, -1] = x[:, -1]  # the terminal bucket stays the event's own
    if detector.score_has_gradient:
        inputs = _integrated_gradients(detector, x, x0, state, steps)
    else:
        inputs = _one_at_a_time(detector, x, x0, state)
    with torch.no_grad():
        B = len(x)
        empty = detector.init_state(B)
        both = {key: torch.cat([state[key], state[key], empty[key].to(state[key].dtype)]) for key in state}
        ends, _ = detector.step(torch.cat([x, x0, x0]), both)  # [3B]: f(x, s), f(x0, s), f(x0, s0)
        logit, at_mean, base = ends.view(3, B)
        residual = logit - at_mean - inputs.sum(-1)
    return Attribution(logit, base, at_mean - base, inputs, residual)


def _repeated(state: State, times: int) -> State:
    # each account's state `times` times over, in the same order: row k * B + b is account b's
    return {key: value.repeat(times, *([1] * (value.dim() - 1))) for key, value in state.items()}


def _integrated_gradients(
    detector: RecurrentDetector, x: Tensor, x0: Tensor, state: State, steps: int
) -> Tensor:
    # x, x0 [B, F + 1] -> inputs [B, F]: the path integral of the gradient, midpoint rule over `steps` points
    B = len(x)
    # Serving code calls this under inference_mode, whose tensors cannot be saved for backward: fresh copies.
    with torch.inference_mode(False), torch.enable_grad():
        x, x0 = x.clone(), x0.clone()
        state = {key: value.clone() for key, value in state.items()}
        alphas = (torch.arange(steps, dtype=x.dtype, device=x.device) + 0.5) / steps  # [S] midpoints
        path = (x0[None] + alphas[:, None, None] * (x - x0)[None]).reshape(steps * B, -1)  # [S * B, F + 1]
        path.requires_grad_(True)
        scores, _ = detector.step(path, _repeated(state, steps))  # [S * B]
        if not scores.requires_grad:
            raise RuntimeError(
                f"{detector.name}: its score has no gradient with respect to its inputs, yet the detector "
                "says score_has_gradient; a detector scored without autograd must say False"
            )
        (grad,) = torch.autograd.grad(scores.sum(), path)
    with torch.no_grad():
        mean_grad = grad.view(steps, B, -1).mean(0)[:, :-1]  # [B, F]
        return mean_grad * (x - x0)[:, :-1]


@torch.no_grad()
def _one_at_a_time(detector: RecurrentDetector, x: Tensor, x0: Tensor, state: State) -> Tensor:
    # x, x0 [B, F + 1] -> inputs [B, F]: each numeric column moved alone, from x0 and back from x
    B, F = x.shape[0], x.shape[1] - 1
    alone = torch.eye(F + 1, dtype=torch.bool, device=x.device)[:F, None, :]  # [F, 1, F + 1] column i
    added = torch.where(alone, x[None], x0[None])  # [F, B, F + 1] x0 with x_i
    removed = torch.where(alone, x0[None], x[None])  # [F, B, F + 1] x with x0_i
    rows = torch.cat([added, removed, x[None], x0[None]]).reshape((2 * F + 2) * B, F + 1)
    # f(x, s) and f(x0, s) in the same call as the moved rows: the differences see the same float path
    scores, _ = detector.step(rows, _repeated(state, 2 * F + 2))
    scores = scores.view(2 * F + 2, B)
    with_one, without_one, at_x, at_mean = scores[:F], scores[F : 2 * F], scores[-2], scores[-1]
    inputs = ((with_one - at_mean) + (at_x - without_one)).T / 2  # [B, F]
    return torch.where(x[:, :-1] == x0[:, :-1], 0.0, inputs)  # an input at its mean: exactly nothing
