"""Per-event causal features: one definition, a batch form (polars) and a streaming form (bounded state)."""

from pipeline.features.batch import compute_features, raw_aggregates
from pipeline.features.definitions import FEATURE_NAMES, FEATURE_VERSION, TERMINAL_BUCKET_COLUMN
from pipeline.features.spec import FeatureSpec, fit_feature_spec
from pipeline.features.stream import StreamingFeaturizer
from pipeline.features.stream_batches import EventBatch, LabelBatch, replay_batches

__all__ = [
    "FEATURE_NAMES",
    "FEATURE_VERSION",
    "TERMINAL_BUCKET_COLUMN",
    "EventBatch",
    "FeatureSpec",
    "LabelBatch",
    "StreamingFeaturizer",
    "compute_features",
    "fit_feature_spec",
    "raw_aggregates",
    "replay_batches",
]
