"""The backtest: replay through the live scorer, Handbook metrics, prequential folds, reports and MLflow.

A tiny untrained LSTM artifact is built on the fly: parity and bookkeeping do not need a good model.
"""

import json
from datetime import timedelta

import mlflow
import numpy as np
import polars as pl
import pytest
import torch

from models.registry import build_detector
from pipeline.cli.main import main
from pipeline.data.dataset import write_dataset
from pipeline.data.splits import Period, dataset_days, prequential_test_periods
from pipeline.evaluation.backtest import BacktestConfig, alert_reasons, backtest
from pipeline.evaluation.live_compare import LiveCompareConfig
from pipeline.evaluation.protocol import MAX_K, detection_metrics
from pipeline.features import FEATURE_NAMES, compute_features, fit_feature_spec
from pipeline.registry.artifact import save_model_dir
from pipeline.training.config import load_train_config
from pipeline.training.diagnostics import account_inputs
from pipeline.training.sequences import build_sequences
from tests.pipeline.workspaces import busy_dataset, use_fresh_store

TINY = {"num_features": len(FEATURE_NAMES), "d_model": 8, "num_layers": 1, "dropout": 0.0}
TEST_DAYS = 5


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("backtest")
    frame = busy_dataset(root / "data", accounts=120, days=30, seed=3)
    features = compute_features(frame)
    start = frame["ts"].min()
    spec = fit_feature_spec(features, start, start + timedelta(days=15))
    torch.manual_seed(0)
    detector = build_detector("lstm", TINY)
    # Threshold at a middling probability so an untrained model raises some alerts and leaves others.
    save_model_dir(root / "model", detector, spec, {"run_id": "not-in-this-store", "threshold": 0.5})
    return root, frame, features, spec, detector


@pytest.fixture
def tracking(workspace, monkeypatch, tmp_path):
    return use_fresh_store(monkeypatch, tmp_path)


def last_days(frame: pl.DataFrame, days: int) -> Period:
    span = dataset_days(frame)
    return Period(span.end - timedelta(days=days), span.end)


@torch.inference_mode()
def parallel_scores(features, spec, detector, end) -> pl.DataFrame:
    """The reference: the detector's parallel forward over each account's whole history up to `end`."""
    seqs = build_sequences(features.filter(pl.col("ts") < end), spec, None)
    detector.eval()
    logits = np.concatenate(
        [detector(account_inputs(seqs, a)[None])[0][0].double().numpy() for a in range(len(seqs))]
    )
    return pl.DataFrame({"event_id": seqs.event_ids, "parallel_logit": logits})


def test_replay_equals_parallel_forward_and_metrics_follow_the_protocol(workspace, tracking):
    root, frame, features, spec, detector = workspace
    test = last_days(frame, TEST_DAYS)
    result = backtest(
        BacktestConfig(
            data=root / "data",
            model_uri=str(root / "model"),
            test_period=test,
            k=10,
            out=tracking / "report",
            batch_events=97,
            progress_bar=False,
        )
    )
    # Parity: the live scoring path and the parallel forward give the same logits on the test events.
    in_test = result.scored.filter(test.contains())
    joined = in_test.join(parallel_scores(features, spec, detector, test.end), on="event_id", how="left")
    assert joined["parallel_logit"].null_count() == 0
    np.testing.assert_allclose(joined["logit"].to_numpy(), joined["parallel_logit"].to_numpy(), atol=1e-5)

    # The metrics are exactly detection_metrics over the replayed scores.
    direct = detection_metrics(in_test, frame, test, 10)
    fold = result.folds[0]
    assert (fold.metrics.auc, fold.metrics.ap, fold.metrics.cp_per_day) == (
        direct.auc,
        direct.ap,
        direct.cp_per_day,
    )
    assert result.summary["ap"] == (direct.ap, 0.0)
    # The budget curve at N = 10 is CP@10; alerts follow the threshold, one row per test day.
    assert fold.budget.filter(pl.col("budget_accounts_per_day") == 10)["precision"][0] == pytest.approx(
        direct.cp_at_k
    )
    assert fold.alerts_per_day.height == TEST_DAYS
    assert fold.alerts_per_day["alert_events"].sum() == int((in_test["score"] >= 0.5).sum())
    # Every alert, and only an alert, carries its reasons; the report lays out the test period's.
    alerted = result.scored.filter(pl.col("alert"))
    assert alerted.height > 0 and alerted["reasons"].null_count() == 0
    assert result.scored["reasons"].null_count() == result.scored.height - alerted.height
    reasons = alert_reasons(result.scored, test.start, test.end)
    assert reasons.height == fold.alerts_per_day["alert_events"].sum()
    assert (
        reasons.filter(pl.col("reason 1").is_not_null())["reason 1"]
        .str.contains(r" \([+-]\d+\.\d\d\)$")
        .all()
    )
    assert pl.read_csv(tracking / "report" / "alert_reasons.csv").height == reasons.height

    report = json.loads((tracking / "report" / "backtest.json").read_text())
    assert report["folds"][0]["test_period"] == str(test)
    assert report["summary"]["auc"]["mean"] == pytest.approx(direct.auc)
    for name in ("cp_at_k_per_day.png", "alerts_per_day.png", "budget_curve.png"):
        assert (tracking / "report" / name).stat().st_size > 0

    # The model's run_id is not in this store: a new "backtest" run holds metrics and plots.
    run = mlflow.get_run(result.run_id)
    assert run.info.run_name == "backtest" and run.data.tags["run_type"] == "backtest"
    assert run.data.metrics["backtest/auc"] == pytest.approx(direct.auc)
    logged = {a.path for a in mlflow.MlflowClient().list_artifacts(result.run_id, "backtest")}
    assert {"backtest/backtest.json", "backtest/budget_curve.png"} <= logged


