"""Reads the `labels` topic for one service instance: all partitions, no consumer group, its own positions.

Every instance applies every label (the terminal-risk table is global). Positions are not committed to a
group: they travel in the terminal table (consumers/terminal_table.py), in the same transaction as the
terminal records they produced, and `seek` puts the reader back there on start and after an aborted batch.

`catch_up` reads up to the end offsets seen when it is called (read_committed), so a label committed to
`labels` before a batch is read is applied before that batch's events.
"""

import time

import numpy as np
from kafka import KafkaConsumer
from kafka.structs import TopicPartition

from consumers.messages import Label, MessageError, decode_label
from pipeline.features.stream import LabelBatch


class LabelReader:
    def __init__(self, consumer: KafkaConsumer, topic: str, timeout_s: float):
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            raise ValueError(f"labels topic {topic!r} has no partitions (does it exist?)")
        self.consumer = consumer
        self.topic = topic
        self.timeout_s = timeout_s
        self.tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(self.tps)

    def seek(self, positions: dict[int, int]) -> None:
        """Go to `positions` ({partition: next offset}); a partition without one starts from its beginning."""
        missing = [tp for tp in self.tps if tp.partition not in positions]
        if missing:
            self.consumer.seek_to_beginning(*missing)
        for tp in self.tps:
            if tp.partition in positions:
                self.consumer.seek(tp, positions[tp.partition])

    def positions(self) -> dict[int, int]:
        return {tp.partition: self.consumer.position(tp) for tp in self.tps}

    def catch_up(self) -> tuple[list[Label], list[tuple[object, MessageError]]]:
        """(labels, [(record, error)] of messages that do not decode), in partition then offset order."""
        started = time.monotonic()
        end = self.consumer.end_offsets(self.tps)
        labels, bad = [], []
        while any(self.consumer.position(tp) < end[tp] for tp in self.tps):
            if time.monotonic() - started > self.timeout_s:
                raise TimeoutError(
                    f"reading labels topic {self.topic!r} up to {end} took over {self.timeout_s} s"
                )
            batch = self.consumer.poll(timeout_ms=100)
            for tp in sorted(batch, key=lambda tp: tp.partition):
                for record in batch[tp]:
                    try:
                        if record.value is None:
                            raise MessageError("null value (a tombstone): expected a JSON label")
                        labels.append(decode_label(record.value))
                    except MessageError as error:
                        bad.append((record, error))
        return labels, bad


def label_batch(labels: list[Label]) -> LabelBatch:
    n = len(labels)
    return LabelBatch(
        terminal_ids=[label.terminal_id for label in labels],
        label_ts_us=np.fromiter((label.label_ts_us for label in labels), dtype=np.int64, count=n),
        is_fraud=np.fromiter((label.is_fraud for label in labels), dtype=bool, count=n),
    )
