"""`txsentinel demo` (what `make demo` runs): the whole story on embedded defaults.

1. start the project's Kafka broker (or use the one already running);
2. generate a dataset with known fraud;
3. train the three sequence detectors (quick CPU profile) and the four per-event baselines, tracked and
   registered in a local MLflow store;
4. promote the sequence detector with the best validation AP to `champion` and the second best to
   `challenger`, print the comparison table;
5. start `txsentinel serve` with the champion and the challenger in shadow (both, and the terminal-risk
   table, warm from the history) and wait for its /readyz, stream the test period's transactions (and their
   labels, on their own topic) through Kafka at a steady rate, and show live progress;
6. on the running service (demo_live.py): the two models compared on the live stream, three alerts with
   their reasons, one monitor check;
7. summarise: events scored, alerts, precision of the alerts against the known labels, latency, and where
   to look next. Everything started is stopped at the end, also on Ctrl-C.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import polars as pl
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.partitioner.default import murmur2
from kafka.structs import TopicPartition

from consumers.runtime.metrics import free_port
from consumers.runtime.settings import ServeConfig, load_serve_config
from consumers.scoring.messages import Label, Transaction, encode_label, encode_transaction
from consumers.scoring.scorer import Scorer
from consumers.service.loop import ensure_topics
from consumers.service.shadow import ensure_shadow_topics, shadow_changelog
from consumers.terminals.table import Positions, flush_records
from pipeline.bench.broker import project_broker
from pipeline.cli.commands import run_generate
from pipeline.cli.demo_live import print_alerts, print_live_comparison, print_monitor
from pipeline.data.dataset import TRANSACTIONS_FILE, read_dataset, read_metadata
from pipeline.data.generate import GenerateConfig
from pipeline.evaluation.compare import compare
from pipeline.registry.tracking import load_model, promote
from pipeline.training.config import QUICK_PROFILE, TrainResult, load_train_config
from pipeline.training.train import train

SEQUENCE_MODELS = ("lstm", "linear_transformer", "transformer")
BASELINE_MODELS = ("logreg", "random_forest", "hist_gbdt", "isolation_forest")


@dataclass(frozen=True)
class DemoConfig:
    accounts: int = 800
    days: int = 90  # 60 days leave too short a history for the detectors to beat the per-event baselines
    seed: int = 7
    test_days: int = 7
    max_epochs: int | None = None  # None: the quick profile's
    models: tuple[str, ...] = SEQUENCE_MODELS + BASELINE_MODELS
    stream_events_per_s: float = 1000.0  # the steady rate the stream is replayed at
    stream_days: int = 7  # the last days of the data (the test period) go through Kafka
    alert_share: float = 0.005  # the alert budget: this share of a day's events
    workdir: Path = Path("runs/demo")
    bootstrap_servers: str | None = None  # None: the project's broker, started and stopped by the demo
    stream_timeout_s: float = 300.0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])


def _stage(title: str) -> None:
    print(f"\n== {title}", flush=True)


def _generator_settings(cfg: GenerateConfig) -> dict:
    return {"accounts": cfg.accounts, "days": cfg.days, "seed": cfg.seed}


def _generated_with(data_dir: Path) -> dict | None:
    """The generator settings of an existing dataset, or None (absent, ingested, or unreadable)."""
    if not (data_dir / TRANSACTIONS_FILE).exists():
        return None
    try:
        config = read_metadata(data_dir)["source"]["config"]
    except (KeyError, ValueError, TypeError):
        return None
    return {key: config.get(key) for key in ("accounts", "days", "seed")}


def _train_all(cfg: DemoConfig, data_dir: Path, events_per_day: float) -> list[TrainResult]:
    results = []
    settings = [
        f"test_days={cfg.test_days}",
        f"alert_budget_per_day={max(5, round(events_per_day * cfg.alert_share))}",
    ]
    if cfg.max_epochs is not None:
        settings.append(f"max_epochs={cfg.max_epochs}")
    for model in cfg.models:
        sequence = model in SEQUENCE_MODELS
        profile, overrides = (QUICK_PROFILE, settings) if sequence else (None, settings[:1])
        results.append(
            train(load_train_config(data_dir, profile, overrides, model=model, out_dir=cfg.workdir / "train"))
        )
    return results


def _promote_best(results: list[TrainResult]) -> tuple[str, str | None]:
    """The best sequence detector by validation AP to `champion`, the second best to `challenger` (None
    when only one was trained); returns their names."""
    sequence = [r for r in results if r.model in SEQUENCE_MODELS]
    ranked = sorted(sequence, key=lambda r: r.metrics.get("val/ap", 0.0), reverse=True)
    promote("champion", "txsentinel", run_id=ranked[0].run_id)
    if len(ranked) < 2:
        return ranked[0].model, None
    promote("challenger", "txsentinel", run_id=ranked[1].run_id)
    return ranked[0].model, ranked[1].model


def _serve_config(prefix: str) -> ServeConfig:
    return load_serve_config(None, {"topic_prefix": prefix, "transactions_partitions": 3})


def _prepare_topics(bootstrap: str, prefix: str) -> None:
    """The service's topics, and `labels` (the broker does not create topics on first use)."""
    serve_cfg = _serve_config(prefix)
    ensure_topics(serve_cfg, bootstrap)
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="txsentinel-demo")
    try:
        if serve_cfg.topic("labels") not in set(admin.list_topics()):
            admin.create_topics({serve_cfg.topic("labels"): {"num_partitions": 3, "replication_factor": 1}})
    finally:
        admin.close()


