"""A dataset made ready for a detector: split in time, featurised, normalised, as account sequences.

What `train` does before it trains, and what any code that scores a detector on the same split (the tree
bench, pipeline/bench/tree_head.py) must do the same way: the features are computed over everything before
the test week's end, the normalisation is fitted on the training period, training sees the labels known at
the cutoff and the test is scored against the truth.
"""

from dataclasses import dataclass

import numpy as np
import polars as pl

from pipeline.data.dataset import read_dataset
from pipeline.data.splits import Period, Split
from pipeline.evaluation.protocol import DetectionMetrics, detection_metrics, scenario_metrics
from pipeline.features import FeatureSpec, compute_features, fit_feature_spec
from pipeline.training.config import TrainConfig, split_dataset
from pipeline.training.datamodule import Window
from pipeline.training.sequences import AccountSequences, build_sequences


@dataclass(frozen=True)
class Prepared:
    frame: pl.DataFrame  # the dataset's transactions, with their truth
    split: Split
    validation: Period  # the last validation_days of training
    spec: FeatureSpec  # the normalisation, fitted on the training period
    train_seqs: AccountSequences  # events before the training period's end, labels known at the cutoff
    test_seqs: AccountSequences  # every event up to the test week's end, with the truth
    windows: dict[str, Window]  # "train", "validation", "test": which events each stage scores

    def scored(self, scores: np.ndarray) -> pl.DataFrame:
        """The test events that [N] test_seqs `scores` scored (NaN outside the test window), as metrics take them."""
        return scored_events(self.test_seqs, scores)

    def test_metrics(self, scored: pl.DataFrame, cp_k: int, delay_days: int) -> tuple[DetectionMetrics, dict]:
        """The published protocol's metrics and the AP of each fraud scenario, of `scored` (self.scored)."""
        return detection_metrics(scored, self.frame, self.split.test, cp_k, delay_days), scenario_metrics(
            scored, self.frame
        )


def prepare(cfg: TrainConfig, spec: FeatureSpec | None = None) -> Prepared:
    """The dataset of `cfg` split, featurised and turned into account sequences (module docstring), normalised
    by `spec` when given (a trained model's own), else by one fitted on the training period."""
    frame = read_dataset(cfg.data)
    split, validation = split_dataset(cfg, frame)
    features = compute_features(frame.filter(pl.col("ts") < split.test.end))
    spec = spec or fit_feature_spec(features, split.train.start, split.train.end)
    train_seqs = build_sequences(features.filter(pl.col("ts") < split.train.end), spec, split.label_cutoff)
    test_seqs = build_sequences(features, spec, label_cutoff=None)
    windows = {
        "train": Window(microseconds(split.train.start), microseconds(validation.start)),
        "validation": Window(microseconds(validation.start), microseconds(split.train.end)),
        "test": Window(microseconds(split.test.start), microseconds(split.test.end)),
    }
    return Prepared(frame, split, validation, spec, train_seqs, test_seqs, windows)


def microseconds(moment) -> int:
    """A datetime as microseconds since the epoch, as AccountSequences.ts_us holds it."""
    return int(moment.timestamp() * 1_000_000)


def scored_events(seqs: AccountSequences, scores: np.ndarray) -> pl.DataFrame:
    """Events that were scored (not NaN), with what the metrics need."""
    scored = ~np.isnan(scores)
    owner = np.repeat(seqs.account_ids, seqs.lengths)
    return pl.DataFrame(
        {
            "event_id": seqs.event_ids[scored],
            "account_id": owner[scored],
            "ts": pl.Series(seqs.ts_us[scored]).cast(pl.Datetime("us", "UTC")),
            "score": scores[scored].astype(np.float64),
            "is_fraud": seqs.is_fraud[scored],
        }
    )
