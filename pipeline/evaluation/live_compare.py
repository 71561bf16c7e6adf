"""`txsentinel compare --live`: the served model and its shadow challenger on live traffic, side by side.

Reads, read_committed, the records of `scores` and `shadow-scores` written in the last `since` (by Kafka
record time), and every label of `labels` that has arrived; joins each model's scores with the labels on
event_id (an event with no label yet counts as genuine: the figures are those of the labels known now, and
rise as chargebacks arrive). Per model: AP over events, CP@k (per day of event ts, accounts ranked by their
highest score, accounts caught on earlier days dropped, mean over days; no published exclusions: live
traffic has no training week), alerts per day and the precision of its alerts (the challenger's `alert`
says where its threshold would have put one). The table is printed and logged to MLflow as one run.
"""

import json
import logging
import time
from dataclasses import dataclass

import numpy as np
import polars as pl
from kafka import KafkaConsumer
from kafka.structs import TopicPartition

from consumers.runtime.settings import ServeConfig
from models.checks import is_integer
from pipeline.evaluation.metrics import event_metrics
from pipeline.evaluation.protocol import MAX_K, ranked_card_precisions

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 60.0  # per topic, to read up to the end offsets it had when the read began


@dataclass(frozen=True)
class LiveCompareConfig:
    since_days: float = 7.0
    k: int = 100
    experiment: str = "txsentinel-live-compare"
    log_to_mlflow: bool = True

    def __post_init__(self):
        if not is_integer(self.k) or not 1 <= self.k <= MAX_K:
            raise ValueError(f"live compare: k = {self.k!r}, expected an integer from 1 to {MAX_K}")


def live_compare(
    serve: ServeConfig, bootstrap: str, cfg: LiveCompareConfig = LiveCompareConfig()
) -> pl.DataFrame:
    """One row per model (served, shadow): model_version, events, labelled frauds, ap, cp_at_k,
    alerts_per_day, precision_at_threshold. Raises ValueError when no shadow scores were written."""
    since_ms = int((time.time() - cfg.since_days * 86400) * 1000)
    security = serve.kafka_security
    labels = _labels(_read(bootstrap, serve.topic("labels"), 0, security))
    rows = []
    for role, topic in (("served", serve.topic("scores")), ("shadow", serve.topic("shadow_scores"))):
        scores = _scores(_read(bootstrap, topic, since_ms, security))
        if scores.height == 0:
            raise ValueError(
                f"no scores in topic {topic!r} in the last {cfg.since_days:g} days: "
                + (
                    "serve with --shadow URI to score a challenger"
                    if role == "shadow"
                    else "is serve running?"
                )
            )
        rows.append({"role": role, **_metrics(scores, labels, cfg.k)})
    table = pl.DataFrame(rows)
    if cfg.log_to_mlflow:
        _log(table, cfg)
    return table


def _read(bootstrap: str, topic: str, since_ms: int, security: dict) -> list[bytes]:
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False, **security
    )
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not tps:
            return []
        consumer.assign(tps)
        starts = consumer.offsets_for_times({tp: since_ms for tp in tps})
        end = consumer.end_offsets(tps)
        for tp in tps:
            found = starts.get(tp)
            consumer.seek(tp, found.offset if found is not None else end[tp])
        values, deadline = [], time.monotonic() + READ_TIMEOUT_S
        while any(consumer.position(tp) < end[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read topic {topic!r} up to {end} in {READ_TIMEOUT_S:g} s")
            for records in consumer.poll(timeout_ms=200).values():
                values += [r.value for r in records if r.offset < end[TopicPartition(topic, r.partition)]]
        return values
    finally:
        consumer.close()


def _scores(values: list[bytes]) -> pl.DataFrame:
    rows = [json.loads(v) for v in values if v is not None]
    schema = {"event_id": pl.String, "account_id": pl.String, "ts": pl.String, "score": pl.Float64,
              "alert": pl.Boolean, "model_version": pl.String}  # fmt: skip
    frame = pl.DataFrame([{k: r.get(k) for k in schema} for r in rows], schema=schema)
    return frame.with_columns(pl.col("ts").str.to_datetime(time_zone="UTC", strict=False))


def _labels(values: list[bytes]) -> pl.DataFrame:
    rows = []
    for value in values:
        try:
            data = json.loads(value)
            rows.append({"event_id": str(data["event_id"]), "is_fraud": bool(data["is_fraud"])})
        except (TypeError, ValueError, KeyError):
            continue  # the service dead-letters bad labels already
    frame = pl.DataFrame(rows, schema={"event_id": pl.String, "is_fraud": pl.Boolean})
    return frame.group_by("event_id").agg(pl.col("is_fraud").last())  # the latest label of an event


def _metrics(scores: pl.DataFrame, labels: pl.DataFrame, k: int) -> dict:
    joined = (
        scores.unique("event_id", keep="last")
        .join(labels, on="event_id", how="left")
        .with_columns(pl.col("is_fraud").fill_null(False), pl.col("ts").dt.truncate("1d").alias("day"))
    )
    _, ap = event_metrics(joined["score"].to_numpy(), joined["is_fraud"].to_numpy())
    days = max(joined["day"].n_unique(), 1)
    alerts = joined.filter(pl.col("alert"))
    return {
        "model_version": ",".join(sorted(set(scores["model_version"].drop_nulls().to_list()))),
        "events": joined.height,
        "frauds": int(joined["is_fraud"].sum()),
        "ap": ap,
        f"cp_at_{k}": _cp_at_k(joined, k),
        "alerts_per_day": alerts.height / days,
        "precision_at_threshold": float(alerts["is_fraud"].mean()) if alerts.height else float("nan"),
    }


def _cp_at_k(joined: pl.DataFrame, k: int) -> float:
    precisions = ranked_card_precisions(joined, sorted(joined["day"].unique().to_list()), k)
    return float(np.mean(precisions)) if precisions else float("nan")


def _log(table: pl.DataFrame, cfg: LiveCompareConfig) -> None:
    import mlflow

    mlflow.set_experiment(cfg.experiment)
    with mlflow.start_run(run_name="live-compare", tags={"run_type": "live_compare"}):
        mlflow.log_params({"since_days": cfg.since_days, "k": cfg.k})
        for row in table.iter_rows(named=True):
            mlflow.set_tag(f"{row['role']}_model_version", row["model_version"])
            for name, value in row.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and np.isfinite(value):
                    mlflow.log_metric(f"{row['role']}/{name}", float(value))
        mlflow.log_text(format_table(table), "live_compare.txt")


def format_table(table: pl.DataFrame) -> str:
    """The comparison as text: one column per model, one line per figure."""
    names = [c for c in table.columns if c != "role"]
    width = max(len(n) for n in names) + 2
    lines = [f"{'':<{width}}" + "".join(f"{r:>24}" for r in table["role"].to_list())]
    for name in names:
        cells = []
        for value in table[name].to_list():
            cells.append(f"{value:>24.4f}" if isinstance(value, float) else f"{value!s:>24}")
        lines.append(f"{name:<{width}}" + "".join(cells))
    return "\n".join(lines)
