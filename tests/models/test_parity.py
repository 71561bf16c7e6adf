"""models/parity.py, which the contract suite, the training diagnostics and the GPU check all measure with."""

import copy

import pytest
import torch

from models.parity import random_events, step_vs_forward_error
from tests.models.helpers import DETECTORS, make_detector


@pytest.mark.parametrize("name", DETECTORS)
def test_step_vs_forward_error_is_small_for_every_detector_and_sees_a_step_that_drifts(name):
    detector = make_detector(name)
    x = random_events(detector, 3, 20, seed=16)
    lengths = torch.tensor([20, 7, 0])
    assert step_vs_forward_error(detector, x) <= 1e-9
    assert step_vs_forward_error(detector, x, lengths) <= 1e-9

    class Drifting(type(detector)):  # serving that adds 0.5 to every score from its 8th step on
        steps = 0

        def step(self, x_t, state):
            scores, new_state = super().step(x_t, state)
            self.steps += 1
            return scores + (0.5 if self.steps > 7 else 0.0), new_state

    def drifting():
        copied = copy.deepcopy(detector)
        copied.__class__ = Drifting
        return copied

    assert step_vs_forward_error(drifting(), x) == pytest.approx(0.5, abs=1e-9)
    assert step_vs_forward_error(drifting(), x[1:2], torch.tensor([7])) <= 1e-9  # drift only on padding


def test_random_events_are_valid_inputs_the_same_in_any_dtype():
    wide, narrow = make_detector("lstm"), make_detector("lstm", torch.float32)
    x, y = random_events(wide, 4, 50, seed=3), random_events(narrow, 4, 50, seed=3)
    assert x.dtype == torch.float64 and y.dtype == torch.float32
    assert x.shape == (4, 50, wide.config.num_features + 1)
    assert torch.equal(x.float(), y)
    buckets = x[..., -1]
    assert torch.equal(buckets, buckets.round()) and buckets.min() >= 0 and buckets.max() < 16
    assert not torch.equal(x, random_events(wide, 4, 50, seed=4))
