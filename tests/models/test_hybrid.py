"""A hybrid with fitted trees keeps the recurrent contract: its trees read one event at a time, so forward,
step and step_in_place agree, its state is its base's, and it survives the artifact round trip."""

import numpy as np
import pytest
import torch
from sklearn.ensemble import HistGradientBoostingClassifier

from models.contract import gather_states
from models.hybrid import HybridConfig, HybridDetector
from models.parity import random_events, step_through, step_vs_forward_error
from models.registry import build_detector, hybrid_base_config
from pipeline.features.definitions import FEATURE_NAMES
from pipeline.features.spec import FeatureSpec
from pipeline.registry.artifact import load_model_dir, save_model_dir
from pipeline.training.hybrid_head import tree_arrays

F = len(FEATURE_NAMES)


def fitted_hybrid(base: str = "lstm", seed: int = 0, **overrides) -> HybridDetector:
    """A hybrid over a tiny `base` (config overrides apply to both), its trees fitted on random rows
    [features, base score]."""
    torch.manual_seed(seed)
    unfitted = (
        build_detector("hybrid", HybridConfig.tiny(num_features=F, base=base, **overrides)).double().eval()
    )
    x = random_events(unfitted, 8, 40, seed=seed)
    with torch.no_grad():
        scores, _ = unfitted(x)  # the base scores: the head is not fitted yet
    rows = torch.cat([x[..., :-1], scores[..., None]], -1).reshape(-1, F + 1).float().numpy()
    target = rows[:, 0] + 3 * rows[:, -1] + np.random.default_rng(seed).normal(size=len(rows)) > 0.5
    arrays = tree_arrays(HistGradientBoostingClassifier(max_iter=20, random_state=seed).fit(rows, target))
    T, M = arrays.feature.shape
    sizes = {"trees": T, "tree_nodes": M, "tree_depth": arrays.depth}
    config = HybridConfig.tiny(num_features=F, base=base, **overrides, **sizes)
    hybrid = HybridDetector(config, unfitted.base)
    hybrid.fit_head(arrays)
    return hybrid.double().eval()


@pytest.mark.parametrize("base", ["lstm", "linear_transformer"])
def test_fitted_hybrid_steps_as_it_runs_in_parallel(base):
    hybrid = fitted_hybrid(base)
    x = random_events(hybrid, 6, 30, seed=1)
    lengths = torch.tensor([30, 29, 1, 0, 17, 30])
    assert step_vs_forward_error(hybrid, x, lengths) < 1e-9
    _, final = step_through(hybrid, x, lengths=lengths)
    _, base_final = hybrid.base(x, lengths=lengths)
    for key in final:  # the hybrid's state is its base's, exactly
        torch.testing.assert_close(final[key], base_final[key])
    base_scores, _ = hybrid.base(x)
    assert not torch.allclose(hybrid(x)[0], base_scores)  # the trees do score: not a pass-through


def test_fitted_hybrid_step_in_place_equals_step():
    hybrid = fitted_hybrid()
    x = random_events(hybrid, 1, 12, seed=2)[0]  # [N, F]: events of 3 accounts, interleaved
    rows = torch.tensor([0, 2, 0, 1, 1, 0, 2, 2, 0, 1, 0, 0])
    table = hybrid.init_state(3)
    got = hybrid.step_in_place(x, table, rows)
    state = hybrid.init_state(3)
    for i, row in enumerate(rows.tolist()):
        index = torch.tensor([row])
        score, new = hybrid.step(x[i : i + 1], gather_states(state, index))
        torch.testing.assert_close(got[i : i + 1], score)
        for key in state:
            state[key][row] = new[key][0]
    for key in state:
        torch.testing.assert_close(table[key], state[key])


def test_fitted_hybrid_round_trips_through_the_artifact(tmp_path):
    hybrid = fitted_hybrid("linear_transformer").float()
    spec = FeatureSpec(mean=(0.0,) * F, std=(1.0,) * F)
    loaded = load_model_dir(save_model_dir(tmp_path / "model", hybrid, spec, {})).detector
    assert loaded.name == "hybrid" and bool(loaded.fitted)
    x = random_events(hybrid, 4, 20, seed=3)
    torch.testing.assert_close(loaded(x)[0], hybrid(x)[0])


def test_hybrid_config_names_its_base_and_refuses_another():
    config = HybridConfig(
        base="linear_transformer", base_extra={"num_heads": 2, "decay_per_event": [1.0, 0.5]}
    )
    assert hybrid_base_config(config).num_heads == 2
    assert HybridConfig.from_dict(config.to_dict()) == config  # JSON lists come back as the same config
    with pytest.raises(ValueError, match="not a sequence detector"):
        build_detector("hybrid", HybridConfig(base="hybrid"))
    with pytest.raises(ValueError, match="config names base"):
        HybridDetector(HybridConfig(base="lstm"), build_detector("transformer"))
