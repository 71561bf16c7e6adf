"""Training end to end on CPU: Lightning, MLflow tracking and registry, the loader in a fresh process."""

import json
import subprocess
import sys

import mlflow
import numpy as np
import polars as pl
import pytest
import torch

from pipeline.cli.commands import run_generate
from pipeline.data.dataset import read_dataset, write_dataset
from pipeline.data.generate import GenerateConfig
from pipeline.evaluation.plots import SCORES_ARTIFACT
from pipeline.registry.tracking import load_model, promote
from pipeline.training.config import load_train_config
from pipeline.training.train import RunLogger, train

TINY = {"model_config": {"d_model": 8, "num_layers": 1, "dropout": 0.0}}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    run_generate(GenerateConfig(accounts=250, days=45, seed=2), root / "data")
    return root


@pytest.fixture
def tracking(workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workspace / 'mlflow.db'}")
    return workspace


def config(workspace, model: str, *overrides: str):
    return load_train_config(
        workspace / "data",
        None,
        [
            "max_epochs=2",
            "chunk_events=16",
            "batch_accounts=32",
            "test_days=7",
            "progress_bar=false",
            *overrides,
        ],
        model=model,
        out_dir=workspace / "runs",
    )


@pytest.mark.slow
def test_train_logs_metrics_registers_a_model_that_loads_and_scores_the_same_elsewhere(tracking, capsys):
    cfg = config(tracking, "lstm", "model_config.d_model=8", "model_config.num_layers=1")
    result = train(cfg)
    for key in (
        "test/auc",
        "test/ap",
        "test/cp_at_100",
        "test/parallel_vs_recurrent_max_abs",
        "model/state_bytes_per_account",
        "model/step_us_per_event",
    ):
        assert key in result.metrics, key
    assert result.metrics["test/parallel_vs_recurrent_max_abs"] < 1e-4
    assert 0.5 < result.metrics["test/auc"] <= 1.0

    run = mlflow.get_run(result.run_id)
    assert run.data.params["model"] == "lstm" and run.data.params["model.d_model"] == "8"
    assert "val/ap" in run.data.metrics  # per-epoch validation metric from Lightning
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(result.run_id, "plots")}
    assert {"plots/pr_curve.png", "plots/cp_at_k_per_day.png"} <= artifacts

    assert 0 < result.metrics["val/threshold"] < 1
    assert result.metrics["val/alerts_per_day"] >= 1

    # Promote, then load through the alias in a fresh process that never imports the training code.
    assert promote("champion", "txsentinel", run_id=result.run_id) == result.version
    assert "alerts/day on validation" in capsys.readouterr().out
    logged = pl.read_parquet(
        mlflow.artifacts.download_artifacts(run_id=result.run_id, artifact_path=SCORES_ARTIFACT)
    )
    account = logged["account_id"][0]
    script = f"""
import json, sys, numpy as np, polars as pl
from pipeline.registry.tracking import load_model
from pipeline.data.dataset import read_dataset
from pipeline.features import compute_features
from pipeline.training.sequences import build_sequences
from pipeline.training.diagnostics import account_inputs
model = load_model("models:/txsentinel@champion")
assert 0 < model.meta["threshold"] < 1
assert model.meta["model_version"] == "models:/txsentinel/{result.version}"  # what its scores will carry
assert set(model.spec.drift_reference) == set(model.spec.names)  # what live drift is measured against
assert abs(sum(model.meta["score_reference"]["proportions"]) - 1) < 1e-9
frame = read_dataset("data")
seqs = build_sequences(compute_features(frame).filter(pl.col("account_id") == {account!r}), model.spec, None)
scores, _ = model.detector(account_inputs(seqs, 0)[None])
assert "lightning" not in " ".join(sys.modules), "the loader pulled in Lightning"
import mlflow, torch  # the same model through MLflow's generic pyfunc face: raw transactions -> probabilities
raw = frame.with_columns(pl.col("ts", "label_ts").dt.replace_time_zone(None)).to_pandas()
pyfunc = pl.from_pandas(mlflow.pyfunc.load_model("models:/txsentinel@champion").predict(raw))
pyfunc = pl.DataFrame({{"event_id": seqs.event_ids}}).join(pyfunc, on="event_id", how="left")
np.testing.assert_allclose(pyfunc["score"].to_numpy(), torch.sigmoid(scores[0]).detach().numpy(), atol=1e-6)
print(json.dumps({{"event_ids": seqs.event_ids.tolist(), "scores": scores[0].tolist()}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    fresh = json.loads(out.stdout.strip().splitlines()[-1])
    fresh_scores = dict(zip(fresh["event_ids"], fresh["scores"], strict=True))
    expected = logged.filter(pl.col("account_id") == account)
    got = np.array([fresh_scores[e] for e in expected["event_id"]])
    np.testing.assert_allclose(got, expected["score"].to_numpy(), atol=1e-5)


@pytest.mark.slow
def test_hybrid_trains_its_base_then_its_trees_and_registers_one_model(tracking):
    cfg = config(
        tracking, "hybrid", "hybrid_base=lstm", "model_config.d_model=8", "model_config.num_layers=1"
    )
    result = train(cfg)
    assert result.metrics["test/parallel_vs_recurrent_max_abs"] < 1e-4  # the base's
    assert "test/hybrid_split_flips" in mlflow.get_run(result.run_id).data.metrics
    assert 0.5 < result.metrics["test/auc"] <= 1.0
    model = load_model(result.model_uri)
    assert model.name == "hybrid" and bool(model.detector.fitted)
    assert model.detector.base.name == "lstm" and model.detector.config.trees >= 1
    assert mlflow.get_run(result.run_id).data.tags["detector"] == "hybrid"
    # The trees are monotone in the base score: a surer base never lowers the hybrid's score.
    head, features = model.detector.head, model.detector.config.num_features
    rows = torch.randn(64, 1, features + 1).repeat(1, 41, 1)  # [64 events, 41 base scores, F + 1]
    rows[..., -1] = torch.linspace(-10.0, 10.0, 41)
    with torch.no_grad():
        by_score = head(rows.reshape(-1, features + 1)).reshape(64, 41)
    assert bool((by_score.diff(dim=1) >= 0).all())
    with pytest.raises(ValueError, match="hybrid_base"):
        config(tracking, "hybrid", "hybrid_base=hybrid")


@pytest.mark.slow
def test_a_pretrained_run_learns_the_next_event_then_trains_and_registers_as_any_other(tracking):
    cfg = config(
        tracking,
        "linear_transformer",
        "pretrain_epochs=3",
        "model_config.d_model=8",
        "model_config.num_layers=1",
    )
    result = train(cfg)
    history = mlflow.MlflowClient().get_metric_history(result.run_id, "pretrain/loss")
    losses = [m.value for m in sorted(history, key=lambda m: m.step)]
    assert len(losses) >= 3 and losses[-1] < 0.8 * losses[0]
    assert mlflow.get_run(result.run_id).data.params["pretrain_epochs"] == "3"
    assert result.metrics["test/parallel_vs_recurrent_max_abs"] < 1e-4
    assert 0.5 < result.metrics["test/auc"] <= 1.0


def test_lightning_finalizing_its_logger_leaves_the_run_open_for_the_stages_after(tracking):
    # Lightning finalizes the logger after each of pretraining, fit, validate and test; the run must stay RUNNING
    # until train() is done with it, and close FINISHED (or FAILED) with its context.
    mlflow.set_experiment("logger-lifetime")
    with mlflow.start_run() as run:
        logger = RunLogger(tracking_uri=mlflow.get_tracking_uri(), run_id=run.info.run_id)
        logger.log_metrics({"pretrain/loss": 1.0}, step=0)
        logger.finalize("success")
        assert mlflow.get_run(run.info.run_id).info.status == "RUNNING"
    assert mlflow.get_run(run.info.run_id).info.status == "FINISHED"


@pytest.mark.slow
def test_baseline_logs_the_same_test_metrics_to_the_same_experiment(tracking):
    result = train(config(tracking, "logreg"))
    assert {"test/auc", "test/ap", "test/cp_at_100"} <= set(result.metrics)
    run = mlflow.get_run(result.run_id)
    assert run.data.tags["model_family"] == "baseline"


def test_loader_refuses_an_artifact_of_another_state_version(tmp_path):
    from models.registry import build_detector
    from pipeline.features.definitions import FEATURE_NAMES
    from pipeline.features.spec import FeatureSpec
    from pipeline.registry.artifact import save_model_dir

    detector = build_detector("linear_transformer", {"d_model": 8, "num_layers": 1, "num_heads": 2})
    spec = FeatureSpec(mean=(0.0,) * len(FEATURE_NAMES), std=(1.0,) * len(FEATURE_NAMES))
    model_dir = save_model_dir(tmp_path / "model", detector, spec, {})
    assert load_model(str(model_dir)).name == "linear_transformer"
    described = json.loads((model_dir / "detector.json").read_text())
    (model_dir / "detector.json").write_text(json.dumps({**described, "state_version": 99}))
    with pytest.raises(ValueError, match="state version 99"):
        load_model(str(model_dir))


def test_train_config_precedence_and_errors(tmp_path):
    (tmp_path / "c.yaml").write_text("max_epochs: 5\nmodel_config: {d_model: 32}\n")
    cfg = load_train_config(
        tmp_path, tmp_path / "c.yaml", ["max_epochs=7", "model_config.num_layers=3"], model="lstm"
    )
    assert (cfg.max_epochs, cfg.model, cfg.model_config) == (7, "lstm", {"d_model": 32, "num_layers": 3})
    with pytest.raises(ValueError, match=r"unknown train setting\(s\) \['epochs'\]"):
        load_train_config(tmp_path, None, ["epochs=3"])
    with pytest.raises(ValueError, match="expected key=value"):
        load_train_config(tmp_path, None, ["max_epochs"])


def test_threshold_raises_the_alert_budget_on_validation():
    from pipeline.training.thresholds import DAY_US, choose_threshold

    ts = np.repeat(np.arange(4) * DAY_US, 100)  # 4 days x 100 events
    scores = np.tile(np.linspace(0, 1, 100), 4)
    fraud = scores > 0.95
    chosen = choose_threshold(scores, fraud, ts, budget_per_day=10)
    assert chosen.validation_alerts_per_day == 10
    assert chosen.value == pytest.approx(np.linspace(0, 1, 100)[90])
    assert chosen.validation_precision == pytest.approx(5 / 10)
    with pytest.raises(ValueError, match="alert budget must be > 0"):
        choose_threshold(scores, fraud, ts, budget_per_day=0)


@pytest.mark.parametrize("model", ["lstm", "logreg", "isolation_forest"])
def test_a_dataset_without_labels_is_refused_as_such_by_every_model(model, tmp_path):
    # Ingested without an is_fraud column. A baseline failed in polars on the missing column, and a sequence
    # model said there was no known fraud in the training window, as if a longer period would find some.
    labelled = tmp_path / "labelled"
    run_generate(GenerateConfig(accounts=30, days=4, seed=0), labelled)
    unlabelled = read_dataset(labelled).drop("is_fraud", "label_ts")
    write_dataset(unlabelled, tmp_path / "unlabelled", source={"test": "no labels"})
    cfg = load_train_config(tmp_path / "unlabelled", None, ["max_epochs=1"], model=model)
    with pytest.raises(
        ValueError, match=r"unlabelled has no labels \(no is_fraud column\): .* known fraud\."
    ):
        train(cfg)


def test_a_training_window_of_fraud_only_is_refused_as_such(tmp_path):
    # Every labelled event fraud (labels inverted, say): the weight of a fraud was worked out as sqrt(0 / N) =
    # 0, so the model learnt nothing, and it trained, registered and said nothing.
    generated = tmp_path / "generated"
    run_generate(GenerateConfig(accounts=30, days=40, seed=0), generated)
    inverted = read_dataset(generated).with_columns(pl.lit(True).alias("is_fraud"))
    write_dataset(inverted, tmp_path / "inverted", source={"test": "all fraud"})
    cfg = load_train_config(tmp_path / "inverted", None, ["max_epochs=1"], model="lstm")
    with pytest.raises(
        ValueError, match=r"labelled events is fraud: nothing to tell it from; are the labels"
    ):
        train(cfg)


@pytest.mark.parametrize("model", ["lstm", "logreg"])
def test_a_dataset_edited_after_it_was_made_is_refused_before_training(model, tmp_path):
    # A negative amount written into the Parquet file by hand: features and training took it as a purchase.
    generated = tmp_path / "generated"
    run_generate(GenerateConfig(accounts=30, days=4, seed=0), generated)
    edited = read_dataset(generated).with_columns(
        pl.when(pl.col("event_id") == "E000000003").then(-50.0).otherwise("amount").alias("amount")
    )
    edited.write_parquet(generated / "transactions.parquet")
    cfg = load_train_config(generated, None, ["max_epochs=1"], model=model)
    with pytest.raises(
        ValueError,
        match=r"transactions.parquet: negative amount \(column amount\): 1 row, the first row 4 "
        r"\(event_id 'E000000003'\).* re-run `txsentinel ingest`",
    ):
        train(cfg)


def _without_fraud_in(tmp_path, period: str) -> tuple:
    """A small generated dataset, its fraud in the validation or test period made legit; (data dir, the config's
    settings, the period)."""
    from pipeline.training.config import split_dataset

    generated = tmp_path / "generated"
    run_generate(GenerateConfig(accounts=120, days=30, seed=2), generated)
    settings = ["max_epochs=3", "early_stopping_patience=0", "chunk_events=16", "batch_accounts=32"]
    settings += ["test_days=5", "progress_bar=false", "model_config.d_model=8", "model_config.num_layers=1"]
    frame = read_dataset(generated)
    split, validation = split_dataset(load_train_config(generated, None, settings, model="lstm"), frame)
    cleared = {"validation": validation, "test": split.test}[period]
    legit = pl.when(cleared.contains()).then(False).otherwise("is_fraud").alias("is_fraud")
    write_dataset(frame.with_columns(legit), tmp_path / "data", source={"test": f"no fraud in {period}"})
    return tmp_path / "data", settings, cleared


def test_a_validation_period_without_fraud_trains_every_epoch_and_says_why(tmp_path, monkeypatch, caplog):
    # Its AP was logged as 0 every epoch: early stopping stopped after `patience` epochs and the checkpoint kept
    # the first, silently.
    data, settings, validation = _without_fraud_in(tmp_path, "validation")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    result = train(load_train_config(data, None, settings, model="lstm", out_dir=tmp_path / "runs"))
    assert result.metrics["train/epochs"] == 3
    assert "val/ap" not in mlflow.get_run(result.run_id).data.metrics
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        f"the validation period {validation} (the last validation_days = 7 of training) holds no known fraud"
        in w
        and "early stopping is off" in w
        and "--set validation_days=N" in w
        for w in warned
    ), warned


@pytest.mark.parametrize("model", ["lstm", "logreg"])
def test_a_test_period_without_fraud_says_so_before_training_and_beside_its_nan(
    model, tmp_path, monkeypatch, caplog, capsys
):
    # It printed "AP nan" and no more.
    data, settings, test = _without_fraud_in(tmp_path, "test")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    result = train(load_train_config(data, None, settings, model=model, out_dir=tmp_path / "runs"))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        w.startswith(f"the test period {test} has no fraud labels (is_fraud) among its ")
        and "move the test period (--test-period, --set test_days=N)" in w
        for w in warned
    ), warned
    printed = capsys.readouterr().out
    assert (
        f"AP nan (the test period {test} has no fraud labels (is_fraud) among its scored events: AUC and AP "
        "are undefined (NaN), and not logged)" in printed
    )
    assert not {"test/auc", "test/ap"} & set(mlflow.get_run(result.run_id).data.metrics)
