"""`txsentinel monitor`: drift, alert rate and state health of a running service, as one table and an exit
code, for a scheduled check (cron, a Kubernetes CronJob, a CI job).

It reads each instance's /metrics (the drift and state-health gauges: consumers/runtime/drift.py,
state_health.py) and the last `window_events` records of the scores topic, which every instance writes to:
the alert rate there is the whole service's, where each instance's gauge counts its partitions only, and is
measured as the gauge is (drift.py's events_per_day: from the bulk of the event times). A check
past its limit is PAST and the command exits 1; nothing past, 0. A model without drift references says
"no reference" on those rows, which pass.
"""

import argparse
import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from pipeline.cli.errors import OperatorError

EXIT_PAST = 1


@dataclass(frozen=True)
class MonitorConfig:
    metrics_urls: tuple[str, ...]  # each instance's http://HOST:PORT/metrics
    bootstrap_servers: str = "127.0.0.1:39092"
    scores_topic: str = "scores"
    window_events: int = 20_000  # the last this many score records, all partitions together
    max_feature_psi: float = 0.25
    max_score_psi: float = 0.25
    max_alert_budget_ratio: float = 2.0  # alerts per day over the window / the model's budget per day
    max_initial_ratio: float = 0.5  # share of held states still at the initial state
    max_nonfinite_states: int = 0
    min_events: int = 500  # fewer scored events in an instance's window: its drift is not judged
    alert_budget_per_day: float | None = None  # None: the model's (txsentinel_alert_budget_per_day)
    timeout_s: float = 30.0


class Row(NamedTuple):
    source: str  # an instance's metrics URL, or the scores topic
    check: str
    value: float
    limit: float | None  # None: shown, not judged
    status: str  # ok | PAST | no reference | too few events | info


def read_metrics(url: str, timeout_s: float) -> dict[str, float]:
    """{'name' or 'name{label="value"}': value} of one /metrics page."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise OperatorError(
            f"monitor: could not read {url}: {error}. Is serve running there with metrics_port set "
            "(and metrics_host reachable from here)?"
        ) from error
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return values


def read_scores(cfg: MonitorConfig) -> list[dict]:
    """The last window_events committed score records (fewer per partition where a partition has fewer)."""
    # here, not at the top: txsentinel's command line imports this module for its flags (pipeline/cli/main.py)
    from kafka import KafkaConsumer
    from kafka.errors import KafkaError
    from kafka.structs import TopicPartition

    try:
        consumer = KafkaConsumer(
            bootstrap_servers=cfg.bootstrap_servers,
            isolation_level="read_committed",
            enable_auto_commit=False,
            request_timeout_ms=int(cfg.timeout_s * 1000) + 1000,
        )
    except KafkaError as error:
        raise OperatorError(
            f"monitor: no Kafka broker answered at {cfg.bootstrap_servers}: {error!r}"
        ) from error
    try:
        partitions = consumer.partitions_for_topic(cfg.scores_topic)
        if not partitions:
            raise OperatorError(
                f"monitor: topic {cfg.scores_topic!r} does not exist at {cfg.bootstrap_servers}; give the "
                "service's scores topic (with its topic_prefix) as --scores-topic"
            )
        tps = [TopicPartition(cfg.scores_topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        begin, end = consumer.beginning_offsets(tps), consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, max(begin[tp], end[tp] - cfg.window_events))
        records, deadline = [], time.monotonic() + cfg.timeout_s
        while any(consumer.position(tp) < end[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise OperatorError(
                    f"monitor: could not read {cfg.scores_topic} up to its end within {cfg.timeout_s:g} s"
                )
            for batch in consumer.poll(timeout_ms=200).values():
                records.extend(json.loads(r.value) for r in batch if r.value is not None)
    finally:
        consumer.close()
    records.sort(key=lambda r: _ts_s(r["ts"]))
    return records[-cfg.window_events :]


def _ts_s(ts) -> float:
    # scores carry ts as ISO 8601 or as epoch milliseconds (timestamp_format)
    return ts / 1000 if isinstance(ts, int | float) else datetime.fromisoformat(ts).timestamp()


def _judge(value: float, limit: float) -> str:
    return "PAST" if value > limit else "ok"


def instance_rows(url: str, m: dict[str, float], cfg: MonitorConfig) -> list[Row]:
    """The checks of one instance's metrics."""
    rows = []
    events = m.get("txsentinel_drift_window_events", 0.0)
    rows.append(Row(url, "drift window events", events, None, "info"))
    judged = events >= cfg.min_events
    if m.get('txsentinel_drift_reference{of="features"}', 0.0) < 1:
        rows.append(Row(url, "feature psi", math.nan, cfg.max_feature_psi, "no reference"))
    else:
        prefix = 'txsentinel_feature_psi{feature="'
        psis = {k.removeprefix(prefix)[:-2]: v for k, v in m.items() if k.startswith(prefix)}
        shown = {k: v for k, v in psis.items() if v > cfg.max_feature_psi} or dict(
            sorted(psis.items(), key=lambda kv: -kv[1] if math.isfinite(kv[1]) else 0)[:1]
        )
        for name, value in sorted(shown.items(), key=lambda kv: -kv[1]):
            status = _judge(value, cfg.max_feature_psi) if judged else "too few events"
            rows.append(Row(url, f"feature psi {name}", value, cfg.max_feature_psi, status))
    if m.get('txsentinel_drift_reference{of="scores"}', 0.0) < 1:
        rows.append(Row(url, "score psi", math.nan, cfg.max_score_psi, "no reference"))
    else:
        value = m.get("txsentinel_score_psi", math.nan)
        status = _judge(value, cfg.max_score_psi) if judged else "too few events"
        rows.append(Row(url, "score psi", value, cfg.max_score_psi, status))
    p99 = m.get('txsentinel_state_norm{quantile="0.99"}', math.nan)
    rows.append(Row(url, "state norm p99", p99, None, "info"))
    initial = m.get("txsentinel_states_initial_ratio", math.nan)
    status = "info" if math.isnan(initial) else _judge(initial, cfg.max_initial_ratio)
    rows.append(Row(url, "states at initial share", initial, cfg.max_initial_ratio, status))
    nonfinite = m.get("txsentinel_states_nonfinite", 0.0)
    rows.append(
        Row(
            url,
            "non-finite states",
            nonfinite,
            cfg.max_nonfinite_states,
            _judge(nonfinite, cfg.max_nonfinite_states),
        )
    )
    guards = m.get("txsentinel_nonfinite_guards_total", 0.0)
    rows.append(Row(url, "non-finite guards fired", guards, None, "info"))
    return rows


