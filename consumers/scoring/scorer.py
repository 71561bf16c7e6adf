"""The micro-batched scoring engine: the one path from transactions to scores, for the service and the backtest.

Per micro-batch (one Kafka poll, or one slice of a replayed history), in arrival order:
  1. drop events already applied (applied_events.py): (partition, offset) <= the account's last applied
     position in that partition. Each account state records that position, so a redelivery (a crash between
     producing the scores and committing the offsets) changes nothing, with or without Kafka transactions;
  2. reject replays: an event whose event_id is among its account's last RECENT_EVENT_IDS (or earlier in
     this batch) — the same event at another offset, e.g. a producer's retry — is not applied again;
  3. reject an amount outside 0..MAX_AMOUNT (pipeline/data/schema.py: the rule every entry point keeps; the
     service's decoder is stricter still): its account's state would hold what a restore refuses;
  4. featurize the rest with the streaming featurizer, in one call; an event whose feature row is not
     finite is rejected before it changes any state (StreamingFeaturizer.transform_finite);
  5. normalise with the model's feature spec: x = [features, terminal bucket] [N, F + 1];
  6. step the detector in rounds: round r holds the r-th event of every account in the batch, so each
     account's events go in order, and each round is ONE batched step over its accounts (gather their
     states from the store, step, scatter back). A score that is not finite raises: it is a fault, which
     the caller's rollback and last resort deal with;
  7. bookkeeping: each account's last applied position, newest ts and recent event ids, the set of changed
     accounts;
  8. reasons for the alerts (explain.py): each alerted event's logit attributed with its account's state
     before the event held fixed, from a copy of the batch's states taken before step 6. Should that raise,
     the alerts go out without reasons, counted (stats.reasons_failed) and logged: never a rejected event;
  9. with a shadow challenger (shadow.py), its detector steps the same feature rows from its own states,
     and its rows copy the champion's bookkeeping.
Rejected events come back with the reason (score_batch), for the service's dead-letter topic. The backtest
replays a dataset through this same step (history_replay.py: Scorer.replay).

State lives in two places per account — the featurizer's account record and a row of the batched detector
store — and leaves as one byte record (account_state.py) for the changelog (held_accounts.py: records out
and in, eviction). The featurizer's terminal
table is NOT per account: every event reads the risk of its terminal, whoever's account it is. It lives in
`scorer.featurizer.terminals`; the service persists and restores it as the global terminal-risk table
(consumers/terminals/table.py), and nothing here saves or restores it with the accounts.

An exception out of `score` (none is expected for validated messages) may leave the accounts of that batch
half-applied: treat it as a crash and restore those accounts from the changelog, or from a checkpoint
taken before (checkpoint, rollback).
"""

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from consumers.scoring.account_state import RECENT_EVENT_IDS, model_fingerprint
from consumers.scoring.applied_events import not_yet_applied, replayed
from consumers.scoring.explain import AlertExplainer, Snapshot
from consumers.scoring.held_accounts import HeldAccounts
from consumers.scoring.history_replay import HistoryReplay
from consumers.scoring.messages import Transaction
from consumers.scoring.results import Rejected, Scored, ScoredArrays, ScoreRecord, ScorerStats, sigmoid
from consumers.scoring.shadow import ShadowModel
from consumers.scoring.state_store import StateStore, rounds_of
from pipeline.data.schema import AMOUNT_RANGE, amount_outside
from pipeline.features.definitions import DAY_US
from pipeline.features.reasons import Explanation
from pipeline.features.stream import StreamingFeaturizer
from pipeline.features.stream_batches import EventBatch, LabelBatch, event_id_hashes, take_events
from pipeline.registry.artifact import DEFAULT_THRESHOLD, LoadedModel

log = logging.getLogger(__name__)
REASONS_LOG_EVERY_S = 60.0  # a failure to explain alerts is logged at most this often (the first at once)


