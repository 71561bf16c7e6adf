"""What the service counts: ServeStats (returned by serve() and logged when it stops), the metrics of each
committed batch and the model it serves (consumers/runtime/metrics.py)."""

import logging
import time
from dataclasses import dataclass

import numpy as np

from consumers.runtime.state_health import publish_state_health, state_health
from consumers.service.commit_pipeline import Committed
from pipeline.registry.artifact import LoadedModel
from pipeline.registry.tracking import registered_version

log = logging.getLogger(__name__)


@dataclass
class ServeStats:
    batches: int = 0
    events_scored: int = 0
    dead_lettered: int = 0
    alerts: int = 0
    duplicates_dropped: int = 0
    replays_dropped: int = 0  # an event_id its account had applied already, at another offset (dead-lettered)
    rekeyed: int = 0  # records written again under their account's key (key_mismatch: rekey)
    careful_batches: int = 0  # batches read again one event at a time after an unforeseen failure
    aborted_batches: int = 0
    # partitions taken from or given to this member: a cooperative rebalance may do either, both or neither, so
    # a member that joins, takes over a frozen member's partitions and gives some back counts 3
    rebalances: int = 0
    restored_states: int = 0
    restore_s: float = 0.0
    changelog_records_read: int = 0  # by restores of assigned partitions and by rewinds
    states_rewound: int = 0  # accounts of aborted batches let go of (read back when their events return)
    # fraud and not-fraud labels read and applied (only fraud changes state); those after the table's
    # positions are read again by each restore, and count again
    labels_applied: int = 0
    restored_terminals: int = 0  # terminal records read from the table, at start and after aborts
    terminal_deltas_applied: int = 0  # other instances' batches of terminal counts folded in
    terminal_table_flushes: int = 0  # the table writer's flushes (each 1+ transactions), while it ran here
    states_evicted: int = 0  # dormant accounts let go of beyond max_states_in_memory
    states_reloaded: int = 0  # dormant accounts read back from the changelog when they returned
    # past max_accounts_kept, deleted from the changelog: they start again if they return
    accounts_let_go: int = 0
    states_discarded: int = 0  # account state records refused as corrupt (restore or read back)
    unknown_fields: int = 0  # input messages with fields of no known name, read all the same
    terminals_capped: int = 0  # let go of before they were idle, beyond max_terminals_in_memory


def model_info(model: LoadedModel) -> dict[str, str]:
    """The labels of txsentinel_model_info: registered name and version (empty for a run URI or a directory),
    detector, feature version and the URI the service was given."""
    # load_model pins an alias to its version in meta: naming that one asks the registry nothing, and names
    # what is served even if the alias has moved since
    pinned = str(model.meta.get("model_version", ""))
    uri = pinned if pinned.startswith("models:/") else model.source
    try:
        name, version = registered_version(uri) or ("", "")
    except Exception as error:  # a label of a metric is not worth failing the start for
        log.warning("model info: the registered version of %s is unknown error=%r", model.source, error)
        name, version = "", ""
    return {
        "name": name,
        "version": version,
        "detector": model.name,
        "feature_version": str(model.spec.version),
        "source": model.source,
    }


class Bookkeeping:
    """The counting part of the service (loop._Service, whose __init__ and start() build the attributes used
    here)."""

    def _count(self, committed: Committed) -> None:
        """Stats and metrics of a committed batch."""
        out = committed.batch
        self.stats.batches += 1
        self.stats.events_scored += out.scored
        self.stats.alerts += out.alerts
        self.stats.dead_lettered += out.dead_lettered
        self.stats.duplicates_dropped += out.duplicates_dropped
        self.stats.replays_dropped += out.replays_dropped
        self.stats.rekeyed += out.rekeyed
        self.stats.careful_batches += out.careful
        self.stats.labels_applied += out.labels_applied
        self.stats.terminal_deltas_applied += out.deltas_applied
        self.stats.states_reloaded += out.reloaded
        self.stats.states_discarded += out.states_discarded
        self.stats.unknown_fields += out.unknown_fields
        self._let_dormant_go(committed)
        m = self.metrics
        m.inc("txsentinel_batches_total")
        m.inc("txsentinel_events_scored_total", out.scored)
        m.inc("txsentinel_alerts_total", out.alerts)
        m.inc("txsentinel_events_dead_lettered_total", out.dead_lettered)
        m.inc("txsentinel_duplicates_dropped_total", out.duplicates_dropped)
        m.inc("txsentinel_positions_repaired_total", out.positions_repaired)
        m.inc("txsentinel_replays_dropped_total", out.replays_dropped)
        m.inc("txsentinel_records_rekeyed_total", out.rekeyed)
        m.inc("txsentinel_careful_batches_total", out.careful)
        m.inc("txsentinel_labels_applied_total", out.labels_applied)
        m.inc("txsentinel_terminal_deltas_applied_total", out.deltas_applied)
        m.inc("txsentinel_states_reloaded_total", out.reloaded)
        m.inc("txsentinel_states_discarded_total", out.states_discarded)
        m.inc("txsentinel_unknown_fields_total", out.unknown_fields)
        m.set("txsentinel_states_in_memory", len(self.scorer.accounts_in_memory))
        self._count_terminals()
        m.set("txsentinel_consumer_lag", self._lag())
        m.observe("txsentinel_batch_events", out.events)
        m.observe("txsentinel_commit_seconds", committed.seconds)
        for features, scores, ts_us in out.observed:
            self.drift.observe(features, scores, ts_us)
        m.set("txsentinel_nonfinite_guards_total", self.scorer.stats.not_finite)
        m.set("txsentinel_alert_reasons_failed_total", self.scorer.stats.reasons_failed)
        self._refresh_health()
        if out.created_ms:
            waited_ms = committed.at_ms - np.asarray(out.created_ms, np.float64)
            m.observe("txsentinel_latency_seconds", np.maximum(waited_ms, 0.0) / 1000.0)
        if log.isEnabledFor(logging.DEBUG):
            phases = " ".join(f"{k}_s={v:.4f}" for k, v in out.seconds.items())
            log.debug(
                "batch events=%d scored=%d %s wait_s=%.4f commit_s=%.4f",
                out.events, out.scored, phases, out.waited_s, committed.seconds,
            )  # fmt: skip

    def _count_terminals(self) -> None:
        """The terminals held, and those let go beyond max_terminals_in_memory (after a batch, a fold of the
        feed or a restore: the cap has just been applied)."""
        self.stats.terminals_capped = self.batches.eviction.capped
        self.metrics.set("txsentinel_terminals_capped_total", self.stats.terminals_capped, label="scorer")
        self.metrics.set("txsentinel_terminals_in_memory", len(self.scorer.featurizer.terminals))

    def _refresh_health(self) -> None:
        """The drift and state-health gauges, every drift_refresh_s (on the service's thread, between batches:
        the states must not change under the reading)."""
        if time.monotonic() - self.health_at < self.cfg.drift_refresh_s:
            return
        self.health_at = time.monotonic()
        try:
            self.drift.publish(self.metrics)
            store = self.scorer.store
            rows = np.fromiter(store.slot_of.values(), dtype=np.int64, count=len(store.slot_of))
            health = state_health(store.states, rows, self.initial_state, self.health_rng)
            publish_state_health(health, self.metrics)
        except Exception:  # a gauge is not worth a batch: the service goes on, and says so
            log.exception("drift and state health: refresh failed")

    def _lag(self) -> int:
        """Records of the assigned partitions behind their high watermark (known from the last fetches)."""
        lag = 0
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            if high is not None:
                lag += max(high - self.consumer.position(tp), 0)
        return lag
