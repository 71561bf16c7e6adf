"""The scoring service's counters, served over HTTP in the Prometheus text format (version 0.0.4).

A handful of lines of text need no client library: `render()` writes them by hand, and a stdlib
ThreadingHTTPServer on a daemon thread serves them at /metrics. A connection that sends nothing, or too
slowly, is closed after REQUEST_TIMEOUT_S, so idle sockets cannot pile up threads in the service.
"""

import logging
import socket
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0  # a scrape takes milliseconds; a connection silent this long is dropped

# name -> (type, help). Counters only grow; gauges are set; histograms count observations into HISTOGRAMS'
# buckets (cumulative, as Prometheus expects) with their sum and count.
METRICS = {
    "txsentinel_events_scored_total": ("counter", "Transactions scored (one score record each)."),
    "txsentinel_events_dead_lettered_total": ("counter", "Input messages sent to the dead-letter topic."),
    "txsentinel_alerts_total": ("counter", "Scores at or above the alert threshold."),
    "txsentinel_labels_applied_total": ("counter", "Labels read from the labels topic and applied."),
    "txsentinel_batches_total": ("counter", "Polls processed and committed in one transaction each."),
    "txsentinel_duplicates_dropped_total": ("counter", "Redelivered events already applied (not rescored)."),
    "txsentinel_replays_dropped_total": (
        "counter",
        "Events whose event_id their account had applied already, at another offset (dead-lettered).",
    ),
    "txsentinel_records_rekeyed_total": (
        "counter",
        "Transactions whose key was not their account_id, written again under it (key_mismatch: rekey).",
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
    "txsentinel_terminal_deltas_applied_total": (
        "counter",
        "Other scorers' batches of terminal event counts folded into this instance's terminal state.",
    ),
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
}
HISTOGRAMS = {
    "txsentinel_batch_events": (1, 10, 50, 100, 250, 500, 1000, 2000, 5000),
    "txsentinel_batch_seconds": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    "txsentinel_commit_seconds": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    "txsentinel_latency_seconds": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
}


class Histogram:
    """Counts per upper bound `le` (non-cumulative here, made cumulative when rendered), sum and count."""

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

    def lines(self, name: str) -> list[str]:
        cumulative = np.cumsum(self.counts)
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.bounds, cumulative[:-1], strict=True)]
        return [
            *out,
            f'{name}_bucket{{le="+Inf"}} {cumulative[-1]}',
            f"{name}_sum {self.sum:.17g}",
            f"{name}_count {cumulative[-1]}",
        ]


class Metrics:
    """Thread-safe named values; the service thread writes, the HTTP thread reads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values = {name: 0.0 for name, (kind, _) in METRICS.items() if kind != "histogram"}
        self._histograms = {name: Histogram(bounds) for name, bounds in HISTOGRAMS.items()}

    def inc(self, name: str, amount: float = 1.0) -> None:
        with self._lock:
            self._values[name] += amount

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._values[name] = float(value)

    def observe(self, name: str, values) -> None:
        """Add one value, or an array of them, to histogram `name`."""
        with self._lock:
            self._histograms[name].observe(values)

    def get(self, name: str) -> float:
        with self._lock:
            return self._values[name]

    def render(self) -> str:
        with self._lock:
            lines = []
            for name, (kind, text) in METRICS.items():
                lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
                if kind == "histogram":
                    lines += self._histograms[name].lines(name)
                else:
                    lines.append(f"{name} {self._values[name]:.17g}")
        return "\n".join(lines) + "\n"


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a connection still open never holds up the service's exit
    block_on_close = False


class MetricsServer:
    """Serves `metrics.render()` at http://host:port/metrics until close(); port 0 in the config means off,
    so this class is only built for a real port."""

    def __init__(self, metrics: Metrics, host: str, port: int, request_timeout_s: float = REQUEST_TIMEOUT_S):
        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout_s  # the stdlib sets it on each connection's socket

            def do_GET(self):  # the stdlib names it
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served here")
                    return
                body = metrics.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args):  # scrapes every few seconds: not worth a log line
                pass

        try:
            self._server = _Server((host, port), Handler)
        except OSError as error:
            raise OSError(
                f"metrics endpoint: cannot listen on {host}:{port} ({error}); choose another metrics_port, or 0 "
                "to turn the endpoint off"
            ) from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="txs-metrics", daemon=True)
        self._thread.start()
        log.info("metrics endpoint url=http://%s:%d/metrics", host, self.port)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


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
