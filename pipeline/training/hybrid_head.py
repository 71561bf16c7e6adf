"""The hybrid's second stage: gradient-boosted trees over [event features, the trained base detector's score].

After the base detector has trained (and its best weights are back), every event of the training and
validation windows is scored by the base over its account's full history, exactly as the test is. The trees
fit on the training window and stop adding trees when the validation window's loss stops falling. The base
scores of the training window are in-sample (the base learnt from those events), which makes them look
surer than they will be next week; the validation window, which the base never trained on, is what decides
how many trees to keep.
"""

import dataclasses

import numpy as np
import torch
from sklearn.ensemble import HistGradientBoostingClassifier

from models.contract import DetectorConfig, RecurrentDetector
from models.hybrid import HybridConfig, HybridDetector
from models.tree_ensemble import TreeArrays
from pipeline.training.datamodule import ChunkedHistories, Window
from pipeline.training.sequences import AccountSequences

# The trees learn slowly and stop on the validation week: the training window's base scores are in-sample,
# so trees that chase them (learning rate 0.1, or no early stop) fit the base's certainty about events it
# has already seen; on the Handbook-scale data the test AP then swung from 0.60 to 0.79 with the number of
# trees, where at 0.05 it held at 0.80 (docs/benchmarks.md, "The hybrid's trees").
TREES = {"learning_rate": 0.05, "max_iter": 600}
SCORE_CHUNK_EVENTS = 256
SCORE_BATCH_ACCOUNTS = 256


@torch.no_grad()
def score_window(detector: RecurrentDetector, seqs: AccountSequences, window: Window) -> np.ndarray:
    """[N] float32 scores of the events in `window` (NaN elsewhere), each over its account's history."""
    scores = np.full(len(seqs.x), np.nan, dtype=np.float32)
    batches = ChunkedHistories(seqs, window, SCORE_BATCH_ACCOUNTS, SCORE_CHUNK_EVENTS, shuffle=False)
    detector = detector.eval()
    state = None
    for i in range(len(batches)):
        batch = batches[i]
        if bool(batch["first_chunk"]):
            state = None
        x = batch["x"].to(detector.device, detector.state_dtype)
        out, state = detector(x, state, batch["lengths"].to(detector.device))  # [B, T]
        rows = batch["rows"]
        counted = rows >= 0
        scores[rows[counted].numpy()] = out.cpu()[counted].float().numpy()
    return scores


def tree_arrays(model: HistGradientBoostingClassifier) -> TreeArrays:
    """A fitted binary HistGradientBoostingClassifier as padded node arrays (its raw decision function)."""
    trees = [iteration[0].nodes for iteration in model._predictors]  # one tree an iteration (binary)
    if any(t["is_categorical"].any() for t in trees):
        raise ValueError("tree head: categorical splits are not supported; fit on numeric features only")
    M = max(len(t) for t in trees)

    def padded(column: str, fill, dtype) -> np.ndarray:
        out = np.full((len(trees), M), fill, dtype=dtype)
        for i, t in enumerate(trees):
            out[i, : len(t)] = t[column]
        return out

    return TreeArrays(
        feature=padded("feature_idx", 0, np.int64),
        threshold=padded("num_threshold", 0.0, np.float64),
        left=padded("left", 0, np.int64),
        right=padded("right", 0, np.int64),
        missing_left=padded("missing_go_to_left", False, bool),
        is_leaf=padded("is_leaf", True, bool),
        value=padded("value", 0.0, np.float64),
        baseline=float(np.ravel(model._baseline_prediction)[0]),
        depth=max(1, *(int(t["depth"].max()) for t in trees)),  # >= 1: the module always takes a round
    )


def head_rows(seqs: AccountSequences, scores: np.ndarray, window: Window) -> tuple[np.ndarray, np.ndarray]:
    """(rows [n, F + 1] = features then base score, known targets [n]) of the events in `window`."""
    inside = (seqs.ts_us >= window.start_us) & (seqs.ts_us < window.end_us)
    rows = np.concatenate([seqs.x[inside], scores[inside, None]], axis=1).astype(np.float32)
    return rows, seqs.target[inside] > 0.5


def fit_trees(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_val: np.ndarray,
    y_val: np.ndarray,
    seed: int = 0,
    monotone: bool = True,
    stop_early: bool = True,
    **recipe,
) -> HistGradientBoostingClassifier:
    """Trees over head rows (head_rows), stopped early on the validation rows when they hold a fraud;
    `recipe` overrides TREES (scikit-learn's parameters), `monotone` keeps the base score's effect >= 0."""
    if not y_train.any():
        raise ValueError("hybrid: no known fraud in the training window: the trees have nothing to learn")
    stop = stop_early and bool(y_val.any())
    trees = HistGradientBoostingClassifier(
        **{**TREES, **recipe},
        # a higher base score never lowers the hybrid's (the last column is the base score)
        monotonic_cst=[0] * (x_train.shape[1] - 1) + [1] if monotone else None,
        early_stopping=stop,
        random_state=seed,
    )
    return trees.fit(x_train, y_train, **({"X_val": x_val, "y_val": y_val} if stop else {}))


def fit_hybrid(
    base: RecurrentDetector, seqs: AccountSequences, train: Window, validation: Window, seed: int = 0
) -> HybridDetector:
    """The hybrid of a trained `base` and trees fitted on `train`, stopped early on `validation`."""
    scores = score_window(base, seqs, Window(train.start_us, validation.end_us))
    x_train, y_train = head_rows(seqs, scores, train)
    x_val, y_val = head_rows(seqs, scores, validation)
    trees = fit_trees(x_train, y_train, x_val, y_val, seed)
    arrays = tree_arrays(trees)
    T, M = arrays.feature.shape
    shared = {f.name for f in dataclasses.fields(DetectorConfig)}
    base_config = base.config.to_dict()
    config = HybridConfig(
        **{k: v for k, v in base_config.items() if k in shared},
        base=base.name,
        base_extra={k: v for k, v in base_config.items() if k not in shared},
        trees=T,
        tree_nodes=M,
        tree_depth=arrays.depth,
    )
    hybrid = HybridDetector(config, base)
    hybrid.fit_head(arrays)
    return hybrid.to(base.device)
