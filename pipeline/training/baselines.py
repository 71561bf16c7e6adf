"""Per-event baselines the field uses, trained on the same features and scored with the same protocol, so
every comparison shows the sequence models against them. IsolationForest uses no labels at all."""

import logging
import math
import time

import mlflow
import polars as pl
from sklearn.ensemble import HistGradientBoostingClassifier, IsolationForest, RandomForestClassifier
from sklearn.linear_model import LogisticRegression

from pipeline.data.dataset import read_dataset, require_labels
from pipeline.data.splits import known_target
from pipeline.evaluation.plots import log_evaluation
from pipeline.evaluation.protocol import (
    detection_metrics,
    no_fraud_to_test,
    scenario_metrics,
    undefined_note,
)
from pipeline.features import compute_features, fit_feature_spec
from pipeline.registry.tracking import configure_tracking, log_params, pinned_requirements
from pipeline.training.config import (
    TEST_PERIOD_SETTINGS,
    TrainConfig,
    TrainResult,
    flatten,
    split_dataset,
)

log = logging.getLogger(__name__)


def _make(name: str, seed: int):
    if name == "logreg":
        return LogisticRegression(max_iter=1000, class_weight="balanced")
    if name == "random_forest":
        return RandomForestClassifier(
            n_estimators=100,
            max_depth=12,
            min_samples_leaf=5,
            n_jobs=1,
            random_state=seed,
            class_weight="balanced",
        )
    if name == "hist_gbdt":
        return HistGradientBoostingClassifier(max_iter=200, learning_rate=0.1, random_state=seed)
    if name == "isolation_forest":
        return IsolationForest(n_estimators=200, random_state=seed, n_jobs=1)
    raise ValueError(f"unknown baseline {name!r}")


BASELINES = ("logreg", "random_forest", "hist_gbdt", "isolation_forest")


def train_baseline(cfg: TrainConfig):
    configure_tracking()  # the store opens before the data is read: one it cannot use fails now, not at the end
    started = time.perf_counter()
    require_labels(cfg.data, f"{cfg.model} is trained and tested on known fraud")
    frame = read_dataset(cfg.data)
    split, _ = split_dataset(cfg, frame, validated=False)
    if warning := no_fraud_to_test(frame, split.test, TEST_PERIOD_SETTINGS):
        log.warning(warning)
    features = compute_features(frame.filter(pl.col("ts") < split.test.end))
    spec = fit_feature_spec(features, split.train.start, split.train.end)
    train = features.filter(split.train.contains()).with_columns(
        known_target(split.label_cutoff).alias("target")
    )
    test = features.filter(split.test.contains())
    model = _make(cfg.model, cfg.seed)
    x_train = spec.matrix(train)
    if cfg.model == "isolation_forest":
        model.fit(x_train)
        scores = -model.score_samples(spec.matrix(test))  # higher = more anomalous
    else:
        y = train["target"].to_numpy()
        if not y.any():
            raise ValueError("no known fraud in the training period: nothing to learn")
        model.fit(x_train, y)
        scores = model.predict_proba(spec.matrix(test))[:, 1]
    train_seconds = time.perf_counter() - started
    scored = test.select("event_id", "account_id", "ts", "is_fraud").with_columns(pl.Series("score", scores))
    metrics = detection_metrics(scored, frame, split.test, cfg.cp_k, cfg.delay_days)

    mlflow.set_experiment(cfg.experiment)
    with mlflow.start_run(run_name=cfg.model) as run:
        log_params(flatten(cfg, {}))
        mlflow.log_params({"split.train": str(split.train), "split.test": str(split.test)})
        mlflow.set_tags({"model_family": "baseline", "detector": cfg.model})
        results = metrics.as_dict()
        results["train/seconds"] = train_seconds
        results.update(scenario_metrics(scored, frame))
        mlflow.log_metrics({k: v for k, v in results.items() if not (isinstance(v, float) and math.isnan(v))})
        log_evaluation(scored, metrics, cfg.model)
        mlflow.sklearn.log_model(
            model,
            name="model",
            pip_requirements=pinned_requirements("scikit-learn", "numpy"),
            # We built the trees ourselves in this run; skops refuses their node storage unless told so.
            skops_trusted_types=[
                "sklearn.tree._tree.Tree",
                "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",
            ],
        )
    print(
        f"trained {cfg.model}: run {run.info.run_id}, test AUC {metrics.auc:.3f} AP {metrics.ap:.3f}"
        f"{undefined_note(metrics, split.test)} CP@{cfg.cp_k} {metrics.cp_at_k:.3f}, {train_seconds:.0f} s"
    )
    return TrainResult(run.info.run_id, cfg.model, "", -1, results)


__all__ = ["BASELINES", "train_baseline"]
