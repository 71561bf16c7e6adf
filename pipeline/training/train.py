"""`txsentinel train`: one detector (or a per-event baseline) trained, tested and tracked in MLflow.

train(cfg) reads the dataset, computes the causal features, splits time into train / delay / test, fits the
normalisation on the training period, trains with Lightning (chunked histories, carried state), tests with
the Handbook protocol over full histories, and logs everything to one MLflow run with a registered model.
"""

import contextlib
import logging
import math
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pytorch_lightning as pl_lightning
import torch
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.loggers import MLFlowLogger

from models.contract import RecurrentDetector
from models.hybrid import HybridDetector
from models.registry import REGISTRY, build_detector, config_class
from pipeline.data.dataset import require_labels
from pipeline.data.splits import Period, Split
from pipeline.evaluation.plots import log_evaluation
from pipeline.evaluation.protocol import no_fraud_to_test, undefined_note
from pipeline.features.drift_reference import fit_reference
from pipeline.registry.artifact import save_model_dir
from pipeline.registry.pyfunc_model import log_and_register
from pipeline.registry.tracking import configure_registry, configure_tracking, log_params
from pipeline.training.baselines import BASELINES, train_baseline
from pipeline.training.config import TEST_PERIOD_SETTINGS, TrainConfig, TrainResult, flatten
from pipeline.training.datamodule import HistoryDataModule, Window
from pipeline.training.diagnostics import (
    parity_metrics,
    state_bytes_per_account,
    step_cost_us_per_event,
)
from pipeline.training.hybrid_head import fit_hybrid
from pipeline.training.module import DetectorModule
from pipeline.training.prepared import prepare
from pipeline.training.pretraining import NextEventModule, pretrain
from pipeline.training.sequences import AccountSequences
from pipeline.training.thresholds import Threshold, choose_threshold

log = logging.getLogger(__name__)


def _pos_weight(seqs: AccountSequences, window: Window, given: float | None) -> float:
    if given is not None:
        return given
    counted = (seqs.ts_us >= window.start_us) & (seqs.ts_us < window.end_us)
    frauds = float(seqs.target[counted].sum())
    legit = float(counted.sum()) - frauds
    if frauds == 0:
        raise ValueError(
            "no known fraud in the training window: nothing to learn; use a longer training period"
        )
    if legit == 0:  # the weight would be 0, which --set pos_weight refuses: every fraud would count nothing
        raise ValueError(
            f"every one of the training window's {int(frauds)} labelled events is fraud: nothing to tell it "
            "from; are the labels (is_fraud) inverted, or read from the wrong column?"
        )
    # sqrt of the imbalance: strong enough that fraud is not ignored, mild enough to keep logits calibrated-ish.
    return math.sqrt(legit / frauds)


def _trainer(cfg: TrainConfig, validated: bool = True) -> pl_lightning.Trainer:
    """A Trainer that knows its global rank; rank 0 gives it the logger and the checkpoint directory.
    `validated`: the validation AP picks the best epoch and stops early; otherwise (it is undefined) every
    epoch trains and the last one is kept."""
    # No dirpath yet: rank 0 sets it once its run exists, and Lightning hands it to the other ranks.
    if not validated:
        return _lightning_trainer(cfg, cfg.max_epochs, callbacks=[ModelCheckpoint(save_top_k=1)])
    checkpoint = ModelCheckpoint(monitor="val/ap", mode="max", save_top_k=1)
    early_stopping = EarlyStopping("val/ap", mode="max", patience=cfg.early_stopping_patience)
    return _lightning_trainer(cfg, cfg.max_epochs, callbacks=[early_stopping, checkpoint])