class Scorer(HeldAccounts, HistoryReplay):
    """Scores micro-batches of transactions from per-account recurrent states, one event at a time each.

    The detector is put in eval mode. `threshold` (a probability) defaults to the model's meta["threshold"],
    else 0.5. `reasons`: how many reasons each alert's record carries (0: none, and no cost). `shadow`: a
    challenger stepped on the same events with states of its own (shadow.py), scored in Scored.shadow_logit.
    """

    def __init__(
        self,
        model: LoadedModel,
        threshold: float | None = None,
        reasons: int = 3,
        shadow: LoadedModel | None = None,
    ):
        detector, spec = model.detector, model.spec
        spec.check_compatible()
        c = detector.config
        if (c.num_features, c.terminal_buckets) != (spec.num_features, spec.terminal_buckets):
            raise ValueError(
                f"model {model.source or detector.name!r}: the detector takes {c.num_features} features and "
                f"{c.terminal_buckets} terminal buckets, its feature spec gives {spec.num_features} and "
                f"{spec.terminal_buckets}; the artifact is inconsistent: retrain or re-export it"
            )
        weights = next(detector.parameters()).dtype
        if weights not in (torch.float32, torch.float64):
            raise ValueError(
                f"model {model.source or detector.name!r} has {weights} weights; serving state and inputs must "
                "be float32 at least: cast it first (model.detector.float())"
            )
        if threshold is None:
            threshold = model.meta.get("threshold", DEFAULT_THRESHOLD)
        if not 0.0 <= float(threshold) <= 1.0:
            raise ValueError(f"threshold {threshold!r}: expected a probability in [0, 1]")
        self.detector = detector.eval()
        self.spec = spec
        self.threshold = float(threshold)
        self.featurizer = StreamingFeaturizer()
        self.store = StateStore(detector)
        self.model_fingerprint = model_fingerprint(detector)
        self.stats = ScorerStats()
        # {partition: the highest offset read from it, or below its log end (note_log_ends)}: a state's last
        # applied position past it is one no event gave
        self.newest_read: dict[int, int] = {}
        self.explainer = AlertExplainer(self.detector, reasons) if reasons else None
        self._reasons_log_at = 0.0  # time.monotonic() from which a failure to explain is logged again
        self._x_dtype = weights
        self._changed: set[str] = set()
        self.shadow = None if shadow is None else ShadowModel(shadow, spec)
        # Called with each applied batch's features [M, F] (before normalisation), scores [M] and ts [M]:
        # the service's drift window (consumers/runtime/drift.py) counts what it commits
        self.on_scored: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None
        self._warm_up()

    @torch.inference_mode()
    def _warm_up(self) -> None:
        # A detector's first serving step loads its compiled kernel (the linear Transformer's: 0.4 s from
        # numba's cache, 1.5 s to compile on a fresh checkout): here, not on the first batch's latency.
        x = torch.zeros(
            1, self.detector.config.num_features + 1, dtype=self._x_dtype, device=self.detector.device
        )
        self.detector.step(x, self.detector.init_state(1))
        if self.shadow is not None:
            self.shadow.detector.step(x.to(self.shadow.detector.device), self.shadow.detector.init_state(1))

    # -- scoring -----------------------------------------------------------------------------------------
    def score(
        self,
        transactions: Sequence[Transaction],
        positions: Sequence[tuple[int, int]] | None = None,
        labels: LabelBatch | None = None,
    ) -> list[ScoreRecord]:
        """score_batch's records: one per applied event, in input order (rejected events are counted in
        stats; score_batch says which and why)."""
        return self.score_batch(transactions, positions, labels).records

    def score_batch(
        self,
        transactions: Sequence[Transaction],
        positions: Sequence[tuple[int, int]] | None = None,
        labels: LabelBatch | None = None,
        clock_us: int | None = None,
    ) -> Scored:
        """Apply a micro-batch (arrival order): one record per applied event, and the events rejected, with
        the reason, each in input order (module docstring: what is dropped and what is rejected).

        positions: (partition, offset) of each transaction in its source topic; events at or before their
        account's last applied position in that partition are dropped (counted in stats). None: apply all.
        labels: labels that became known during this batch (see StreamingFeaturizer.transform).
        clock_us: the live service's clock. An event dated past the clock's day (a producer's clock skew,
        up to max_ts_skew_s, across midnight) is featurized and stepped as of the day's last microsecond,
        so that it moves no account's or terminal's day forward before the clock gets there: one event
        stamped 00:20 at 23:30 would otherwise end every other account's windows at that terminal on
        tomorrow until midnight. Within the day an event keeps its own ts (featurized the same whenever it
        is read), and every score record keeps it. None (a replay of history): every event at its own ts.
        """
        n = len(transactions)
        pos = None
        if positions is not None:
            pos = np.asarray(positions, dtype=np.int64).reshape(-1, 2) if n else np.empty((0, 2), np.int64)
            if len(pos) != n:
                raise ValueError(
                    f"{len(pos)} positions for {n} transactions: give one (partition, offset) each"
                )
            if n and int(pos.min()) < 0:
                bad = int(np.flatnonzero((pos < 0).any(axis=1))[0])
                raise ValueError(
                    f"transaction {transactions[bad].event_id!r}: position {tuple(pos[bad].tolist())} is "
                    "negative; expected the Kafka (partition, offset) it was read from"
                )
        events = EventBatch(
            account_ids=[t.account_id for t in transactions],
            terminal_ids=[t.terminal_id for t in transactions],
            ts_us=np.fromiter((t.ts_us for t in transactions), dtype=np.int64, count=n),
            amounts=np.fromiter((t.amount for t in transactions), dtype=np.float64, count=n),
        )
        stamped_us = None  # the events' own ts where the clamp below moved one: what out_of_order compares
        if clock_us is not None:
            last_of_day = (clock_us // DAY_US + 1) * DAY_US - 1
            if int(events.ts_us.max(initial=0)) > last_of_day:
                stamped_us = events.ts_us.copy()
                np.minimum(events.ts_us, last_of_day, out=events.ts_us)
        out = self._score_batch(
            events, [t.event_id for t in transactions], pos, labels, stamped_us=stamped_us
        )
        records = [
            ScoreRecord(
                event_id=transactions[i].event_id,
                account_id=transactions[i].account_id,
                ts_us=transactions[i].ts_us,
                score=score,
                logit=logit,
                alert=alert,
                out_of_order=late,
                position=None if positions is None else tuple(positions[i]),
            )
            for i, logit, score, alert, late in zip(
                out.applied.tolist(),
                out.logit.tolist(),
                out.score.tolist(),
                out.alert.tolist(),
                out.out_of_order.tolist(),
                strict=True,
            )
        ]
        return Scored(records, out.rejected, out.reasons, out.shadow_logit)

    def note_log_ends(self, ends: dict[int, int]) -> None:
        """{partition: its log end offset} of the source topic, told by a service before it reads: every
        position an event gave lies below it, though this instance may not have read there (a restore whose
        group's committed offsets are behind its states: offsets that expired, a new group_id). Without it
        only what this scorer has read bounds the positions its states may hold."""
        for partition, end in ends.items():
            self.newest_read[partition] = max(self.newest_read.get(partition, -1), end - 1)

    def observe_labels(self, labels: LabelBatch) -> None:
        """Apply labels that arrive between batches (label_ts <= every later event's ts)."""
        self.featurizer.observe_labels(labels)

    def _positions_ahead(self, events: EventBatch, ahead: list[int], pos: np.ndarray) -> None:
        i = ahead[0]
        account, (partition, offset) = events.account_ids[i], pos[i].tolist()
        log.error(
            "account state records past every offset read: accounts=%d first=%r partition=%d offset=%d "
            "its_last_applied=%d; no event gave that position (a corrupt changelog record), and it would "
            "drop every later event of the account as applied already: their events are applied and their "
            "positions replaced",
            len(ahead), account, partition, offset, int(self.store.offset[self.store.rows([account])[0]]),
        )  # fmt: skip
        self.stats.positions_repaired += len(ahead)

    @torch.inference_mode()
    def _score_batch(
        self,
        events: EventBatch,
        event_ids: Sequence[str] | None,
        pos: np.ndarray | None,
        labels: LabelBatch | None,
        explain: bool = True,
        stamped_us: np.ndarray | None = None,
    ) -> ScoredArrays:
        # explain: reasons for the alerts, when the scorer gives reasons at all; stamped_us [N]: the events'
        # own ts, where events.ts_us holds them clamped to the clock's day (score's docstring), so that an
        # event is out of order against the ts its account's events were stamped with
        started = time.perf_counter()
        n = len(events.ts_us)
        rows = self.store.rows(events.account_ids)  # [N]; new accounts start from init_state
        keep = np.ones(n, dtype=bool)
        last_position = None
        if pos is not None:
            for partition, offset in zip(pos[:, 0].tolist(), pos[:, 1].tolist(), strict=True):
                self.newest_read[partition] = max(self.newest_read.get(partition, -1), offset)
            keep, last_position, ahead = not_yet_applied(self.store, rows, pos, self.newest_read)
            if ahead:
                self._positions_ahead(events, ahead, pos)
        duplicates = n - int(keep.sum())
        rejected: list[Rejected] = []
        hashes = None
        if event_ids is not None:
            hashes = event_id_hashes(event_ids)
            for i in replayed(self.store, rows, hashes, keep):
                keep[i] = False
                rejected.append(
                    Rejected(
                        i,
                        f"event_id {event_ids[i]!r} was applied already to account {events.account_ids[i]!r} "
                        f"(among its last {RECENT_EVENT_IDS} events, or earlier in this batch): the same event "
                        "at another offset, e.g. a producer's retry; not applied again",
                        replay=True,
                    )
                )
        replays = len(rejected)
        refused = self._refuse_amounts(events, event_ids, keep, rejected)
        applied = np.flatnonzero(keep)
        logit = score = np.empty(0)
        late = np.empty(0, dtype=bool)
        reasons = {}
        shadow_logit = None if self.shadow is None else np.empty(0)
        if len(applied):
            t = time.perf_counter()
            part = take_events(events, applied)
            # [M, F] float64, [M] int64; events whose row is not finite are left out, changing no state
            features, buckets, kept, left_out = self.featurizer.transform_finite(part, labels)
            self.stats.featurize_s += time.perf_counter() - t
            for j, names in left_out.items():
                i = int(applied[j])
                name = repr(event_ids[i]) if event_ids is not None else f"number {i}"
                rejected.append(
                    Rejected(
                        i,
                        f"the features of event {name} are not finite ({', '.join(names)}): its amount or time "
                        f"overflows the sums of account {events.account_ids[i]!r}; not applied",
                        replay=False,
                    )
                )
            applied = applied[kept]
            if len(applied):
                ts_us = events.ts_us[applied]
                x = np.concatenate(
                    [self.spec.normalize(features), buckets[:, None].astype(np.float32)], axis=1
                )
                explainer = self.explainer if explain else None
                t = time.perf_counter()
                snapshot = explainer.snapshot(self.store.states, rows[applied]) if explainer else None
                self.stats.explain_s += time.perf_counter() - t
                stamped = ts_us if stamped_us is None else stamped_us[applied]
                logit, late = self._step_events(rows[applied], torch.from_numpy(x), stamped)  # x [M, F + 1]
                if not np.isfinite(logit).all():
                    bad = int(applied[np.flatnonzero(~np.isfinite(logit))[0]])
                    raise FloatingPointError(
                        f"the detector's score of event number {bad} (account {events.account_ids[bad]!r}) is "
                        "not finite: its state is not either. A fault of the model, not of the input"
                    )
                score = sigmoid(logit)
                if self.shadow is not None:
                    t = time.perf_counter()
                    accounts = [events.account_ids[i] for i in applied.tolist()]
                    shadow_logit = self.shadow.step(accounts, features, buckets)  # [M]
                    self.stats.shadow_s += time.perf_counter() - t
                if self.on_scored is not None:
                    self.on_scored(features, score, ts_us)
                if explainer is not None:
                    t = time.perf_counter()
                    reasons = self._explain(snapshot, rows[applied], x, features, score)
                    self.stats.explain_s += time.perf_counter() - t
                if hashes is not None:
                    self.store.remember_ids(rows[applied], hashes[applied])
                self._changed.update(events.account_ids[i] for i in applied.tolist())
        elif labels is not None:
            self.featurizer.observe_labels(labels)
        if last_position is not None:
            for row, (partition, offset) in last_position.items():
                self.store.partition[row], self.store.offset[row] = partition, offset
        if self.shadow is not None and len(applied):
            self.shadow.mirror(
                list(dict.fromkeys(events.account_ids[i] for i in applied.tolist())), self.store
            )
        rejected.sort()
        out = ScoredArrays(
            applied, logit, score, score >= self.threshold, late, rejected, reasons, shadow_logit
        )
        m = len(applied)
        self.stats.batches += 1
        self.stats.events_in += n
        self.stats.events_applied += m
        self.stats.duplicates_dropped += duplicates
        self.stats.replays_dropped += replays
        self.stats.amounts_refused += refused
        self.stats.not_finite += len(rejected) - replays - refused
        self.stats.out_of_order += int(out.out_of_order.sum())
        self.stats.total_s += time.perf_counter() - started
        return out

    def _refuse_amounts(
        self, events: EventBatch, event_ids: Sequence[str] | None, keep: np.ndarray, rejected: list[Rejected]
    ) -> int:
        """Take the events kept [N] whose amount lies outside what an event may hold out of `keep`, each into
        `rejected` with the reason; -> how many."""
        outside = np.flatnonzero(keep & amount_outside(events.amounts)).tolist()
        for i in outside:
            keep[i] = False
            name = repr(event_ids[i]) if event_ids is not None else f"number {i}"
            rejected.append(
                Rejected(
                    i,
                    f"the amount {float(events.amounts[i])!r} of event {name} (account "
                    f"{events.account_ids[i]!r}) is not {AMOUNT_RANGE}, what its account's state holds (a "
                    "state holding more could not be restored); not applied",
                    replay=False,
                )
            )
        return len(outside)

    def _explain(
        self, snapshot: Snapshot, rows: np.ndarray, x: np.ndarray, features: np.ndarray, score: np.ndarray
    ) -> dict[int, Explanation]:
        # The alerts' reasons; should explaining them raise, the alerts go out without (counted, logged at
        # most every REASONS_LOG_EVERY_S): a reason is worth less than the alert, and the events are scored
        # and applied already (the explainer steps copies of their states only).
        alerts = np.flatnonzero(score >= self.threshold)
        try:
            return self.explainer.explain(snapshot, rows, torch.from_numpy(x), features, alerts)
        except Exception as error:
            self.stats.reasons_failed += len(alerts)
            now = time.monotonic()
            if now >= self._reasons_log_at:
                self._reasons_log_at = now + REASONS_LOG_EVERY_S
                log.error(
                    "alert reasons: explaining %d alerts of %s raised; they go out without reasons "
                    "(%d so far; this message at most every %.0f s) error=%r",
                    len(alerts), self.detector.name, self.stats.reasons_failed, REASONS_LOG_EVERY_S, error,
                    exc_info=error,
                )  # fmt: skip
            return {}

    def _step_events(
        self, rows: np.ndarray, x: torch.Tensor, ts_us: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        # rows [M], x [M, F + 1], ts_us [M] -> logits [M] float64, out-of-order flags [M], arrival order
        t = time.perf_counter()
        newest = self.store.last_ts_us
        late = np.empty(len(rows), dtype=bool)
        for sel in rounds_of(rows):  # [b] one event of each of b accounts, their k-th in round k
            account_rows = rows[sel]
            late[sel] = ts_us[sel] < newest[account_rows]
            newest[account_rows] = np.maximum(newest[account_rows], ts_us[sel])
        x = x.to(device=self.detector.device, dtype=self._x_dtype)
        logit = self.store.step(rows, x).to("cpu", torch.float64).numpy()
        self.stats.detector_s += time.perf_counter() - t
        return logit, late
