"""The service's metrics: its own counters, gauges and histograms, and the process's, for Prometheus.

`Metrics` is a prometheus_client collector over plain numbers: the service thread adds to them under one
lock, and a scrape reads them all at once. A batch's latencies go into a histogram as one numpy call
(searchsorted + bincount), where prometheus_client's Histogram takes one call and one lock per value: for
the 500 latencies of a poll, 0.05 ms against 2.7 ms on the service's thread (measured on the development
machine). Each Metrics has its own registry, with the
process (CPU, memory, open files), garbage-collector and Python version collectors of prometheus_client
beside it. consumers/runtime/endpoints.py serves it at /metrics.
"""

import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

# name -> (type, help). Counters only grow; gauges are set; histograms count observations into HISTOGRAMS'
# buckets (cumulative, as Prometheus expects) with their sum and count; an info metric is one sample of
# value 1 whose labels say what it describes, exposed once set_info() has given them.
METRICS = {
    "txsentinel_events_scored_total": ("counter", "Transactions scored (one score record each)."),
    "txsentinel_events_dead_lettered_total": ("counter", "Input messages sent to the dead-letter topic."),
    "txsentinel_alerts_total": ("counter", "Scores at or above the alert threshold."),
    "txsentinel_labels_applied_total": ("counter", "Labels read from the labels topic and applied."),
    "txsentinel_batches_total": ("counter", "Polls processed and committed in one transaction each."),
    "txsentinel_duplicates_dropped_total": ("counter", "Redelivered events already applied (not rescored)."),
    "txsentinel_states_discarded_total": (
        "counter",
        "Account state records (the challenger's too) refused as corrupt on restore or read back: those "
        "accounts start from no history.",
    ),
    "txsentinel_positions_repaired_total": (
        "counter",
        "Events applied although their account's last applied position was past every offset read (corrupt).",
    ),
    "txsentinel_replays_dropped_total": (
        "counter",
        "Events whose event_id their account had applied already, at another offset (dead-lettered).",
    ),
    "txsentinel_records_rekeyed_total": (
        "counter",
        "Transactions whose key was not their account_id, written again under it (key_mismatch: rekey).",
    ),
    "txsentinel_unknown_fields_total": (
        "counter",
        "Input messages (transactions and labels) with fields of no known name, read all the same "
        "(unknown_fields: ignore; refuse dead-letters them).",
    ),
    "txsentinel_careful_batches_total": (
        "counter",
        "Batches read again one event at a time after a failure nobody foresaw (the failing event dead-lettered).",
    ),
    "txsentinel_aborted_transactions_total": ("counter", "Transactions aborted (batch redelivered)."),
    "txsentinel_states_evicted_total": (
        "counter",
        "Dormant account states let go of from memory beyond max_states_in_memory.",
    ),
    "txsentinel_accounts_let_go_total": (
        "counter",
        "Accounts let go past max_accounts_kept, the least recently written first, a changelog tombstone each: "
        "their next events start again from the model's initial state.",
    ),
    "txsentinel_states_reloaded_total": (
        "counter",
        "Dormant account states read back from the changelog when their account returned.",
    ),
    "txsentinel_restore_seconds_total": (
        "counter",
        "Time spent restoring account states from the changelog.",
    ),
    "txsentinel_restored_states_total": ("counter", "Account state records read from the changelog."),
    "txsentinel_changelog_records_read_total": (
        "counter",
        "Changelog records read by restores of assigned partitions and by rewinds (the tail past what is known).",
    ),
    "txsentinel_states_rewound_total": (
        "counter",
        "Account states let go of after an aborted batch; their redelivered events read them back.",
    ),
    "txsentinel_states_in_memory": ("gauge", "Account states held in memory."),
    "txsentinel_assigned_partitions": ("gauge", "Transactions partitions assigned to this instance."),
    "txsentinel_ready": (
        "gauge",
        "1 when /readyz answers 200 (started, its partitions assigned and restored), 0 otherwise.",
    ),
    "txsentinel_terminal_deltas_applied_total": (
        "counter",
        "Other scorers' batches of terminal event counts folded into this instance's terminal state.",
    ),
    "txsentinel_labels_held_total": (
        "counter",
        "Labels dated on a day its holder's clock had not reached, their partition paused until that day "
        "(holder: scorer or writer).",
    ),
    "txsentinel_feed_records_lost_total": (
        "counter",
        "Labels and terminal-delta records deleted before this process read them (lost_feed_position: earliest).",
    ),
    "txsentinel_terminals_evicted_total": (
        "counter",
        "Idle terminals deleted from the terminal table, a tombstone each (terminal_idle_days; the table writer).",
    ),
    "txsentinel_terminals_capped_total": (
        "counter",
        "Terminals let go before they were idle because their holder held more than max_terminals_in_memory "
        "(holder: scorer, from this instance's memory; writer, from the table, a tombstone each).",
    ),
    "txsentinel_terminals_in_memory": ("gauge", "Terminals held in this instance's scoring memory."),
    "txsentinel_terminal_table_flushes_total": (
        "counter",
        "Transactions of the terminal table writer (only the instance that owns transactions partition 0).",
    ),
    "txsentinel_consumer_lag": (
        "gauge",
        "Records of the assigned transactions partitions not yet consumed (high watermark - position).",
    ),
    "txsentinel_batch_events": ("histogram", "Input records per poll (one batch, one transaction)."),
    "txsentinel_batch_seconds": (
        "histogram",
        "Main-thread time per batch: decode, score, encode and send (not the commit, which runs behind).",
    ),
    "txsentinel_commit_seconds": (
        "histogram",
        "Per batch: joining the offsets to the transaction and committing it (on the committer thread).",
    ),
    "txsentinel_latency_seconds": (
        "histogram",
        "End-to-end latency: the input record's timestamp to the commit that made its score visible.",
    ),
    # Drift and state health (consumers/runtime/drift.py, state_health.py), refreshed every drift_refresh_s
    # over the last drift_window_events scored events; the labelled ones are in LABELLED.
    "txsentinel_feature_psi": (
        "gauge",
        "Population stability index of each input feature over the window against its training distribution.",
    ),
    "txsentinel_feature_psi_max": ("gauge", "The largest txsentinel_feature_psi (NaN without a reference)."),
    "txsentinel_score_psi": (
        "gauge",
        "Population stability index of the scores over the window against the validation scores (NaN: none).",
    ),
    "txsentinel_drift_reference": (
        "gauge",
        "1 when the model carries the reference drift is measured against (of: features, scores), 0 when not.",
    ),
    "txsentinel_drift_window_events": ("gauge", "Scored events in the drift window."),
    "txsentinel_window_alerts_per_day": (
        "gauge",
        "Alerts per day of event time over the drift window: alerts per event times the events a day between its "
        "10th and 90th percentile event times (this instance's partitions only; NaN: that span under a minute).",
    ),
    "txsentinel_alert_budget_per_day": (
        "gauge",
        "The alert budget the model's threshold was chosen for (meta alert_budget; NaN: unknown).",
    ),
    "txsentinel_state_norm": (
        "gauge",
        "Percentiles (quantile: 0.5, 0.9, 0.99, 1) of the L2 norm of the held account states.",
    ),
    "txsentinel_states_initial_ratio": (
        "gauge",
        "Share of the held account states still equal to the initial state (no history).",
    ),
    "txsentinel_states_nonfinite": ("gauge", "Held account states with a value that is not finite."),
    "txsentinel_nonfinite_guards_total": (
        "counter",
        "Events stopped before they changed a state because their feature row was not finite (dead-lettered).",
    ),
    "txsentinel_alert_reasons_failed_total": (
        "counter",
        "Alerts sent without their reasons because explaining them raised (scored and alerted all the same).",
    ),
    "txsentinel_model_info": (
        "info",
        "The model this instance serves: registered name and version, detector, feature version, source URI.",
    ),
}
# labelled metrics: name -> their label. A gauge's values are set together, one per label value
# (set_labelled); a counter's one label value at a time (inc and set with `label`).
LABELLED = {
    "txsentinel_feature_psi": "feature",
    "txsentinel_drift_reference": "of",
    "txsentinel_state_norm": "quantile",
    "txsentinel_terminals_capped_total": "holder",
    "txsentinel_labels_held_total": "holder",
}
HISTOGRAMS = {
    "txsentinel_batch_events": (1, 10, 50, 100, 250, 500, 1000, 2000, 5000),
    "txsentinel_batch_seconds": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    "txsentinel_commit_seconds": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    "txsentinel_latency_seconds": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
}