def _validation_picks_epochs(
    seqs: AccountSequences, window: Window, validation: Period, cfg: TrainConfig
) -> bool:
    """Whether the validation window's known labels hold both fraud and legit events, so that its AP is defined
    and can pick the best epoch; if not, a warning says so, naming the window and the settings that move it."""
    counted = (seqs.ts_us >= window.start_us) & (seqs.ts_us < window.end_us)
    frauds = int(seqs.target[counted].sum())
    if 0 < frauds < int(counted.sum()):
        return True
    held = "no known fraud" if frauds == 0 else "only fraud"
    log.warning(
        "the validation period %s (the last validation_days = %d of training) holds %s, so its AP is "
        "undefined: early stopping is off, all max_epochs = %d train and the last is kept. To validate on "
        "fraud, widen or move the period (--set validation_days=N, --train-period)",
        validation,
        cfg.validation_days,
        held,
        cfg.max_epochs,
    )
    return False


def _pretrainer(cfg: TrainConfig) -> pl_lightning.Trainer:
    """The next-event pretraining's Trainer: `pretrain_epochs`, no validation, no checkpoint."""
    return _lightning_trainer(
        cfg, cfg.pretrain_epochs, enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0
    )


def _lightning_trainer(cfg: TrainConfig, epochs: int, **settings: Any) -> pl_lightning.Trainer:
    on_gpu = cfg.accelerator in ("gpu", "cuda")
    return pl_lightning.Trainer(
        max_epochs=epochs,
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        strategy="ddp" if cfg.ranks > 1 else "auto",
        precision=cfg.precision or ("bf16-mixed" if on_gpu else "32-true"),
        gradient_clip_val=cfg.gradient_clip,
        logger=False,
        use_distributed_sampler=False,  # chunks of a group must stay in order; the data module shards groups
        reload_dataloaders_every_n_epochs=1,  # a new group order every epoch
        enable_progress_bar=cfg.progress_bar,
        enable_model_summary=False,
        log_every_n_steps=10,
        deterministic=False,
        **settings,
    )


class RunLogger(MLFlowLogger):
    """Lightning's MLflow logger for a run that `mlflow.start_run` owns. Lightning finalizes its logger at the end
    of every fit, validate and test, and MLFlowLogger then marks the run FINISHED: after pretraining, the run
    would read as done while the detector still trained. The run's context closes it (FINISHED, or FAILED on an
    error)."""

    def finalize(self, status: str = "success") -> None:
        pass


@contextlib.contextmanager
def _rank_zero_run(
    trainer: pl_lightning.Trainer, cfg: TrainConfig, detector_config: dict, split: Split, validation: Period
) -> Iterator[str]:
    """Rank 0 opens the MLflow run, logs the settings and gives the trainer its logger and checkpoint directory;
    under DDP the other ranks train, validate and test beside it and track nothing. Yields the run id ("" off
    rank 0)."""
    if not trainer.is_global_zero:
        yield ""
        return
    tracking_uri = configure_tracking()
    mlflow.set_experiment(cfg.experiment)
    with mlflow.start_run(run_name=cfg.model) as run:
        run_id = run.info.run_id
        log_params(flatten(cfg, detector_config))
        mlflow.log_params(
            {
                "split.train": str(split.train),
                "split.validation": str(validation),
                "split.test": str(split.test),
            }
        )
        mlflow.set_tags({"model_family": "sequence", "detector": cfg.model})
        trainer.logger = RunLogger(experiment_name=cfg.experiment, tracking_uri=tracking_uri, run_id=run_id)
        trainer.checkpoint_callback.dirpath = os.path.realpath(cfg.out_dir / run_id / "checkpoints")
        yield run_id


