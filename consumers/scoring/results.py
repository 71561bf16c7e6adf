"""What a Scorer gives back: a record per scored event, the events it rejected and why, its running totals."""

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from pipeline.features.reasons import Explanation


@dataclass(frozen=True, slots=True)
class ScoreRecord:
    event_id: str
    account_id: str
    ts_us: int
    score: float  # sigmoid(logit): the probability of fraud
    logit: float
    alert: bool  # score >= the scorer's threshold
    out_of_order: bool  # ts older than the newest ts this account had already seen
    position: tuple[int, int] | None = None  # (partition, offset) in the source topic


class Rejected(NamedTuple):
    """An event not applied, and why (the dead-letter reason)."""

    index: int  # in the micro-batch given
    reason: str
    replay: bool  # its event_id was applied already (else: its amount is out of range, or its features not finite)


@dataclass(frozen=True)
class Scored:
    records: list[ScoreRecord]  # one per applied event, in input order
    rejected: list[Rejected]  # in input order
    # The alerts' reasons, by index in `records`, when the scorer gives reasons. Beside the records, not in
    # them: a reason's last bits follow how many alerts shared its attribution call, a score's never do.
    reasons: dict[int, Explanation] = field(default_factory=dict)
    shadow_logit: np.ndarray | None = None  # [len(records)] the shadow challenger's logits, when it has one


@dataclass
class ScorerStats:
    """Running totals since the scorer started (for logs and the service's metrics)."""

    batches: int = 0
    events_in: int = 0
    events_applied: int = 0
    duplicates_dropped: int = 0
    replays_dropped: int = 0  # an event_id its account had applied already, at another offset
    # events applied although their account's last applied position was past every offset read (corrupt)
    positions_repaired: int = 0
    amounts_refused: int = 0  # events whose amount lies outside 0..MAX_AMOUNT (pipeline/data/schema.py)
    not_finite: int = 0  # events whose feature row was not finite
    out_of_order: int = 0
    reasons_failed: int = 0  # alerts that went out without reasons: explaining them raised
    featurize_s: float = 0.0  # streaming featurizer
    detector_s: float = 0.0  # gather, step and scatter, all rounds
    explain_s: float = 0.0  # the alerts' reasons: state snapshots and attribution
    shadow_s: float = 0.0  # the shadow challenger's step (consumers/scoring/shadow.py)
    total_s: float = 0.0  # the whole micro-batch: the rest is dedup, normalisation and bookkeeping


class ScoredArrays(NamedTuple):
    """One micro-batch's results over its applied events (all [M], in arrival order): what Scored is made of."""

    applied: np.ndarray  # index of each applied event in the input
    logit: np.ndarray  # float64
    score: np.ndarray  # float64
    alert: np.ndarray  # bool
    out_of_order: np.ndarray  # bool
    rejected: list[Rejected]
    reasons: dict[int, Explanation]  # of the alerts explained, by position among the applied events
    shadow_logit: np.ndarray | None = None  # float64, the shadow challenger's, when the scorer has one


def sigmoid(logit: np.ndarray) -> np.ndarray:
    """Scores [N] float64 of logits [N] float64, with no overflow for any logit (1 / (1 + exp(-x)) warns
    past |x| ~ 709)."""
    return torch.sigmoid(torch.from_numpy(logit)).numpy()
