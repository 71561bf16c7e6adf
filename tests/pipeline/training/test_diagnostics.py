"""The parity a trained detector reports: a hybrid's trees may split between two float-equal base scores."""

import numpy as np
import torch

from models.hybrid import HybridConfig
from models.parity import random_events, step_through
from models.registry import build_detector, config_class
from models.tree_ensemble import TreeArrays
from pipeline.training.diagnostics import parity_over


def one_split_on_the_base_score(columns: int, threshold: float) -> TreeArrays:
    """One tree: -1 when the base score (the last column) is <= threshold, +1 above it."""
    return TreeArrays(
        feature=np.array([[columns - 1, 0, 0]]),
        threshold=np.array([[threshold, 0.0, 0.0]]),
        left=np.array([[1, 0, 0]]),
        right=np.array([[2, 0, 0]]),
        missing_left=np.array([[False, False, False]]),
        is_leaf=np.array([[False, True, True]]),
        value=np.array([[0.0, -1.0, 1.0]]),
        baseline=0.0,
        depth=1,
    )


def test_a_split_between_the_two_paths_base_scores_is_counted_apart_from_the_base_parity():
    torch.manual_seed(0)
    # A linear-attention base: its parallel and recurrent forms sum in other orders, so in float32 some
    # events score a few ulps apart on the two paths on any CPU.
    config = HybridConfig.tiny(base="linear_transformer", trees=1, tree_nodes=3, tree_depth=1)
    hybrid = build_detector("hybrid", config).eval()
    base = hybrid.base
    x = random_events(base, 1, 400)  # one account, as parity_over runs them
    with torch.inference_mode():
        whole, _ = base(x)
        stepped, _ = step_through(base, x)
    apart = (whole != stepped).nonzero()  # float32: the two paths sum in another order
    assert len(apart), "no event whose two base scores differ in float32; the test needs one"
    _, t = apart[0].tolist()
    low = min(whole[0, t].item(), stepped[0, t].item())  # goes left at the split; the other goes right
    hybrid.fit_head(one_split_on_the_base_score(config.num_features + 1, low))

    parity = parity_over(hybrid, [x])

    assert parity["test/parallel_vs_recurrent_max_abs"] < 1e-5  # the base's: the recurrent contract holds
    assert parity["test/hybrid_split_flips"] >= 1  # the event whose two scores straddle the split


def test_a_detector_that_is_not_a_hybrid_reports_no_split_flips():
    torch.manual_seed(0)
    lstm = build_detector("lstm", config_class("lstm").tiny())
    parity = parity_over(lstm, [random_events(lstm, 1, 50)])
    assert set(parity) == {"test/parallel_vs_recurrent_max_abs"}
    assert parity["test/parallel_vs_recurrent_max_abs"] < 1e-5
