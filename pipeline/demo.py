"""`txsentinel demo` (what `make demo` runs): the main job end to end on embedded defaults.

Today it runs the data foundation for real: start the project's Kafka broker, generate a dataset with
known fraud, compute the batch features, then stream the last days of transactions through Kafka as JSON
and featurize them one micro-batch at a time with the bounded streaming state — and check that the stream
computed exactly what the batch did. Later stages (train, register, serve) plug in after the data.
"""

import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import polars as pl

from consumers.broker import project_broker
from consumers.messages import Transaction, decode_transaction, encode_transaction
from pipeline.commands import run_features, run_generate
from pipeline.dataset import read_dataset
from pipeline.features import FEATURE_NAMES, EventBatch, LabelBatch, StreamingFeaturizer, replay_batches
from pipeline.generate import GenerateConfig


@dataclass(frozen=True)
class DemoConfig:
    accounts: int = 2000
    days: int = 90
    seed: int = 7
    stream_days: int = 7  # the last days of the dataset go through Kafka; the rest warms the state
    batch_events: int = 500  # max.poll.records: one micro-batch per poll
    workdir: Path = Path("runs/demo")
    bootstrap_servers: str | None = None  # None: the project's broker, started and stopped by the demo
    stream_timeout_s: float = 300.0
    topic: str = field(default_factory=lambda: f"txsentinel-demo-transactions-{uuid.uuid4().hex[:8]}")


def _stage(title: str) -> float:
    print(f"\n== {title}")
    return time.perf_counter()


def _labels_for(frame: pl.DataFrame) -> tuple[list[str], np.ndarray]:
    fraud = frame.filter(pl.col("is_fraud")).sort("label_ts")
    return fraud["terminal_id"].to_list(), fraud["label_ts"].dt.epoch("us").to_numpy()


def create_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    """One partition keeps the global event order, so terminal features match the batch form exactly."""
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="txsentinel-demo")
    try:
        # wait_for_metadata: producing before every partition has a leader fails.
        admin.create_topics(
            {topic: {"num_partitions": partitions, "replication_factor": 1}}, wait_for_metadata=True
        )
    finally:
        admin.close()


def produce_transactions(bootstrap: str, topic: str, frame: pl.DataFrame) -> int:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, batch_size=256 * 1024)
    ts_us = frame["ts"].dt.epoch("us").to_numpy()
    for i, row in enumerate(frame.select("event_id", "account_id", "amount", "terminal_id").iter_rows()):
        tx = Transaction(
            event_id=row[0], account_id=row[1], ts_us=int(ts_us[i]), amount=row[2], terminal_id=row[3]
        )
        producer.send(topic, key=tx.account_id.encode(), value=encode_transaction(tx))
    producer.flush()
    producer.close()
    return frame.height