class Histogram:
    """Counts per upper bound `le` (non-cumulative here, made cumulative when collected), sum and count."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        # side="left": a value equal to a bound counts in that bound's bucket (le = less or equal)
        self.counts += np.bincount(
            np.searchsorted(self.bounds, values, side="left"), minlength=len(self.counts)
        )
        self.sum += float(values.sum())

    def buckets(self) -> list[tuple[str, int]]:
        """[(le, cumulative count)], +Inf last, as HistogramMetricFamily takes them."""
        cumulative = np.cumsum(self.counts)
        les = [f"{b:g}" for b in self.bounds] + ["+Inf"]
        return [(le, int(c)) for le, c in zip(les, cumulative, strict=True)]


class Metrics:
    """Thread-safe named values; the service thread writes, a scrape reads (a prometheus_client collector)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values = {
            name: 0.0
            for name, (kind, _) in METRICS.items()
            if kind in ("counter", "gauge") and name not in LABELLED
        }
        self._labelled: dict[str, dict[str, float]] = {name: {} for name in LABELLED}
        self._histograms = {name: Histogram(bounds) for name, bounds in HISTOGRAMS.items()}
        self._info: dict[str, dict[str, str]] = {}
        self._read: dict[str, Callable[[], float]] = {}  # gauges read when scraped
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        for collector in (ProcessCollector, GCCollector, PlatformCollector):
            collector(registry=self.registry)

    def inc(self, name: str, amount: float = 1.0, label: str | None = None) -> None:
        """Add to `name`, or to its sample of label value `label` (a labelled counter)."""
        with self._lock:
            if label is None:
                self._values[name] += amount
            else:
                samples = self._labelled[name]
                samples[label] = samples.get(label, 0.0) + amount

    def set(self, name: str, value: float, label: str | None = None) -> None:
        """Set `name`, or its sample of label value `label` (a labelled counter set from a running total)."""
        with self._lock:
            if label is None:
                self._values[name] = float(value)
            else:
                self._labelled[name][label] = float(value)

    def set_labelled(self, name: str, values: dict[str, float]) -> None:
        """Labelled gauge `name`: one sample per {label value: value}, replacing the previous ones."""
        if name not in LABELLED:
            raise ValueError(f"metric {name} has no label; labelled metrics: {sorted(LABELLED)}")
        with self._lock:
            self._labelled[name] = {str(key): float(value) for key, value in values.items()}

    def observe(self, name: str, values) -> None:
        """Add one value, or an array of them, to histogram `name`."""
        with self._lock:
            self._histograms[name].observe(values)

    def set_info(self, name: str, labels: dict[str, str]) -> None:
        """Give info metric `name` (its name ends in _info) its labels."""
        if METRICS[name][0] != "info":
            raise ValueError(f"metric {name} is a {METRICS[name][0]}, not an info metric")
        with self._lock:
            self._info[name] = {key: str(value) for key, value in labels.items()}

    def read_from(self, name: str, read: Callable[[], float]) -> None:
        """Gauge `name` is `read()` at each scrape (from the scrape's thread) instead of a set value."""
        if METRICS[name][0] != "gauge":
            raise ValueError(f"metric {name} is a {METRICS[name][0]}, not a gauge")
        self._read[name] = read

    def get(self, name: str) -> float:
        with self._lock:
            return self._values[name]

    def collect(self) -> Iterator[Metric]:  # prometheus_client's collector protocol
        with self._lock:
            values = dict(self._values)
            histograms = {name: (h.buckets(), h.sum) for name, h in self._histograms.items()}
            info = {name: dict(labels) for name, labels in self._info.items()}
            labelled = {name: dict(samples) for name, samples in self._labelled.items()}
        values.update({name: float(read()) for name, read in self._read.items()})
        for name, (kind, text) in METRICS.items():
            if name in LABELLED:
                of_kind = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                family = of_kind(name, text, labels=[LABELLED[name]])
                for key, value in labelled[name].items():
                    family.add_metric([key], value)
                yield family
            elif kind == "counter":
                yield CounterMetricFamily(name, text, value=values[name])
            elif kind == "gauge":
                yield GaugeMetricFamily(name, text, value=values[name])
            elif kind == "histogram":
                buckets, total = histograms[name]
                yield HistogramMetricFamily(name, text, buckets=buckets, sum_value=total)
            elif name in info:  # InfoMetricFamily adds the _info suffix itself
                yield InfoMetricFamily(name.removesuffix("_info"), text, value=info[name])

    def render(self) -> str:
        """Everything /metrics serves, in the Prometheus text format (version 0.0.4)."""
        return generate_latest(self.registry).decode()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (for a metrics endpoint in tests and benchmarks)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def scrape(port: int, name: str, host: str = "127.0.0.1") -> float:
    """One value from a service's /metrics: a counter, a gauge, or a histogram's `_sum` or `_count`."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise ValueError(f"metric {name} not found at {host}:{port}/metrics")