def test_prequential_folds_share_one_replay_and_report_mean_and_std(workspace, tracking):
    root, frame, *_ = workspace
    # Log against a run that exists in this store, as a model trained here would be.
    mlflow.set_experiment("txsentinel")
    with mlflow.start_run(run_name="lstm") as training:
        pass
    model_dir = tracking / "model"
    (model_dir).mkdir()
    for f in (root / "model").iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    meta = json.loads((model_dir / "meta.json").read_text())
    (model_dir / "meta.json").write_text(json.dumps({**meta, "run_id": training.info.run_id}))

    result = backtest(
        BacktestConfig(
            data=root / "data",
            model_uri=str(model_dir),
            folds=3,
            k=10,
            test_period=last_days(frame, 4),
            progress_bar=False,
            reasons=0,  # the folds' bookkeeping is what counts here; the test above checks the reasons
        )
    )
    folds = prequential_test_periods(last_days(frame, 4), 3, dataset_days(frame))
    assert [f.test for f in result.folds] == folds
    assert result.folds[1].test.end == result.folds[0].test.start
    aps = [f.metrics.ap for f in result.folds]
    assert result.summary["ap"] == pytest.approx((np.mean(aps), np.std(aps)))
    # Every fold is scored by the one replay, which stops at the latest test end.
    assert result.scored["ts"].max() < result.folds[0].test.end
    for fold in result.folds:
        direct = detection_metrics(result.scored.filter(fold.test.contains()), frame, fold.test, 10)
        assert fold.metrics.cp_at_k == direct.cp_at_k

    assert result.run_id == training.info.run_id
    metrics = mlflow.get_run(result.run_id).data.metrics
    assert metrics["backtest/ap_mean"] == pytest.approx(np.mean(aps))
    assert metrics["backtest/ap_std"] == pytest.approx(np.std(aps))
    assert metrics["backtest/folds"] == 3


def test_too_many_folds_say_what_data_they_need(workspace):
    _, frame, *_ = workspace
    with pytest.raises(ValueError, match="Use fewer --folds"):
        prequential_test_periods(last_days(frame, 14), 3, dataset_days(frame))
    with pytest.raises(ValueError, match="folds = 0"):
        BacktestConfig(data=".", model_uri="x", folds=0)
    with pytest.raises(ValueError, match="folds = True, expected an integer >= 1"):
        BacktestConfig(data=".", model_uri="x", folds=True)  # YAML's true is not one fold


@pytest.mark.parametrize("flag", ["--k", "--folds"])
def test_an_absurd_k_or_fold_count_is_refused_by_name_not_overflowed(flag, workspace, tmp_path, capsys):
    # 1e20 overflowed polars' top k (an OverflowError traceback); as many folds made periods until the
    # dates overflowed.
    root, *_ = workspace
    argv = ["backtest", "--data", str(root / "data"), "--model", str(root / "model"), "--no-mlflow"]
    assert main([*argv, flag, str(10**20)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    if flag == "--k":
        assert "backtest config: k = 100000000000000000000, expected at most 1000000" in err
    else:
        assert "100000000000000000000 fold(s) of 14 test days" in err and "it has room for 2 fold(s)" in err


def test_the_k_of_card_precision_is_bounded_wherever_it_is_set(tmp_path):
    with pytest.raises(
        ValueError, match=r"train config: cp_k = 1000001, expected at most 1,000,000 \(accounts a day\)"
    ):
        load_train_config(tmp_path, None, ["cp_k=1000001"])
    with pytest.raises(
        ValueError, match=r"live compare: k = 100000000000000000000, expected an integer from 1"
    ):
        LiveCompareConfig(k=10**20)
    assert BacktestConfig(data=".", model_uri="x", k=MAX_K).k == MAX_K


def test_a_fold_without_fraud_is_named_before_the_replay(workspace, tmp_path, caplog):
    root, frame, *_ = workspace
    test = last_days(frame, 2)
    legit = pl.when(test.contains()).then(False).otherwise("is_fraud").alias("is_fraud")
    write_dataset(frame.with_columns(legit), tmp_path / "data", source={"test": "no fraud in the last days"})
    config = BacktestConfig(
        data=tmp_path / "data",
        model_uri=str(root / "model"),
        test_period=test,
        progress_bar=False,
        log_to_mlflow=False,
        reasons=0,
    )
    result = backtest(config)
    assert np.isnan(result.folds[0].metrics.ap)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"the test period {test} has no fraud labels (is_fraud) among its " in " ".join(warned)
    assert "move the test period (--test-period, --folds)" in " ".join(warned)
