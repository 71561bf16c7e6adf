"""The stream bench's harness: where its processes run, the two measured loops, and its Kafka chores.

pipeline/bench/stream.py runs the bench with these: the service and the raw loop each in a spawned child
pinned to one core (service_child, raw_child), the harness itself off that core (keep_off), and the topic,
produce, wait and read steps around them.

A spawned child imports this module before its target runs pin(): nothing imported at the top may import
polars (it sizes its thread pool from the cores allowed when it is imported) or torch, so the two functions
that need them import them inside.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.partitioner.default import murmur2
from kafka.structs import OffsetAndMetadata, TopicPartition

from consumers.runtime.metrics import scrape
from consumers.runtime.settings import ServeConfig, load_serve_config
from consumers.scoring.messages import encode_transaction, transactions_from_frame

log_prefix = "bench_stream:"


def pin(core: int | None) -> None:
    """This process onto `core` alone (None, or no affinity API: left where it is)."""
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})


def default_core() -> int | None:
    """The core the measured loops run on: the highest this process may use."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return max(os.sched_getaffinity(0))


def keep_off(core: int | None) -> None:
    """Pin this process (the harness: it produces the events and reads the scores) to every allowed core but
    the measured one, and so does a broker it starts: on one core with the service, they would be measured
    with it (`txsentinel bench stream` once ran everything on core 0: 34% of the ceiling, 48% apart)."""
    if core is None or not hasattr(os, "sched_getaffinity"):
        return
    others = os.sched_getaffinity(0) - {core}
    if others:
        os.sched_setaffinity(0, others)


# -- child processes -------------------------------------------------------------------------------------
def service_child(
    overrides: dict, model_dir: str, bootstrap: str, core: int | None, phase_log: str | None = None
) -> None:
    """serve() pinned to `core`; with `phase_log`, the service's log at DEBUG goes to that file: a line a
    batch with its phases' seconds, timestamped, to place a slow batch against the broker's own logs."""
    pin(core)
    logging.basicConfig(level=logging.WARNING)
    if phase_log is not None:
        for handler in logging.getLogger().handlers:
            handler.setLevel(logging.WARNING)  # the DEBUG lines go to the file only
        to_file = logging.FileHandler(phase_log, mode="w")
        to_file.setFormatter(logging.Formatter("%(created).3f %(levelname)s %(name)s %(message)s"))
        service_log = logging.getLogger("consumers.service")  # the loop and its parts beside it
        service_log.setLevel(logging.DEBUG)
        service_log.addHandler(to_file)
    from consumers.service.loop import serve  # polars and torch, once pinned (module docstring)

    serve(load_serve_config(config_file=None, overrides=overrides, env={}), model_dir, bootstrap)


def raw_child(
    bootstrap: str, source: str, sink: str, group: str, count: int, max_poll_records: int, core: int | None
):
    """consume -> produce -> send_offsets_to_transaction -> commit per poll, like the service minus scoring."""
    pin(core)
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        transactional_id=f"bench-raw-{uuid.uuid4().hex[:8]}",
        linger_ms=ServeConfig.producer_linger_ms,  # the service's producer settings: a fair ceiling
        batch_size=ServeConfig.producer_batch_bytes,
    )
    producer.init_transactions()
    consumer = KafkaConsumer(
        source,
        bootstrap_servers=bootstrap,
        group_id=group,
        isolation_level="read_committed",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=max_poll_records,
    )
    done = 0
    while done < count:
        batch = consumer.poll(timeout_ms=500, max_records=max_poll_records)
        if not batch:
            continue
        producer.begin_transaction()
        offsets = {}
        for tp, records in batch.items():
            for r in records:
                # The input's partition number, as the service sends its scores: no per-record key hash.
                producer.send(sink, key=r.key, value=r.value, partition=tp.partition)
                done += 1
            offsets[tp] = OffsetAndMetadata(records[-1].offset + 1, "", -1)
        producer.send_offsets_to_transaction(offsets, consumer.group_metadata())
        producer.commit_transaction()
    consumer.close(autocommit=False)
    producer.close(timeout=10)


# -- harness helpers -------------------------------------------------------------------------------------
def admin_client(bootstrap):
    return KafkaAdminClient(bootstrap_servers=bootstrap, client_id="txsentinel-bench")


