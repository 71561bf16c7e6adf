"""models/attribution.py over every registered detector: the terms add up to the logit, the path integral
converges, an input at its mean gets nothing, and the state is held fixed (the history term is the state's)."""

import pytest
import torch

from models.attribution import attribute
from models.parity import random_events, step_through
from tests.models.helpers import DETECTORS, make_detector


@pytest.fixture(params=DETECTORS)
def name(request) -> str:
    return request.param


def _events_and_states(detector, accounts: int = 4, history: int = 12):
    # x [B, F + 1] the alerted events, and each account's state after `history` earlier events
    past = random_events(detector, accounts, history + 1, seed=5)
    with torch.inference_mode():
        _, state = step_through(detector, past[:, :-1])
    return past[:, -1], state


def test_terms_add_up_to_the_logit_and_the_integral_converges(name):
    detector = make_detector(name, torch.float64)
    x, state = _events_and_states(detector)
    with torch.inference_mode():  # as the scorer calls it
        coarse = attribute(detector, x, state, steps=8)
        fine = attribute(detector, x, state, steps=1024)  # ReLU kinks (encoder, FFNs) slow the midpoint rule
        logit, _ = detector.step(x, state)
    for a in (coarse, fine):
        total = a.base + a.history + a.inputs.sum(-1) + a.residual
        torch.testing.assert_close(total, logit, atol=1e-9, rtol=0)
        torch.testing.assert_close(a.logit, logit, atol=1e-9, rtol=0)
    spread = (fine.logit - fine.base - fine.history).abs().max()
    assert fine.residual.abs().max() <= 1e-3 * max(float(spread), 1.0)
    assert fine.residual.abs().max() < coarse.residual.abs().max()
    assert fine.inputs.shape == (len(x), detector.config.num_features)


def test_one_input_away_from_its_mean_takes_the_whole_difference_with_its_sign(name):
    detector = make_detector(name, torch.float64)
    x, state = _events_and_states(detector)
    only = torch.zeros_like(x)
    only[:, 2] = torch.tensor([3.0, -3.0, 0.5, 6.0])  # feature 2 only, both signs
    only[:, -1] = x[:, -1]
    a = attribute(detector, only, state, steps=1024)
    others = torch.cat([a.inputs[:, :2], a.inputs[:, 3:]], dim=1)
    assert torch.equal(others, torch.zeros_like(others))  # at the mean: exactly nothing
    with torch.no_grad():
        at_mean, _ = detector.step(torch.where(torch.arange(x.shape[1]) == 2, 0.0, only), state)
    difference = a.logit - at_mean
    torch.testing.assert_close(a.inputs[:, 2] + a.residual, difference, atol=1e-9, rtol=0)
    assert (a.residual.abs() <= 0.01 * difference.abs() + 1e-6).all()  # ReLU kinks: not exactly 0
    moved = difference.abs() > 1e-6
    assert torch.equal(torch.sign(a.inputs[moved, 2]), torch.sign(difference[moved]))


def test_the_state_is_held_fixed_and_only_the_history_term_sees_it(name):
    detector = make_detector(name, torch.float64)
    x, state = _events_and_states(detector)
    before = {k: v.clone() for k, v in state.items()}
    fresh = detector.init_state(len(x))
    with_history = attribute(detector, x, state)
    without = attribute(detector, x, fresh)
    assert all(torch.equal(state[k], before[k]) for k in state)  # nothing modified
    torch.testing.assert_close(without.history, torch.zeros(len(x), dtype=x.dtype), atol=1e-12, rtol=0)
    torch.testing.assert_close(with_history.base, without.base, atol=1e-12, rtol=0)
    assert with_history.history.abs().max() > 1e-6  # twelve events of history move an average event's score


def test_refuses_a_detector_in_training_mode():
    detector = make_detector(DETECTORS[0]).train()
    x, state = random_events(detector, 1, 1, seed=0)[:, 0], detector.init_state(1)
    with pytest.raises(ValueError, match="eval mode"):
        attribute(detector, x, state)


def test_a_fitted_hybrid_whose_trees_have_no_gradient_is_split_one_input_at_a_time():
    from tests.models.test_hybrid import fitted_hybrid  # trees fitted over a tiny base's scores

    hybrid = fitted_hybrid()
    assert not hybrid.score_has_gradient
    x, state = _events_and_states(hybrid)
    with torch.inference_mode():  # as the scorer calls it
        a = attribute(hybrid, x, state)
        logit, _ = hybrid.step(x, state)
        at_mean, _ = hybrid.step(torch.where(torch.arange(x.shape[1]) < x.shape[1] - 1, 0.0, x), state)
    torch.testing.assert_close(a.base + a.history + a.inputs.sum(-1) + a.residual, logit, atol=1e-9, rtol=0)
    torch.testing.assert_close(a.logit, logit, atol=1e-9, rtol=0)
    assert a.inputs.abs().max() > 1e-3  # the trees split on the inputs: they get shares, not all zeros
    # feature 0 is the one the trees were fitted to read: an event with it alone moved gives it everything
    only = torch.zeros_like(x)
    only[:, 0], only[:, -1] = torch.tensor([3.0, -3.0, 0.5, 6.0]), x[:, -1]
    b = attribute(hybrid, only, state)
    assert torch.equal(b.inputs[:, 1:], torch.zeros_like(b.inputs[:, 1:]))  # at the mean: exactly nothing
    with torch.no_grad():
        moved, _ = hybrid.step(only, state)
    torch.testing.assert_close(b.inputs[:, 0], moved - at_mean, atol=1e-9, rtol=0)
    torch.testing.assert_close(b.residual, torch.zeros_like(b.residual), atol=1e-9, rtol=0)