def alert_rows(records: list[dict], budget: float | None, cfg: MonitorConfig) -> list[Row]:
    """Alerts per day over the scores read, against the budget times max_alert_budget_ratio: their alerts per
    event times their events per day between the 10th and 90th percentile event times, as the service's gauge."""
    # here, not at the top: txsentinel's command line imports this module for its flags, and numpy with it
    # would slow every command's start
    import numpy as np

    from consumers.runtime.drift import events_per_day

    source = cfg.scores_topic
    rows = [Row(source, "scores read", float(len(records)), None, "info")]
    events_a_day = events_per_day(np.array([round(_ts_s(r["ts"]) * 1e6) for r in records], dtype=np.int64))
    if math.isnan(events_a_day):
        return [*rows, Row(source, "alerts per day", math.nan, None, "too few events")]
    per_day = sum(bool(r.get("alert")) for r in records) / len(records) * events_a_day
    if budget is None or not math.isfinite(budget):
        return [*rows, Row(source, "alerts per day", per_day, None, "no reference")]
    limit = budget * cfg.max_alert_budget_ratio
    status = _judge(per_day, limit) if len(records) >= cfg.min_events else "too few events"
    return [*rows, Row(source, "alerts per day", per_day, limit, status)]


def monitor(cfg: MonitorConfig) -> list[Row]:
    """Every check's row: each instance's metrics, then the alert rate of the scores topic."""
    if not cfg.metrics_urls:
        raise OperatorError(
            "monitor: give at least one --metrics-url (an instance's http://HOST:PORT/metrics)"
        )
    rows, budget = [], cfg.alert_budget_per_day
    for url in cfg.metrics_urls:
        m = read_metrics(url, cfg.timeout_s)
        rows += instance_rows(url, m, cfg)
        if budget is None and math.isfinite(m.get("txsentinel_alert_budget_per_day", math.nan)):
            budget = m["txsentinel_alert_budget_per_day"]
    return rows + alert_rows(read_scores(cfg), budget, cfg)


def format_rows(rows: list[Row]) -> str:
    """The table monitor prints."""
    table = [("source", "check", "value", "limit", "status")]
    table += [
        (r.source, r.check, f"{r.value:.4g}", "" if r.limit is None else f"{r.limit:.4g}", r.status)
        for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(5)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in table
    )


def run_monitor(cfg: MonitorConfig) -> int:
    """Print the table; 1 when a check is past its limit, else 0."""
    rows = monitor(cfg)
    print(format_rows(rows))
    past = [r for r in rows if r.status == "PAST"]
    if past:
        print(
            f"{len(past)} check(s) past their limits: "
            + "; ".join(f"{r.check} {r.value:.4g} > {r.limit:.4g}" for r in past)
        )
        return EXIT_PAST
    return 0


def add_monitor_command(sub) -> None:
    """The `monitor` subcommand and its flags (the limits default to MonitorConfig's)."""
    d = MonitorConfig(metrics_urls=())
    p = sub.add_parser(
        "monitor", help="drift, alert rate and state health of a running service; exit 1 past limits"
    )
    p.add_argument(
        "--metrics-url", action="append", required=True, dest="metrics_urls",
        help="an instance's http://HOST:PORT/metrics (repeatable: one per instance)",
    )  # fmt: skip
    p.add_argument(
        "--bootstrap-servers", default=d.bootstrap_servers, help="the Kafka cluster, host:port[,...]"
    )
    p.add_argument(
        "--scores-topic", default=d.scores_topic, help="the service's scores topic, with its prefix"
    )
    for name, kind, text in (
        ("window_events", int, "the last this many score records are read"),
        ("max_feature_psi", float, "a feature's PSI above this is past"),
        ("max_score_psi", float, "the scores' PSI above this is past"),
        ("max_alert_budget_ratio", float, "alerts per day above this times the budget are past"),
        ("max_initial_ratio", float, "a share of held states at the initial state above this is past"),
        ("max_nonfinite_states", int, "more non-finite held states than this is past"),
        ("min_events", int, "an instance's drift is judged from this many scored events in its window"),
        ("alert_budget_per_day", float, "the budget to judge alerts by (default: the model's)"),
        ("timeout_s", float, "how long each read may take"),
    ):
        default = getattr(d, name)
        p.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=default, help=f"{text} (default {default})"
        )
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    fields = MonitorConfig.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in fields and k != "metrics_urls"}
    return run_monitor(MonitorConfig(metrics_urls=tuple(args.metrics_urls), **values))