def _seed_states(bootstrap: str, prefix: str, history: pl.DataFrame, shadow: bool) -> tuple[int, int]:
    """Warm start: the champion (and, with `shadow`, the challenger beside it) replays the history before the
    stream (the same Scorer the service runs) and each account's state goes to the changelog partition its
    transactions will use, the challenger's to its own changelog, and every terminal's state to the terminal
    table, so the service restores all of them on assignment, as if it had scored that history itself.
    The table's positions are the start of `labels` and `terminal-deltas`: the history's labels known before
    the stream are in the replayed state, the later ones arrive on `labels` with the stream."""
    challenger = load_model("models:/txsentinel@challenger") if shadow else None
    scorer = Scorer(load_model("models:/txsentinel@champion"), shadow=challenger)
    scorer.replay(history)
    serve_cfg = _serve_config(prefix)
    accounts = history["account_id"].unique().to_list()
    records = {serve_cfg.topic("changelog"): scorer.account_states_bytes(accounts)}
    terminals = scorer.featurizer.terminals
    table = flush_records(
        terminals, list(terminals), Positions(), serve_cfg.topic("labels"), serve_cfg.topic("terminal_deltas")
    )
    if scorer.shadow is not None:
        changelog = shadow_changelog(serve_cfg, scorer.shadow.model_fingerprint)
        ensure_shadow_topics(serve_cfg, bootstrap, changelog, serve_cfg.transactions_partitions)
        records[changelog] = scorer.shadow_states_bytes(accounts)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20)
    for topic, states in records.items():
        partitions = sorted(producer.partitions_for(topic))
        for account, state in zip(accounts, states, strict=True):
            key = account.encode()
            producer.send(
                topic,
                key=key,
                value=state,
                # Kafka's default partitioner, as the producer of `transactions` applies it to the same key.
                partition=partitions[(murmur2(key) & 0x7FFFFFFF) % len(partitions)],
            )
    for terminal, record in table:  # one partition; the positions record last, as the table's writer does
        producer.send(serve_cfg.topic("terminal_table"), key=terminal.encode(), value=record, partition=0)
    producer.flush()
    producer.close()
    return len(accounts), len(terminals)


def _serve_process(bootstrap: str, prefix: str, env: dict, log, port: int, shadow: bool) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "pipeline.cli.main",
        "serve",
        "--model",
        "models:/txsentinel@champion",
        "--bootstrap-servers",
        bootstrap,
        "--group-id",
        f"{prefix}scorer",
        "--set",
        f"topic_prefix={prefix}",
        "--set",
        "transactions_partitions=3",
        "--set",
        f"metrics_port={port}",  # /readyz says when it serves; /metrics is there to look at
        *(["--shadow", "models:/txsentinel@challenger"] if shadow else []),
    ]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_until_serving(service: subprocess.Popen, port: int, log_path: Path, deadline_s: float) -> None:
    """Until the service's /readyz answers 200: started, its partitions assigned and their states restored."""
    deadline = time.monotonic() + deadline_s
    said = "no answer yet"
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5):
                return  # 200; a 503 raises HTTPError
        except urllib.error.HTTPError as error:
            said = error.read().decode().strip()  # what it still waits for
        except OSError:
            pass  # not listening yet: the service is still importing and loading the model
        if service.poll() is not None:
            raise RuntimeError(f"txsentinel serve exited with {service.returncode}; see {log_path}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"txsentinel serve was not ready within {deadline_s:.0f} s ({said}); see {log_path}"
            )
        time.sleep(0.5)


