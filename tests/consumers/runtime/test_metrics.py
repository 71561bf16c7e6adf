"""The service's Prometheus text: counters, gauges and histograms as a scraper parses them, beside the
process's own metrics."""

import re
import socket
import time
import urllib.request

import pytest

from consumers.runtime.endpoints import StatusServer
from consumers.runtime.metrics import HISTOGRAMS, Metrics
from consumers.runtime.probes import Probes
from consumers.runtime.settings import ServeConfig


def parse(text: str) -> dict[str, float]:
    """'name{labels} value' lines -> {'name{labels}': value}; comments must be HELP or TYPE (of the
    service's metrics and, since prometheus_client serves them, the process's and the collector's too)."""
    values = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"# (HELP|TYPE) (txsentinel|process|python)_\w+ ", line), line
            continue
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
    return values


def test_histogram_buckets_are_cumulative_with_le_inclusive():
    metrics = Metrics()
    metrics.observe("txsentinel_latency_seconds", [0.005, 0.004, 0.02, 0.3, 99.0])
    metrics.observe("txsentinel_latency_seconds", 0.05)
    values = parse(metrics.render())
    bucket = 'txsentinel_latency_seconds_bucket{le="%s"}'
    assert values[bucket % "0.005"] == 2  # 0.004 and the bound itself
    assert values[bucket % "0.025"] == 3
    assert values[bucket % "0.05"] == 4
    assert values[bucket % "0.5"] == 5
    assert values[bucket % "30"] == 5
    assert values[bucket % "+Inf"] == 6 == values["txsentinel_latency_seconds_count"]
    assert values["txsentinel_latency_seconds_sum"] == pytest.approx(99.379)
    # Buckets never decrease, in the order of their bounds.
    for name, bounds in HISTOGRAMS.items():
        counts = [values[f'{name}_bucket{{le="{b:g}"}}'] for b in bounds]
        assert counts == sorted(counts)


def test_counters_and_gauges_render_and_serve_over_http():
    metrics = Metrics()
    metrics.inc("txsentinel_events_scored_total", 500)
    metrics.inc("txsentinel_events_scored_total", 20)
    metrics.set("txsentinel_consumer_lag", 7)
    metrics.set("txsentinel_consumer_lag", 3)
    server = StatusServer(metrics, Probes(), "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            values = parse(response.read().decode())
    finally:
        server.close()
    assert values["txsentinel_events_scored_total"] == 520
    assert values["txsentinel_consumer_lag"] == 3
    assert values["txsentinel_batch_seconds_count"] == 0


def test_a_silent_connection_is_closed_after_the_request_timeout_and_scrapes_go_on():
    server = StatusServer(Metrics(), Probes(), "127.0.0.1", 0, request_timeout_s=0.3)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as silent:
            silent.sendall(b"GET /metr")  # and then nothing: a slow or stuck client
            started = time.monotonic()
            assert silent.recv(1024) == b""  # the server hung up ...
            assert time.monotonic() - started < 3  # ... after its timeout, not never
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
            assert response.status == 200
    finally:
        server.close()


def test_the_endpoint_listens_on_this_host_only_by_default():
    assert ServeConfig().metrics_host == "127.0.0.1"


def test_the_process_garbage_collector_and_python_are_measured_beside_the_service():
    values = parse(Metrics().render())
    assert values["process_resident_memory_bytes"] > 0
    assert values["process_open_fds"] > 0
    assert 'python_gc_collections_total{generation="0"}' in values
    assert any(name.startswith("python_info{") for name in values)


def test_the_model_info_metric_appears_once_its_labels_are_set():
    metrics = Metrics()
    assert not any(name.startswith("txsentinel_model_info") for name in parse(metrics.render()))
    labels = {"name": "txsentinel", "version": "3", "detector": "lstm", "feature_version": "4", "source": "m"}
    metrics.set_info("txsentinel_model_info", labels)
    text = metrics.render()
    assert "# TYPE txsentinel_model_info gauge" in text  # how the text format 0.0.4 writes an info metric
    (line,) = [line for line in text.splitlines() if line.startswith("txsentinel_model_info{")]
    assert line == (
        'txsentinel_model_info{detector="lstm",feature_version="4",name="txsentinel",source="m",version="3"} 1.0'
    )
    with pytest.raises(ValueError, match="txsentinel_alerts_total is a counter, not an info metric"):
        metrics.set_info("txsentinel_alerts_total", labels)


def test_a_scraper_that_asks_for_openmetrics_gets_it():
    metrics = Metrics()
    metrics.inc("txsentinel_alerts_total", 2)
    server = StatusServer(metrics, Probes(), "127.0.0.1", 0)
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/metrics",
            headers={"Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.3"},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.headers["Content-Type"].startswith("application/openmetrics-text")
            text = response.read().decode()
    finally:
        server.close()
    assert "# TYPE txsentinel_alerts counter\n" in text and "\ntxsentinel_alerts_total 2.0\n" in text
    assert text.endswith("# EOF\n")


def test_a_gauge_can_be_read_at_each_scrape():
    metrics = Metrics()
    probes = Probes()
    metrics.read_from("txsentinel_ready", lambda: probes.ready()[0])
    assert parse(metrics.render())["txsentinel_ready"] == 1
    probes.wait_for("partitions", "restoring")
    assert parse(metrics.render())["txsentinel_ready"] == 0
    with pytest.raises(ValueError, match="txsentinel_alerts_total is a counter, not a gauge"):
        metrics.read_from("txsentinel_alerts_total", lambda: 1.0)


def test_a_labelled_counter_keeps_one_sample_per_label_value_added_to_or_set_alone():
    # The embedded table writer and the scorer share their instance's metrics: neither overwrites the other.
    metrics = Metrics()
    metrics.inc("txsentinel_terminals_capped_total", 0, label="writer")  # there from the start
    metrics.set("txsentinel_terminals_capped_total", 7, label="scorer")  # from the scorer's running total
    metrics.inc("txsentinel_terminals_capped_total", 3, label="writer")
    metrics.set("txsentinel_terminals_capped_total", 9, label="scorer")
    text = metrics.render()
    assert "# TYPE txsentinel_terminals_capped_total counter" in text
    values = parse(text)
    assert values['txsentinel_terminals_capped_total{holder="scorer"}'] == 9
    assert values['txsentinel_terminals_capped_total{holder="writer"}'] == 3
