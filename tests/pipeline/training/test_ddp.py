"""DDP for real, on CPU: `txsentinel train --set devices=2` (two processes, gloo) against one process.

Two ranks with B accounts a batch take, step for step, the batches of one process with 2B (the data module's
rounds), the gradient of the whole step (the loss is normalised by both ranks' count) and score every
validation and test account between them (scores are gathered before any metric). So the two runs must end
with the same weights, the same checkpoint and the same scores, up to float32 rounding.

The two-process run goes through the command line because Lightning's `ddp` launcher starts rank 1 by running
the same command again; `ddp_spawn` would run in-process but is not what `train` uses.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import polars as pl
import pytest
import torch

from models.registry import build_detector
from pipeline.cli.commands import run_generate
from pipeline.data.generate import GenerateConfig
from pipeline.evaluation.plots import SCORES_ARTIFACT
from pipeline.registry.tracking import load_model
from pipeline.training.config import load_train_config
from pipeline.training.train import train

ROOT = Path(__file__).resolve().parents[3]

# 39 accounts take part; 3 a batch make 13 groups, so the second rank sits out the last round on padding.
SETTINGS = [
    "max_epochs=2",  # the second epoch's shuffled order must match as well
    "pretrain_epochs=1",  # next-event pretraining goes through the same rounds and the same normalisation
    "chunk_events=16",
    "test_days=5",
    "delay_days=2",
    "validation_days=5",
    "progress_bar=false",
    "model_config.d_model=8",
    "model_config.num_layers=1",
    "model_config.dropout=0.0",
]
# Float32 sums in another order (a chunk's loss split over two ranks, the gloo all-reduce of the gradients)
# differ in the last bits, and 46 AdamW steps carry that along: here the weights (of order 1) agree to 6e-8
# and the test logits to 4e-7. The tolerances leave room for other CPUs and BLAS builds and stay far below
# what a wrong gradient does: with each rank's loss averaged over its own events the weights differ by 5e-3.
WEIGHT_ATOL = 1e-5  # and training moves them by about 5e-2, checked below
SCORE_ATOL = 1e-4


def store(db: Path) -> str:
    return f"sqlite:///{db}"


def use_store(monkeypatch, db: Path) -> None:
    """This process reads and writes MLflow in `db`: train() and load_model() take the variable, the fluent
    API (search_runs, download_artifacts) the tracking URI."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store(db))
    mlflow.set_tracking_uri(store(db))


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")  # two cores: one thread a process, and the same sums each run
def test_two_ddp_processes_train_what_one_process_with_both_ranks_accounts_trains(tmp_path, monkeypatch):
    run_generate(GenerateConfig(accounts=60, days=30, seed=3), tmp_path / "data")
    sets = [word for setting in SETTINGS for word in ("--set", setting)]
    command = [str(Path(sys.executable).parent / "txsentinel"), "train", "--data", "data", *sets]
    command += ["--set", "batch_accounts=3", "--set", "devices=2", "--set", "registered_model=ddp"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": store(tmp_path / "ddp.db"), "PYTHONPATH": str(ROOT)}
    env["OMP_NUM_THREADS"] = "1"
    # Rank 0 and the rank it launches train while this process trains alone, each into its own store.
    with open(tmp_path / "ddp.log", "w") as log:
        ddp = subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        monkeypatch.chdir(tmp_path)
        use_store(monkeypatch, tmp_path / "one.db")
        cfg = load_train_config(
            tmp_path / "data", None, [*SETTINGS, "batch_accounts=6", "registered_model=one"]
        )
        one = train(cfg)
        one_model = load_model("models:/one/1").detector
        one_scores = pl.read_parquet(
            mlflow.artifacts.download_artifacts(run_id=one.run_id, artifact_path=SCORES_ARTIFACT)
        )
        ddp.wait(timeout=300)
    finally:
        if ddp.poll() is None:  # this side failed: leave neither rank behind (rank 1 is rank 0's child)
            os.killpg(ddp.pid, signal.SIGKILL)
            ddp.wait()
    out = (tmp_path / "ddp.log").read_text()
    assert ddp.returncode == 0, out
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in out  # two processes really ran
    use_store(monkeypatch, tmp_path / "ddp.db")
    runs = mlflow.search_runs(experiment_names=[cfg.experiment])
    assert len(runs) == 1, "a rank other than 0 opened an MLflow run of its own"
    ddp_run = mlflow.get_run(runs["run_id"][0])
    ddp_model = load_model("models:/ddp/1").detector
    ddp_scores = pl.read_parquet(
        mlflow.artifacts.download_artifacts(run_id=ddp_run.info.run_id, artifact_path=SCORES_ARTIFACT)
    )

    torch.manual_seed(cfg.seed)  # train() seeds, then builds the detector: its weights before training
    initial = build_detector(cfg.model, one_model.config).state_dict()
    trained, twin = one_model.state_dict(), ddp_model.state_dict()
    moved = max(float((trained[k] - initial[k]).abs().max()) for k in trained)
    assert moved > 1e3 * WEIGHT_ATOL, (
        f"training moved the weights by {moved} only: the comparison shows nothing"
    )
    for key in trained:
        torch.testing.assert_close(
            twin[key], trained[key], rtol=0, atol=WEIGHT_ATOL, msg=lambda m, key=key: f"{key}: {m}"
        )

    # The same best epoch, the same threshold, and every test event scored: rank 1's accounts too.
    for metric in ("val/ap", "val/threshold", "train/epochs"):
        assert ddp_run.data.metrics[metric] == pytest.approx(one.metrics[metric], abs=1e-6), metric
    assert ddp_scores.height == one_scores.height > 0
    joined = one_scores.join(ddp_scores, on="event_id", how="left", suffix="_ddp")
    assert joined["score_ddp"].null_count() == 0
    np.testing.assert_allclose(
        joined["score_ddp"].to_numpy(), joined["score"].to_numpy(), rtol=0, atol=SCORE_ATOL
    )
