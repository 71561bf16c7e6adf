"""Next-event pretraining: its loss counts what it says, and the score head steps aside and comes back (a
whole pretrained run: tests/pipeline/training/test_train.py)."""

import pytest
import torch

from models.registry import build_detector, config_class
from pipeline.training.pretraining import NextEventModule, next_event_loss


def test_next_event_loss_pairs_each_event_with_the_next_one_of_its_account_only():
    # 2 accounts x 4 events, 2 features and the terminal bucket; the second account has 2 events.
    x = torch.arange(24, dtype=torch.float32).reshape(2, 4, 3)
    x[..., -1] = 99.0  # the bucket column is not a target
    lengths = torch.tensor([4, 2])
    predictions = torch.zeros(2, 4, 2)
    error_sum, pairs = next_event_loss(predictions, x, lengths, clip=10.0)
    # Pairs: (0,1), (1,2), (2,3) of account 0 and (0,1) of account 1; targets clamped to 10.
    targets = [x[0, 1, :2], x[0, 2, :2], x[0, 3, :2], x[1, 1, :2]]
    expected = sum(t.clamp(max=10.0).pow(2).mean() for t in targets)
    assert int(pairs) == 4
    assert float(error_sum) == pytest.approx(float(expected))


@pytest.mark.parametrize("model", ["lstm", "transformer", "linear_transformer"])
def test_the_score_head_steps_aside_during_pretraining_and_comes_back_as_it_was(model):
    detector = build_detector(model, config_class(model).tiny())
    score_head = detector.head
    before = {k: v.clone() for k, v in score_head.state_dict().items()}
    module = NextEventModule(detector, learning_rate=1e-3, weight_decay=0.0, warmup_steps=1)
    x = torch.randn(3, 5, detector.config.num_features + 1)
    x[..., -1] = 0.0
    predictions, _ = detector(x)
    assert predictions.shape == (3, 5, detector.config.num_features)  # the next-event head's output
    assert module.restore_score_head() is detector and detector.head is score_head
    scores, _ = detector(x)
    assert scores.shape == (3, 5)
    assert all(torch.equal(before[k], v) for k, v in score_head.state_dict().items())
