"""`txsentinel bench trees`: how the hybrid's trees learn over one trained sequence detector, a row a recipe.

The detector (any model URI: a registered version, a run, a directory; a hybrid's base is taken) scores
every event of the training, validation and test windows once, each over its account's history, as
`train --model hybrid` does (pipeline/training/hybrid_head.py). Each recipe then fits trees over [the event's
features, that score] and is scored on the published protocol's test week. The first row is the default
recipe, so it is the hybrid `train` would build over this detector. docs/benchmarks.md, "The hybrid's trees".
"""

import time
from pathlib import Path

import numpy as np
import polars as pl

from models.hybrid import HybridDetector
from pipeline.data.dataset import require_labels
from pipeline.data.generate import FRAUD_SCENARIOS
from pipeline.registry.tracking import load_model
from pipeline.training.config import load_train_config
from pipeline.training.datamodule import Window
from pipeline.training.hybrid_head import fit_trees, head_rows, score_window
from pipeline.training.prepared import prepare

FAST = {"learning_rate": 0.1, "max_iter": 200, "monotone": False}  # the former default, as hist_gbdt's
LEAVES = {"min_samples_leaf": 200, "l2_regularization": 1.0}
# (name, fit_trees' settings, which rows the trees learn from, whether they see the base score)
RECIPES = (
    ("learning rate 0.05, monotone in the base score (the default)", {}, "train", True),
    ("0.05", {"monotone": False}, "train", True),
    ("0.05, leaves of >= 200 events, L2 1.0", {"monotone": False, **LEAVES}, "train", True),
    ("0.05, monotone, leaves of >= 200 events, L2 1.0", LEAVES, "train", True),
    ("0.1", FAST, "train", True),
    ("0.1, monotone", {**FAST, "monotone": True}, "train", True),
    ("0.1, stopped 30 trees past the best", {**FAST, "n_iter_no_change": 30}, "train", True),
    ("0.1, no early stop", {**FAST, "stop_early": False}, "train", True),
    ("0.1, on the validation week alone", {**FAST, "stop_early": False}, "validation", True),
    ("the default on the features alone (no base score)", {"monotone": False}, "train", False),
)


def run_tree_bench(data: Path, model_uri: str, test_days: int = 7) -> pl.DataFrame:
    """One row a recipe (RECIPES): trees fitted over `model_uri`'s scores on `data`, tested on the protocol."""
    model = load_model(model_uri)
    base = model.detector.base if isinstance(model.detector, HybridDetector) else model.detector
    require_labels(data, "the trees are fitted and tested on known fraud")
    cfg = load_train_config(data, None, [f"test_days={test_days}"], model=base.name)
    ready = prepare(cfg, model.spec)
    windows = ready.windows
    started = time.perf_counter()
    history = score_window(
        base, ready.train_seqs, Window(windows["train"].start_us, windows["validation"].end_us)
    )
    test = score_window(base, ready.test_seqs, windows["test"])
    print(f"{base.name} scored the three windows in {time.perf_counter() - started:.0f} s", flush=True)
    rows = {name: head_rows(ready.train_seqs, history, windows[name]) for name in ("train", "validation")}
    x_test, _ = head_rows(ready.test_seqs, test, windows["test"])
    in_test = ~np.isnan(test)
    table = [
        _row(
            f"{base.name} alone", None, 0.0, *ready.test_metrics(ready.scored(test), cfg.cp_k, cfg.delay_days)
        )
    ]
    for name, settings, fitted_on, with_score in RECIPES:
        columns = slice(None) if with_score else slice(0, -1)
        (x, y), (x_val, y_val) = rows[fitted_on], rows["validation"]
        started = time.perf_counter()
        trees = fit_trees(x[:, columns], y, x_val[:, columns], y_val, cfg.seed, **settings)
        seconds = time.perf_counter() - started
        scores = np.full(len(test), np.nan, dtype=np.float32)
        scores[in_test] = trees.decision_function(x_test[:, columns])
        table.append(
            _row(
                name,
                trees.n_iter_,
                seconds,
                *ready.test_metrics(ready.scored(scores), cfg.cp_k, cfg.delay_days),
            )
        )
        print(f"  {name}: test AP {table[-1]['ap']:.3f}, {trees.n_iter_} trees, {seconds:.0f} s", flush=True)
    return pl.DataFrame(table)


def _row(name: str, trees: int | None, seconds: float, metrics, scenarios: dict) -> dict:
    return {
        "trees": name,
        "kept": trees,
        "auc": round(metrics.auc, 3),
        "ap": round(metrics.ap, 3),
        "cp@100": round(metrics.cp_at_k, 3),
        **{f"ap {s}": round(scenarios.get(f"test/ap/{s}", float("nan")), 3) for s in FRAUD_SCENARIOS},
        "fit s": round(seconds, 1),
    }


def print_tree_table(table: pl.DataFrame) -> None:
    with pl.Config(
        tbl_rows=-1, tbl_cols=-1, tbl_hide_dataframe_shape=True, tbl_width_chars=250, fmt_str_lengths=70
    ):
        print(table)
