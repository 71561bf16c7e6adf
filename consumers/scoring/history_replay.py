"""The backtest's side of the Scorer: a canonical dataset replayed through the live scoring path, to a frame.

The replay cuts the dataset, in (ts, event_id) order, into micro-batches (replay_batches) and applies each
with the very step the service runs (Scorer._score_batch), fraud labels becoming known at their label_ts. An
event the step would dead-letter stops the replay with the dataset's row: a backtest over a partial history
would not be the history. With reasons, each alert's reasons become two columns (REASONS_DTYPE).
"""

from collections.abc import Callable

import numpy as np
import polars as pl

from consumers.scoring.results import sigmoid
from pipeline.features.reasons import Explanation
from pipeline.features.stream_batches import replay_batches

REASONS_DTYPE = pl.List(pl.Struct({"input": pl.String, "text": pl.String, "logit": pl.Float64}))


class HistoryReplay:
    """The backtest part of the Scorer (consumers/scoring/scorer.py, whose __init__ sets the threshold and
    the explainer, and whose _score_batch applies one micro-batch, used here)."""

    def replay(
        self,
        frame: pl.DataFrame,
        batch_events: int = 500,
        progress: Callable[[int, int], None] | None = None,
        reasons: bool = False,
    ) -> pl.DataFrame:
        """Score a canonical dataset in (ts, event_id) order through the live scoring path.

        Fraud labels become known at their label_ts (replay_batches). `progress(done, total)` is called
        after each micro-batch. Returns event_id, account_id, ts, score, logit, alert (and is_fraud when
        the frame has it), in (ts, event_id) order; with `reasons`, also each alert's reasons (a list of
        {input, text, logit}, largest first) and history_logit, null for the other events.
        """
        if reasons and self.explainer is None:
            raise ValueError(
                "replay(reasons=True) needs a Scorer that gives reasons: Scorer(model, reasons=3)"
            )
        ordered = frame.sort("ts", "event_id")
        event_ids = ordered["event_id"].to_list()
        logits = []
        explained: dict[int, Explanation] = {}
        done = 0
        # replay_batches cuts `ordered` into consecutive slices of batch_events rows, in this same order.
        for events, labels in replay_batches(ordered, batch_events):
            ids = event_ids[done : done + len(events.ts_us)]
            out = self._score_batch(events, ids, None, labels, explain=reasons)
            if out.rejected:
                first = out.rejected[0]
                raise ValueError(
                    f"replay: {len(out.rejected)} event(s) of rows {done}..{done + len(events.ts_us) - 1} (in "
                    f"(ts, event_id) order) were not applied, first row {done + first.index}: {first.reason}. "
                    "Fix the dataset (txsentinel ingest checks it) and replay again"
                )
            logits.append(out.logit)
            explained.update((done + m, e) for m, e in out.reasons.items())
            done += len(out.logit)
            if progress is not None:
                progress(done, ordered.height)
        logit = np.concatenate(logits) if logits else np.empty(0)
        score = sigmoid(logit)
        columns = [c for c in ("event_id", "account_id", "ts") if c in ordered.columns]
        return ordered.select(columns).with_columns(
            pl.Series("score", score),
            pl.Series("logit", logit),
            pl.Series("alert", score >= self.threshold),
            *([ordered["is_fraud"]] if "is_fraud" in ordered.columns else []),
            *(_reason_columns(explained, ordered.height) if reasons else []),
        )


def _reason_columns(explained: dict[int, Explanation], n: int) -> list[pl.Series]:
    reasons: list[list[dict] | None] = [None] * n
    history: list[float | None] = [None] * n
    for i, e in explained.items():
        reasons[i] = [r.as_dict() for r in e.reasons]
        history[i] = e.history.logit
    return [
        pl.Series("reasons", reasons, dtype=REASONS_DTYPE),
        pl.Series("history_logit", history, dtype=pl.Float64),
    ]
