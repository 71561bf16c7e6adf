"""The scoring service's topics: created when missing, refused when their partition counts break the design.

`transactions`, `scores`, `alerts`, `dead-letter`: plain topics. `labels`: stamped with the broker's time
(LABELS_CONFIG). The account-state changelog:
compacted, as many partitions as `transactions`. The terminal table: compacted, one partition. The terminal
deltas: as many partitions as `transactions`, time retention (consumers/terminals/table.py).
"""

import logging
import time

from kafka import KafkaAdminClient, KafkaConsumer
from kafka.errors import KafkaError, TopicAlreadyExistsError

from consumers.runtime.settings import ServeConfig

TABLE_PARTITIONS = 1  # small and read whole by every instance: one partition keeps it simple and ordered
PARTITIONS_WAIT_S = 30.0  # for the partitions of a topic that another instance is creating at this moment

log = logging.getLogger(__name__)

# The changelog and the terminal table keep every key's latest record forever: compaction only, no time
# retention. Segments roll hourly (the default is a week or 1 GiB): the cleaner compacts only closed
# segments, and a restore reads everything not compacted yet (superseded states, tombstoned journal records).
COMPACTED_CONFIG = {"cleanup.policy": "compact", "retention.ms": "-1", "segment.ms": str(60 * 60 * 1000)}

# A label is judged by its record's timestamp (consumers/terminals/feed.py): the broker's append time, so a
# label_ts is at most max_ts_skew_s after the broker's clock, whatever the producer's clock says, and a label
# waits for its day a day at most. A labels topic created elsewhere: docs/operations.md, Labels' time.
LABELS_CONFIG = {"message.timestamp.type": "LogAppendTime"}


def ensure_topics(cfg: ServeConfig, bootstrap: str) -> int:
    """Create the service's missing topics; returns the partition count of `transactions`.

    Refuses a changelog whose partition count differs from the transactions topic: restoring input
    partition p reads changelog partition p, so the counts must match.
    """
    admin = KafkaAdminClient(
        bootstrap_servers=bootstrap,
        client_id="txsentinel-serve-admin",
        bootstrap_timeout_ms=cfg.bootstrap_timeout_ms,  # the first contact: a wrong address fails here
        **cfg.kafka_security,
    )
    try:
        existing = set(admin.list_topics())
        transactions = cfg.topic("transactions")
        if transactions not in existing:
            _create(admin, transactions, cfg.transactions_partitions, cfg.replication_factor, {})
        partitions = _partition_count(admin, transactions)
        for name in ("scores", "alerts", "dead_letter"):
            if cfg.topic(name) not in existing:
                _create(admin, cfg.topic(name), partitions, cfg.replication_factor, {})
        changelog = cfg.topic("changelog")
        if changelog not in existing:
            _create(admin, changelog, partitions, cfg.replication_factor, COMPACTED_CONFIG)
        found = _partition_count(admin, changelog)
        if found != partitions:
            raise ValueError(
                f"changelog topic {changelog!r} has {found} partitions, {transactions!r} has {partitions}: they "
                "must match (state of input partition p lives in changelog partition p). A grown `transactions` "
                "sends keys to other partitions than their states were kept by: serve it as a new deployment "
                "(a new topic_prefix, or changelog_topic, and a replay; docs/operations.md, Instances and "
                "partitions)"
            )
        labels = cfg.topic("labels")
        if labels not in existing:
            _create(admin, labels, partitions, cfg.replication_factor, LABELS_CONFIG)
        deltas = cfg.topic("terminal_deltas")
        if deltas not in existing:
            retention = {"cleanup.policy": "delete", "retention.ms": str(cfg.terminal_deltas_retention_ms)}
            _create(admin, deltas, partitions, cfg.replication_factor, retention)
        table = cfg.topic("terminal_table")
        if table not in existing:
            _create(
                admin,
                table,
                TABLE_PARTITIONS,
                cfg.replication_factor,
                COMPACTED_CONFIG,
            )
        found = _partition_count(admin, table)
        if found != TABLE_PARTITIONS:
            raise ValueError(
                f"terminal table topic {table!r} has {found} partitions, expected "
                f"{TABLE_PARTITIONS}; point terminal_table_topic at a new topic"
            )
        return partitions
    finally:
        admin.close()


def _create(admin: KafkaAdminClient, name: str, partitions: int, replication: int, config: dict) -> None:
    spec = {"num_partitions": partitions, "replication_factor": replication, "configs": config}
    try:
        admin.create_topics({name: spec}, wait_for_metadata=True)
        log.info("created topic=%s partitions=%d config=%s", name, partitions, config)
    except TopicAlreadyExistsError:
        pass  # another instance created it in between
    except KafkaError as error:  # e.g. a replication factor above the broker count, or no ACL to create
        error.add_note(f"creating topic {name!r}: {partitions} partitions, replication factor {replication}")
        raise


def _partition_count(admin: KafkaAdminClient, topic: str) -> int:
    # Instances starting together: the broker lists a topic that another one is creating before its
    # partitions have leaders (that instance's create_topics waits for them, this one's got
    # TopicAlreadyExistsError at once), and it would read as a topic of 0 partitions.
    deadline = time.monotonic() + PARTITIONS_WAIT_S
    while True:
        try:
            (described,) = admin.describe_topics([topic])
        except KafkaError as error:
            error.add_note(f"reading the partitions of topic {topic!r}")
            raise
        if described["partitions"] or time.monotonic() > deadline:
            return len(described["partitions"])
        time.sleep(0.1)


create_topic, partition_count = (
    _create,
    _partition_count,
)  # for the shadow's topics (consumers/service/shadow.py)


def refresh_metadata(consumer: KafkaConsumer, timeout_ms: int) -> None:
    """Have `consumer` read the cluster's metadata now, waiting at most `timeout_ms`: KafkaError past it, or
    when the request fails. A group's leader that reads a new partition count rebalances the group.

    kafka-python 3 has no public call for it with a bound (KafkaConsumer.topics() waits without one), and
    its own metadata_max_age_ms timer was seen to leave a new partition unread for minutes."""
    future = consumer._cluster.request_update()
    consumer._net.run(consumer._manager.wait_for, future, timeout_ms)