def train(cfg: TrainConfig) -> TrainResult:
    if cfg.model not in REGISTRY:
        if cfg.model in BASELINES:
            return train_baseline(cfg)
        raise ValueError(f"unknown model {cfg.model!r}; choose one of {sorted(REGISTRY) + sorted(BASELINES)}")
    _check_devices(cfg)
    configure_tracking()  # the store opens before the data is read: one it cannot use fails now, not at the end
    configure_registry()  # and the registry the model is registered in, where MLFLOW_REGISTRY_URI keeps it apart
    require_labels(cfg.data, f"{cfg.model} is trained and tested on known fraud")
    started = time.perf_counter()
    pl_lightning.seed_everything(cfg.seed, workers=True, verbose=False)
    ready = prepare(cfg)
    split, validation, spec = ready.split, ready.validation, ready.spec
    if warning := no_fraud_to_test(ready.frame, split.test, TEST_PERIOD_SETTINGS):
        log.warning(warning)
    train_seqs, test_seqs, windows = ready.train_seqs, ready.test_seqs, ready.windows
    data = HistoryDataModule(
        train=(train_seqs, windows["train"]),
        validation=(train_seqs, windows["validation"]),
        test=(test_seqs, windows["test"]),
        batch_accounts=cfg.batch_accounts,
        chunk_events=cfg.chunk_events,
        num_workers=cfg.num_workers,
        seed=cfg.seed,
    )
    # A hybrid trains its base detector first, then its trees (pipeline/training/hybrid_head.py).
    base = cfg.trained_detector
    model_config = config_class(base)(
        **{
            **config_class(base)().to_dict(),
            "num_features": spec.num_features,
            "terminal_buckets": spec.terminal_buckets,
            **cfg.model_config,
        }
    )
    detector = build_detector(base, model_config)
    module = DetectorModule(
        detector,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        warmup_steps=cfg.warmup_steps,
        pos_weight=_pos_weight(train_seqs, windows["train"], cfg.pos_weight),
        num_events={"val": len(train_seqs.x), "test": len(test_seqs.x)},
    )

    trainer = _trainer(cfg, _validation_picks_epochs(train_seqs, windows["validation"], validation, cfg))
    with _rank_zero_run(trainer, cfg, model_config.to_dict(), split, validation) as run_id:
        if cfg.pretrain_epochs:
            module.detector = _pretrained(
                module.detector, cfg, train_seqs, windows["validation"], trainer.logger
            )
        trainer.fit(module, datamodule=data)
        best = trainer.checkpoint_callback.best_model_path
        if best:
            module.load_state_dict(torch.load(best, map_location="cpu", weights_only=True)["state_dict"])
        if cfg.model == HybridDetector.name:
            module.detector = fit_hybrid(
                module.detector, train_seqs, windows["train"], windows["validation"], cfg.seed
            )
        train_seconds = time.perf_counter() - started
        trainer.validate(module, datamodule=data, verbose=False)  # the best weights' validation scores
        threshold = _threshold(module.scores["val"], train_seqs, cfg.alert_budget_per_day)
        trainer.test(module, datamodule=data, verbose=False)
        _leave_process_group()
        if not trainer.is_global_zero:
            return TrainResult(run_id, cfg.model, "", -1)

        detector = module.detector.cpu().eval()
        scored = ready.scored(module.scores["test"])
        metrics, scenarios = ready.test_metrics(scored, cfg.cp_k, cfg.delay_days)
        results = {**metrics.as_dict(), **scenarios}
        results.update(parity_metrics(detector, test_seqs))
        results["model/state_bytes_per_account"] = float(state_bytes_per_account(detector))
        results["model/step_us_per_event"] = step_cost_us_per_event(detector)
        results["train/seconds"] = train_seconds
        results["train/epochs"] = float(trainer.current_epoch)
        best_score = trainer.checkpoint_callback.best_model_score
        results["val/ap"] = float(best_score) if best_score is not None else float("nan")
        results["val/threshold"] = threshold.value
        results["val/alerts_per_day"] = threshold.validation_alerts_per_day
        results["val/precision_at_threshold"] = threshold.validation_precision
        results = {k: v for k, v in results.items() if not (isinstance(v, float) and math.isnan(v))}
        mlflow.log_metrics(results)
        log_evaluation(scored, metrics, cfg.model)

        meta: dict[str, Any] = {
            "run_id": run_id,
            "detector": cfg.model,
            "trained_on": str(cfg.data),
            "split": {"train": str(split.train), "validation": str(validation), "test": str(split.test)},
            "metrics": results,
            "threshold": threshold.value,
            "alert_budget": threshold.as_meta(),
            # the validation scores' distribution: what the service's score drift is measured against
            "score_reference": _score_reference(module.scores["val"]),
        }
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = save_model_dir(Path(tmp) / "model", detector, spec, meta)
            model_uri, version = log_and_register(model_dir, cfg.registered_model)
    print(
        f"trained {cfg.model}: run {run_id}, {cfg.registered_model} v{version}, "
        f"test AUC {metrics.auc:.3f} AP {metrics.ap:.3f}{undefined_note(metrics, split.test)} "
        f"CP@{cfg.cp_k} {metrics.cp_at_k:.3f}, "
        f"parallel-vs-recurrent {results['test/parallel_vs_recurrent_max_abs']:.1e}{_split_flips(results)}, "
        f"alert threshold {threshold.value:.3f} ({threshold.validation_alerts_per_day:.0f}/day on validation), "
        f"{train_seconds:.0f} s"
    )
    return TrainResult(run_id, cfg.model, model_uri, version, results)