def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    admin = admin_client(bootstrap)
    try:
        admin.create_topics(
            {name: {"num_partitions": partitions, "replication_factor": 1}}, wait_for_metadata=True
        )
    finally:
        admin.close()


def delete_prefix(bootstrap: str, prefix: str) -> None:
    try:
        admin = admin_client(bootstrap)
        try:
            admin.delete_topics([t for t in admin.list_topics() if t.startswith(prefix)])
        finally:
            admin.close()
    except Exception as error:  # cleanup only
        print(log_prefix, f"could not delete topics {prefix}*: {error!r}")


def wait_owned(bootstrap: str, group: str, proc, timeout_s: float = 120) -> None:
    """Until the group is Stable with a member that holds partitions (the service is ready to consume)."""
    admin = admin_client(bootstrap)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if not proc.is_alive():
                raise RuntimeError(f"the service process exited early (exit code {proc.exitcode})")
            info = admin.describe_groups([group])[group]
            if info["group_state"] == "Stable" and info["members"]:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {group} not stable within {timeout_s} s: {info['group_state']}")
            time.sleep(0.2)
    finally:
        admin.close()


def wait_scored(port: int, count: int, proc, timeout_s: float) -> None:
    """Until the service's /metrics counts `count` events scored and committed (one cheap scrape a second,
    where reading the scores as they come would put a consumer beside the service and the broker)."""
    deadline = time.monotonic() + timeout_s
    while scrape(port, "txsentinel_events_scored_total") < count:
        if not proc.is_alive():
            raise RuntimeError(f"the service process exited (exit code {proc.exitcode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the service did not score {count} events within {timeout_s} s")
        time.sleep(1.0)


def read_timestamps(bootstrap: str, topic: str, count: int, timeout_s: float, proc=None):
    """Read `count` committed records of `topic` -> {event_id: timestamp_ms} (event_id from the JSON value)."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False
    )
    try:
        deadline = time.monotonic() + timeout_s
        parts = None
        while not parts:
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                time.sleep(0.2)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"topic {topic} never appeared")
        tps = [TopicPartition(topic, p) for p in parts]
        consumer.assign(tps)
        consumer.seek_to_beginning()
        out: dict[str, int] = {}
        seen = 0
        while seen < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{seen} of {count} records of {topic} within {timeout_s} s")
            if proc is not None and not proc.is_alive():
                raise RuntimeError(f"the process writing {topic} exited (exit code {proc.exitcode})")
            for records in consumer.poll(timeout_ms=500, max_records=5000).values():
                for r in records:
                    seen += 1
                    out[json.loads(r.value)["event_id"]] = r.timestamp
        return out, seen
    finally:
        consumer.close()


def produce(bootstrap: str, topic: str, messages: list[tuple[bytes, bytes]], rate: float | None) -> float:
    """Send all messages (rate: events/s, None = full speed); returns the achieved events/s. Each goes to
    its key's partition under the default partitioner, worked out before the clock starts: kafka-python's
    murmur2 is pure Python (~10 us a record), work the harness need not do beside the measured service."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=2, batch_size=256 * 1024)
    try:
        count = len(producer.partitions_for(topic))
        routed = [(key, value, (murmur2(key) & 0x7FFFFFFF) % count) for key, value in messages]
        started = time.monotonic()
        if rate is None:
            for key, value, partition in routed:
                producer.send(topic, key=key, value=value, partition=partition)
        else:
            slice_s = 0.01
            per_slice = max(1, round(rate * slice_s))
            for i in range(0, len(routed), per_slice):
                due = started + i / rate
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                for key, value, partition in routed[i : i + per_slice]:
                    producer.send(topic, key=key, value=value, partition=partition)
        producer.flush()
    finally:
        producer.close(timeout=10)
    return len(messages) / max(time.monotonic() - started, 1e-9)


def generated_events(n: int, seed: int = 3):
    """n generated events in time order, as (key, value) messages, and the frame they came from."""
    # polars: the harness's own work, never a child's (module docstring)
    from pipeline.data.generate import GenerateConfig, generate

    frame = generate(GenerateConfig(accounts=max(200, n // 40), days=45, seed=seed)).sort("ts", "event_id")
    if frame.height < n:
        raise ValueError(f"generated {frame.height} events, fewer than {n}")
    frame = frame.head(n)
    msgs = [(tx.account_id.encode(), encode_transaction(tx)) for tx in transactions_from_frame(frame)]
    return msgs, frame