def stream_features(
    bootstrap: str,
    topic: str,
    expected: int,
    featurizer: StreamingFeaturizer,
    labels: tuple[list[str], np.ndarray],
    cfg: DemoConfig,
) -> tuple[list[str], np.ndarray]:
    """Consume `expected` transactions, featurizing each poll as one micro-batch; labels are applied at
    their label_ts. Returns event ids and features [N, F] in consumption order."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"{topic}-featurizer",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_poll_records=cfg.batch_events,
    )
    label_terminals, label_us = labels
    cursor = 0
    event_ids: list[str] = []
    chunks: list[np.ndarray] = []
    deadline = time.monotonic() + cfg.stream_timeout_s
    try:
        while len(event_ids) < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"consumed {len(event_ids)} of {expected} transactions in {cfg.stream_timeout_s} s"
                )
            polled = consumer.poll(timeout_ms=1000)
            records = [r for part in polled.values() for r in part]
            if not records:
                continue
            txs = [decode_transaction(r.value) for r in records]
            ts_us = np.array([t.ts_us for t in txs], dtype=np.int64)
            # Labels known before this batch go into the state; those that become known during it travel with it.
            before = int(np.searchsorted(label_us, ts_us[0], side="left"))
            if before > cursor:
                featurizer.observe_labels(
                    LabelBatch(
                        label_terminals[cursor:before],
                        label_us[cursor:before],
                        np.ones(before - cursor, bool),
                    )
                )
                cursor = before
            during = int(np.searchsorted(label_us, ts_us[-1], side="right"))
            batch_labels = LabelBatch(
                label_terminals[cursor:during], label_us[cursor:during], np.ones(during - cursor, bool)
            )
            cursor = during
            events = EventBatch(
                [t.account_id for t in txs],
                [t.terminal_id for t in txs],
                ts_us,
                np.array([t.amount for t in txs]),
            )
            chunks.append(featurizer.transform(events, batch_labels)[0])
            event_ids.extend(t.event_id for t in txs)
            consumer.commit()
    finally:
        consumer.close()
    return event_ids, np.concatenate(chunks)


def run_demo(cfg: DemoConfig) -> int:
    started = time.perf_counter()
    data_dir = cfg.workdir / "data"
    broker = project_broker() if cfg.bootstrap_servers is None else nullcontext(cfg.bootstrap_servers)
    with broker as bootstrap:
        print(f"Kafka broker: {bootstrap}")

        t = _stage(f"generate {cfg.accounts:,} accounts x {cfg.days} days -> {data_dir}")
        run_generate(GenerateConfig(accounts=cfg.accounts, days=cfg.days, seed=cfg.seed), data_dir)

        t = _stage("batch features (polars)")
        features = run_features(data_dir, None)

        frame = read_dataset(data_dir)
        stream_start = frame["ts"].max().replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(
            days=cfg.stream_days - 1
        )
        history = frame.filter(pl.col("ts") < stream_start)
        live = frame.filter(pl.col("ts") >= stream_start)

        t = _stage(f"warm the streaming state with {history.height:,} past events")
        featurizer = StreamingFeaturizer()
        for events, labels in replay_batches(history, cfg.batch_events):
            featurizer.transform(events, labels)
        print(
            f"{len(featurizer.accounts):,} account states, {len(featurizer.terminals):,} terminal states, "
            f"{len(featurizer.to_bytes()) / 1e6:.1f} MB in all, in {time.perf_counter() - t:.1f} s"
        )

        t = _stage(f"stream {live.height:,} transactions of the last {cfg.stream_days} days through Kafka")
        create_topic(bootstrap, cfg.topic)
        produced = produce_transactions(bootstrap, cfg.topic, live)
        produce_s = time.perf_counter() - t
        print(f"produced {produced:,} JSON messages to '{cfg.topic}' in {produce_s:.1f} s")
        t = time.perf_counter()
        # The replay applied every label known by the last past event; the rest arrive during the stream.
        labels = _labels_for(frame.filter(pl.col("label_ts") > history["ts"].max()))
        event_ids, streamed = stream_features(bootstrap, cfg.topic, produced, featurizer, labels, cfg)
        consume_s = time.perf_counter() - t
        print(
            f"consumed and featurized {len(event_ids):,} events in {consume_s:.1f} s ({len(event_ids) / consume_s:,.0f}/s)"
        )

        batch = features.filter(pl.col("ts") >= stream_start)
        order = pl.DataFrame({"event_id": event_ids}).join(
            batch, on="event_id", how="left", maintain_order="left"
        )
        expected = order.select(FEATURE_NAMES).to_numpy()
        diff = float(np.abs(streamed - expected).max())
        ok = order.height == batch.height and diff <= 1e-6

        _stage("summary")
        fraud = live["is_fraud"].sum()
        print(f"dataset: {frame.height:,} transactions, {frame['is_fraud'].sum():,} fraudulent")
        print(f"stream: {len(event_ids):,} events through Kafka, {fraud:,} of them fraudulent")
        print(
            f"streaming features vs batch features: max |difference| = {diff:.2e} ({'OK' if ok else 'MISMATCH'})"
        )
        print(f"total {time.perf_counter() - started:.1f} s")
        print("\nnext: `txsentinel features --data runs/demo/data`, `txsentinel bench features`, README.md")
    return 0 if ok else 1


__all__ = ["DemoConfig", "run_demo"]