def _check_devices(cfg: TrainConfig) -> None:
    """GPUs asked for are here, before the data is read (Lightning would say so in a traceback, after)."""
    if cfg.accelerator == "cpu":
        return
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < cfg.devices:
        raise ValueError(
            f"train config: accelerator = {cfg.accelerator!r} with devices = {cfg.devices}, but this machine has "
            f"{found} CUDA GPU(s) visible to torch; use --accelerator cpu, or fewer --devices"
        )


def _leave_process_group() -> None:
    """After the last collective (the test scores' gather) each DDP rank destroys its process group. A rank that
    exits with the group alive leaves gloo's worker threads to the interpreter's teardown, which can abort the
    process ("terminate called without an active exception") after training has succeeded. Local to the rank:
    no other rank waits on it. Nothing on one device."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _split_flips(results: dict[str, float]) -> str:
    flips = results.get("test/hybrid_split_flips")
    return "" if flips is None else f" (the base's; {flips:.0f} events across a tree split)"


def _pretrained(
    detector: RecurrentDetector,
    cfg: TrainConfig,
    seqs: AccountSequences,
    validation: Window,
    logger: RunLogger | None,
) -> RecurrentDetector:
    """`detector` after cfg.pretrain_epochs of next-event prediction over every event before `validation`."""
    everything_before = Window(np.iinfo(np.int64).min, validation.start_us)
    data = HistoryDataModule(
        train=(seqs, everything_before),
        validation=None,
        test=None,
        batch_accounts=cfg.batch_accounts,
        chunk_events=cfg.chunk_events,
        num_workers=cfg.num_workers,
        seed=cfg.seed,
    )
    module = NextEventModule(detector, cfg.learning_rate, cfg.weight_decay, cfg.warmup_steps)
    trainer = _pretrainer(cfg)
    if logger is not None:  # rank 0 logs pretrain/loss to the run
        trainer.logger = logger
    return pretrain(module, trainer, data)


def _threshold(val_logits: np.ndarray, seqs: AccountSequences, budget_per_day: float) -> Threshold:
    scored = ~np.isnan(val_logits)
    probabilities = 1.0 / (1.0 + np.exp(-val_logits[scored].astype(np.float64)))
    return choose_threshold(probabilities, seqs.target[scored] > 0.5, seqs.ts_us[scored], budget_per_day)


def _score_reference(val_logits: np.ndarray) -> dict[str, list[float]]:
    scored = val_logits[~np.isnan(val_logits)].astype(np.float64)
    return fit_reference(1.0 / (1.0 + np.exp(-scored)))  # on the probability, as the scores topic has it
