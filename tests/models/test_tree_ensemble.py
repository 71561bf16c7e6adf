"""The tensor trees against the library that fitted them: the same raw score for every row, NaN included."""

import numpy as np
import pytest
import torch
from sklearn.ensemble import HistGradientBoostingClassifier

from models.tree_ensemble import TreeEnsemble
from pipeline.training.hybrid_head import tree_arrays


def fitted(rows: int = 4000, seed: int = 0, **params) -> tuple[HistGradientBoostingClassifier, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6)).astype(np.float32)
    x[rng.random(x.shape) < 0.05] = np.nan  # missing values take the side each node learnt
    logit = 2 * np.nan_to_num(x[:, 0]) - (np.nan_to_num(x[:, 1]) > 0.5) + np.nan_to_num(x[:, 2] * x[:, 3])
    y = rng.random(rows) < 1 / (1 + np.exp(-logit))
    return HistGradientBoostingClassifier(random_state=seed, **params).fit(x, y), x


def ensemble(model: HistGradientBoostingClassifier) -> TreeEnsemble:
    arrays = tree_arrays(model)
    module = TreeEnsemble(*arrays.feature.shape, arrays.depth)
    module.load_arrays(arrays)
    return module


@pytest.mark.parametrize("params", [{}, {"max_iter": 30, "max_leaf_nodes": 4}, {"max_depth": 2}])
def test_raw_scores_equal_the_fitted_library(params):
    model, x = fitted(**params)
    rng = np.random.default_rng(1)
    fresh = rng.normal(size=(2000, 6)).astype(np.float32)
    fresh[rng.random(fresh.shape) < 0.05] = np.nan
    for rows in (x, fresh):
        expected = model.decision_function(rows)
        got = ensemble(model)(torch.from_numpy(rows)).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_value_on_a_threshold_goes_where_the_library_sends_it():
    model, _ = fitted()
    arrays = tree_arrays(model)
    split = ~arrays.is_leaf[0]
    # Every threshold of the first tree as an input, and the float32 neighbours on each side.
    values = arrays.threshold[0][split].astype(np.float32)
    values = np.concatenate([values, np.nextafter(values, np.inf), np.nextafter(values, -np.inf)])
    rows = np.repeat(values[:, None], 6, axis=1)
    np.testing.assert_allclose(
        ensemble(model)(torch.from_numpy(rows)).numpy(), model.decision_function(rows), rtol=1e-5, atol=1e-5
    )


def test_a_module_refuses_an_ensemble_of_another_shape():
    model, _ = fitted(max_iter=5)
    arrays = tree_arrays(model)
    with pytest.raises(ValueError, match="does not fit"):
        TreeEnsemble(arrays.feature.shape[0] + 1, arrays.feature.shape[1], arrays.depth).load_arrays(arrays)