def _stream(cfg: DemoConfig, bootstrap: str, prefix: str, live: pl.DataFrame, labels: pl.DataFrame) -> dict:
    """Produce `live` at a steady rate (labels as they become known), read the scores as they come back."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, isolation_level="read_committed", auto_offset_reset="earliest"
    )
    partitions = [
        TopicPartition(f"{prefix}scores", p) for p in consumer.partitions_for_topic(f"{prefix}scores")
    ]
    consumer.assign(partitions)
    consumer.seek_to_beginning()

    ts_us = live["ts"].dt.epoch("us").to_numpy()
    label_us = labels["label_ts"].dt.epoch("us").to_numpy()
    sent_at: dict[str, float] = {}
    scores: dict[str, dict] = {}
    latencies: list[float] = []
    next_label, started, last_report = 0, time.monotonic(), 0.0
    rows = live.select("event_id", "account_id", "amount", "terminal_id").rows()
    deadline = started + cfg.stream_timeout_s
    i = 0
    while len(scores) < len(rows):
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(
                f"{len(scores):,} of {len(rows):,} events scored within {cfg.stream_timeout_s:.0f} s"
            )
        due = min(len(rows), int((now - started) * cfg.stream_events_per_s) + 1)
        while i < due:
            # Labels known by this event's time go out first, on their own topic.
            while next_label < len(label_us) and label_us[next_label] <= ts_us[i]:
                row = labels.row(next_label, named=True)
                label = Label(
                    row["event_id"],
                    row["account_id"],
                    row["terminal_id"],
                    bool(row["is_fraud"]),
                    int(label_us[next_label]),
                )
                producer.send(f"{prefix}labels", key=label.account_id.encode(), value=encode_label(label))
                next_label += 1
            event_id, account, amount, terminal = rows[i]
            tx = Transaction(event_id, account, int(ts_us[i]), float(amount), terminal)
            producer.send(f"{prefix}transactions", key=account.encode(), value=encode_transaction(tx))
            sent_at[event_id] = time.time()
            i += 1
        producer.flush()
        for records in consumer.poll(timeout_ms=100).values():
            for record in records:
                score = json.loads(record.value)
                if score["event_id"] not in scores:
                    scores[score["event_id"]] = score
                    latencies.append(
                        record.timestamp / 1000.0 - sent_at.get(score["event_id"], record.timestamp / 1000.0)
                    )
        if now - last_report >= 2.0 or len(scores) == len(rows):
            last_report = now
            elapsed = max(now - started, 1e-9)
            alerts = sum(s["alert"] for s in scores.values())
            print(
                f"  sent {i:6,}  scored {len(scores):6,}  {len(scores) / elapsed:7,.0f} events/s  "
                f"alerts {alerts:5,}  lag {i - len(scores):5,}",
                flush=True,
            )
    producer.close()
    consumer.close()
    return {"scores": scores, "latencies_s": latencies, "seconds": time.monotonic() - started}


def _summary(live: pl.DataFrame, streamed: dict) -> dict:
    scores = streamed["scores"]
    truth = dict(zip(live["event_id"].to_list(), live["is_fraud"].to_list(), strict=True))
    alerted = [e for e, s in scores.items() if s["alert"]]
    true_alerts = sum(truth[e] for e in alerted)
    latencies = np.array(streamed["latencies_s"]) * 1000.0
    return {
        "events_scored": len(scores),
        "frauds": int(live["is_fraud"].sum()),
        "alerts": len(alerted),
        "alert_precision": true_alerts / len(alerted) if alerted else float("nan"),
        "frauds_alerted": true_alerts,
        "p50_ms": float(np.percentile(latencies, 50)) if len(latencies) else float("nan"),
        "p99_ms": float(np.percentile(latencies, 99)) if len(latencies) else float("nan"),
        "events_per_s": len(scores) / max(streamed["seconds"], 1e-9),
    }


def run_demo(cfg: DemoConfig) -> int:
    started = time.perf_counter()
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    # The demo's MLflow store lives in its workdir unless the user points MLflow elsewhere.
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{(cfg.workdir / 'mlflow.db').resolve()}")
    data_dir = cfg.workdir / "data"
    broker = project_broker() if cfg.bootstrap_servers is None else nullcontext(cfg.bootstrap_servers)
    service = None
    with broker as bootstrap:
        try:
            print(f"Kafka broker: {bootstrap}; MLflow: {os.environ['MLFLOW_TRACKING_URI']}")
            _stage(f"generate {cfg.accounts:,} accounts x {cfg.days} days -> {data_dir}")
            wanted = GenerateConfig(accounts=cfg.accounts, days=cfg.days, seed=cfg.seed)
            if _generated_with(data_dir) == _generator_settings(wanted):
                print("reusing the dataset an earlier run generated with these settings")
            else:
                run_generate(wanted, data_dir)

            _stage(f"train {', '.join(cfg.models)} (sequence detectors on the quick CPU profile)")
            frame = read_dataset(data_dir)
            results = _train_all(cfg, data_dir, frame.height / cfg.days)

            _stage("promote the best sequence detector by validation AP, the second best as challenger")
            champion, challenger = _promote_best(results)
            print(f"champion: {champion}; challenger: {challenger or 'none (one sequence detector)'}")

            _stage("compare")
            compare(out=cfg.workdir / "comparison", data=data_dir)

            last_day = frame["ts"].max().replace(hour=0, minute=0, second=0, microsecond=0)
            stream_start = last_day - timedelta(days=cfg.stream_days - 1)
            history = frame.filter(pl.col("ts") < stream_start)
            live = frame.filter(pl.col("ts") >= stream_start)
            labels = frame.filter(pl.col("is_fraud") & (pl.col("label_ts") >= stream_start)).sort("label_ts")

            prefix = f"demo-{cfg.run_id}-"
            shadow = challenger is not None
            both = "the champion and the challenger replay" if shadow else "the champion replays"
            _stage(
                f"warm start: {both} {history.height:,} past events into their state changelogs and the terminal table"
            )
            _prepare_topics(bootstrap, prefix)
            accounts, terminals = _seed_states(bootstrap, prefix, history, shadow)
            print(f"{accounts:,} account states and {terminals:,} terminal states seeded")

            _stage(
                f"serve the champion{' with the challenger in shadow' if shadow else ''} and stream "
                f"{live.height:,} transactions at {cfg.stream_events_per_s:,.0f}/s"
            )
            service_log = open(cfg.workdir / "serve.log", "w")  # noqa: SIM115 (closed after the service)
            port = free_port()
            service = _serve_process(bootstrap, prefix, dict(os.environ), service_log, port, shadow)
            _wait_until_serving(service, port, cfg.workdir / "serve.log", 180)
            streamed = _stream(cfg, bootstrap, prefix, live, labels)
            summary = _summary(live, streamed)

            serve_cfg = _serve_config(prefix)
            if shadow:
                _stage("champion and shadow challenger on the live stream (txsentinel compare --live)")
                print_live_comparison(serve_cfg, bootstrap, champion, challenger)
            _stage("alerts and their reasons")
            truth = dict(zip(live["event_id"].to_list(), live["is_fraud"].to_list(), strict=True))
            print_alerts(serve_cfg, bootstrap, truth)
            _stage("drift, alert rate and state health of the running service (txsentinel monitor)")
            print_monitor(serve_cfg, bootstrap, port)
        finally:
            if service is not None:
                service.send_signal(signal.SIGTERM)  # finishes the batch in flight, commits, exits 0
                try:
                    service.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    service.kill()
                service_log.close()

    _stage("summary")
    print(
        f"scored {summary['events_scored']:,} events ({summary['frauds']:,} fraudulent) at "
        f"{summary['events_per_s']:,.0f} events/s; {summary['alerts']:,} alerts, precision "
        f"{summary['alert_precision']:.2f} ({summary['frauds_alerted']:,} frauds caught); latency p50 "
        f"{summary['p50_ms']:.0f} ms, p99 {summary['p99_ms']:.0f} ms"
    )
    print(f"total {time.perf_counter() - started:.0f} s")
    print(
        "\nnext:\n"
        f"  .venv/bin/mlflow ui --backend-store-uri {os.environ['MLFLOW_TRACKING_URI']}   runs, metrics, plots, models\n"
        f"  {cfg.workdir / 'comparison'}                                  comparison table and plots\n"
        "  notebooks/backtest.ipynb, notebooks/model_comparison.ipynb\n"
        f"  topics {prefix}scores, {prefix}alerts, {prefix}dead-letter on {bootstrap}; service log "
        f"{cfg.workdir / 'serve.log'}"
    )
    return 0 if summary["events_scored"] == live.height else 1


__all__ = ["DemoConfig", "run_demo"]
