"""`bench trees`: every tree recipe over one detector's scores, the default row being train's own hybrid."""

import os
import re
import subprocess
import sys

import pytest
import torch

from models.lstm import LSTMConfig, LSTMDetector
from pipeline.bench.broker import REPO_ROOT
from pipeline.bench.tree_head import RECIPES
from pipeline.cli.commands import run_generate
from pipeline.data.generate import GenerateConfig
from pipeline.registry.artifact import save_model_dir
from pipeline.training.config import load_train_config
from pipeline.training.hybrid_head import fit_hybrid, score_window
from pipeline.training.prepared import prepare


@pytest.mark.slow
def test_tree_bench_rows_are_each_recipe_and_the_default_is_the_hybrid_train_builds(tmp_path):
    run_generate(GenerateConfig(accounts=250, days=45, seed=2), tmp_path / "data")
    cfg = load_train_config(tmp_path / "data", None, ["test_days=7"], model="lstm")
    ready = prepare(cfg)
    torch.manual_seed(0)  # an untrained base: its scores are noise, the trees learn from the features too
    base = LSTMDetector(LSTMConfig(d_model=8, num_layers=1, num_features=ready.spec.num_features)).eval()
    save_model_dir(tmp_path / "model", base, ready.spec, {"detector": "lstm"})

    argv = ["bench", "trees", "--data", str(tmp_path / "data"), "--model", str(tmp_path / "model")]
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # each recipe's line as it comes: "  NAME: test AP 0.491, 83 trees, 4 s", then the table
    rows = {name: (float(ap), int(trees)) for name, ap, trees in re.findall(
        r"^  (.+): test AP ([0-9.]+), (\d+) trees", done.stdout, flags=re.M
    )}  # fmt: skip
    assert list(rows) == [name for name, *_ in RECIPES], done.stdout
    assert all(0.0 <= ap <= 1.0 and trees >= 1 for ap, trees in rows.values())
    assert "lstm alone" in done.stdout  # the table: the base alone, then each recipe

    windows = ready.windows
    hybrid = fit_hybrid(base, ready.train_seqs, windows["train"], windows["validation"], cfg.seed)
    scored = ready.scored(score_window(hybrid, ready.test_seqs, windows["test"]))
    metrics, _ = ready.test_metrics(scored, 100, cfg.delay_days)
    default_ap, default_trees = rows[RECIPES[0][0]]
    assert default_trees == hybrid.config.trees
    assert abs(default_ap - metrics.ap) <= 1e-3
