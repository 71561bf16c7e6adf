"""Per-account event sequences: the arrays the sequence models train on and the backtest replays.

Events of an account are ordered by (ts, event_id); accounts are laid end to end, `offsets` says where each
starts: events of account a are rows offsets[a] .. offsets[a + 1] - 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import polars as pl

    from pipeline.features.spec import FeatureSpec


@dataclass(frozen=True)
class AccountSequences:
    account_ids: np.ndarray  # [A] str
    offsets: np.ndarray  # [A + 1] int64
    x: np.ndarray  # [N, F] float32, normalised features
    terminal_bucket: np.ndarray  # [N] int64
    ts_us: np.ndarray  # [N] int64
    event_ids: np.ndarray  # [N] str
    target: np.ndarray  # [N] float32, fraud labels known at the cutoff (what training may use)
    is_fraud: np.ndarray  # [N] bool, the true label (what evaluation uses)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.account_ids)

    def rows(self, account: int) -> slice:
        return slice(int(self.offsets[account]), int(self.offsets[account + 1]))


def build_sequences(
    features: pl.DataFrame, spec: FeatureSpec, label_cutoff: datetime | None
) -> AccountSequences:
    """Group a feature frame (batch.compute_features) into account sequences.

    Targets hold only labels known before `label_cutoff` (None: every label, for evaluation-only use).
    """
    # Imported here, not at the top: the arrays above are all that training needs, and the GPU check runs
    # them where polars is not installed.
    import polars as pl

    from pipeline.data.splits import known_target
    from pipeline.features.definitions import TERMINAL_BUCKET_COLUMN

    labelled = "is_fraud" in features.columns
    if label_cutoff is None:
        target = pl.col("is_fraud").fill_null(False) if labelled else pl.lit(False)
    else:
        target = known_target(label_cutoff) if labelled else pl.lit(False)
    ordered = features.sort("account_id", "ts", "event_id").with_columns(
        target.cast(pl.Float32).alias("_target"),
        (pl.col("is_fraud").fill_null(False) if labelled else pl.lit(False)).alias("_is_fraud"),
    )
    accounts = ordered.group_by("account_id", maintain_order=True).len()
    offsets = np.zeros(accounts.height + 1, dtype=np.int64)
    np.cumsum(accounts["len"].to_numpy(), out=offsets[1:])
    return AccountSequences(
        account_ids=accounts["account_id"].to_numpy(),
        offsets=offsets,
        x=spec.matrix(ordered),
        terminal_bucket=ordered[TERMINAL_BUCKET_COLUMN].to_numpy().astype(np.int64),
        ts_us=ordered["ts"].dt.epoch("us").to_numpy(),
        event_ids=ordered["event_id"].to_numpy(),
        target=ordered["_target"].to_numpy(),
        is_fraud=ordered["_is_fraud"].to_numpy(),
    )
