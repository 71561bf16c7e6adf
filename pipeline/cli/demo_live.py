"""What the demo shows of the running service once the stream is through: the champion against its shadow
challenger on the live stream, three alerts with their reasons, and one monitor check.

Each is the function its own command runs (`txsentinel compare --live`, `txsentinel monitor`), called here
on the demo's topics, so the demo shows what an operator would see.
"""

import json
import time

from kafka import KafkaConsumer
from kafka.structs import TopicPartition

from consumers.runtime.settings import ServeConfig
from pipeline.cli.errors import OperatorError
from pipeline.cli.monitor import MonitorConfig, run_monitor
from pipeline.evaluation.live_compare import LiveCompareConfig, format_table, live_compare

ALERTS_SHOWN = 3


def print_live_comparison(serve: ServeConfig, bootstrap: str, champion: str, challenger: str) -> None:
    """The live comparison table (logged to MLflow as `txsentinel compare --live` does)."""
    print(f"served = champion ({champion}), shadow = challenger ({challenger}); labels known so far")
    # since: by Kafka record time, and the demo wrote every record within the last hour
    print(format_table(live_compare(serve, bootstrap, LiveCompareConfig(since_days=1.0))))


def read_committed(bootstrap: str, topic: str, timeout_s: float = 60.0) -> list[dict]:
    """Every committed record of `topic`, as JSON, up to the end offsets it had when the read began."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False
    )
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not tps:
            return []
        consumer.assign(tps)
        consumer.seek_to_beginning()
        end = consumer.end_offsets(tps)
        values, deadline = [], time.monotonic() + timeout_s
        while any(consumer.position(tp) < end[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read topic {topic!r} up to {end} within {timeout_s:g} s")
            for tp, records in consumer.poll(timeout_ms=200).items():
                values += [json.loads(r.value) for r in records if r.offset < end[tp]]
        return values
    finally:
        consumer.close()


def pick_alerts(alerts: list[dict], count: int = ALERTS_SHOWN) -> list[dict]:
    """`count` alerts with reasons, highest score first, each with another top reason while there are
    others (three amount alerts in a row would show one reason three times)."""
    ranked = sorted((a for a in alerts if a.get("reasons")), key=lambda a: -a["score"])
    picked, tops = [], set()
    for alert in ranked:
        if alert["reasons"][0]["input"] not in tops and len(picked) < count:
            picked.append(alert)
            tops.add(alert["reasons"][0]["input"])
    rest = [a for a in ranked if a not in picked]
    return sorted(picked + rest[: count - len(picked)], key=lambda a: -a["score"])


def format_alert(number: int, alert: dict, fraud: bool | None) -> str:
    """An alert as an analyst reads it: a heading line, then one line per reason and the history's."""
    known = {True: "fraud", False: "genuine", None: "not labelled"}[fraud]
    lines = [
        f"alert {number}: account {alert['account_id']}, event {alert['event_id']} at {alert['ts']}, "
        f"score {alert['score']:.3f} ({known} in the generated data)"
    ]
    terms = [*alert["reasons"], *([alert["history"]] if alert.get("history") else [])]
    width = max(len(term["text"]) for term in terms)
    lines += [f"    {term['text']:<{width}}  {term['logit']:+.2f} logit" for term in terms]
    return "\n".join(lines)


def print_alerts(serve: ServeConfig, bootstrap: str, truth: dict[str, bool]) -> int:
    """Three alerts of the `alerts` topic with their reasons; returns how many the topic held."""
    alerts = read_committed(bootstrap, serve.topic("alerts"))
    shown = pick_alerts(alerts)
    print(f"{len(alerts):,} alerts in {serve.topic('alerts')}; {len(shown)} of them, with their reasons:")
    for number, alert in enumerate(shown, 1):
        print(format_alert(number, alert, truth.get(alert["event_id"])))
    return len(alerts)


def print_monitor(serve: ServeConfig, bootstrap: str, metrics_port: int) -> int:
    """One `txsentinel monitor` check of the running service; returns its exit status (printed)."""
    cfg = MonitorConfig(
        metrics_urls=(f"http://127.0.0.1:{metrics_port}/metrics",),
        bootstrap_servers=bootstrap,
        scores_topic=serve.topic("scores"),
    )
    # The service publishes its drift and state gauges every drift_refresh_s: one period more, and they
    # include the stream's last events.
    time.sleep(serve.drift_refresh_s)
    try:
        status = run_monitor(cfg)
    except OperatorError as error:
        print(error)  # it names the monitor and what to do
        status = error.exit_code
    meaning = {0: "every check within its limits", 1: "a check past its limit (the demo goes on)"}
    print(f"monitor exit status {status}: {meaning.get(status, 'the check could not run')}")
    return status


__all__ = ["format_alert", "pick_alerts", "print_alerts", "print_live_comparison", "print_monitor"]
