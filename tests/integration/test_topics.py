"""The service's topics on the real broker: created with the settings the design needs, kept when present,
refused when their partition counts break it."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType

from consumers.runtime.topics import ensure_topics
from tests.integration.service_helpers import create_topic, prefixed_configs

pytestmark = pytest.mark.kafka


def topic_settings(bootstrap: str, topic: str) -> tuple[int, dict[str, str]]:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        (described,) = admin.describe_topics([topic])
        configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    finally:
        admin.close()
    values = {name: entry["value"] for name, entry in configs["topic"][topic].items()}
    return len(described["partitions"]), values  # the topic's own settings, not the broker's defaults


def test_missing_topics_are_created_compacted_where_state_lives(kafka_bootstrap):
    with prefixed_configs(kafka_bootstrap, "topics", transactions_partitions=4) as make:
        cfg = make()
        assert ensure_topics(cfg, kafka_bootstrap) == 4
        for name in ("changelog", "terminal_table"):
            partitions, settings = topic_settings(kafka_bootstrap, cfg.topic(name))
            assert partitions == (4 if name == "changelog" else 1), name
            assert settings["cleanup.policy"] == "compact" and settings["retention.ms"] == "-1", name
            assert settings["segment.ms"] == "3600000", name
        for name in ("scores", "alerts", "dead_letter", "labels"):
            partitions, settings = topic_settings(kafka_bootstrap, cfg.topic(name))
            # Only settings given at creation come back: plain topics keep the broker's default (delete).
            assert partitions == 4 and "cleanup.policy" not in settings, name
        # Labels carry the broker's time: every label_ts is bounded by the broker's clock, not a producer's.
        assert (
            topic_settings(kafka_bootstrap, cfg.topic("labels"))[1]["message.timestamp.type"]
            == "LogAppendTime"
        )
        assert "message.timestamp.type" not in topic_settings(kafka_bootstrap, cfg.topic("transactions"))[1]
        assert ensure_topics(cfg, kafka_bootstrap) == 4  # a second start finds them all


def test_a_changelog_that_does_not_match_the_input_partitions_is_refused(kafka_bootstrap):
    with prefixed_configs(kafka_bootstrap, "topics") as make:
        cfg = make()
        create_topic(kafka_bootstrap, cfg.topic("transactions"), partitions=2)
        create_topic(kafka_bootstrap, cfg.topic("changelog"), partitions=3)
        with pytest.raises(ValueError, match=r"has 3 partitions, .* has 2: they must match"):
            ensure_topics(cfg, kafka_bootstrap)


def test_instances_starting_together_all_find_the_topics_one_of_them_created(kafka_bootstrap):
    # The broker lists a topic another instance is creating before its partitions have leaders: the
    # instance that lost the race must wait for them, not refuse a topic of "0 partitions".
    for _ in range(3):  # a race: a few rounds of fresh topics
        with prefixed_configs(kafka_bootstrap, "topics", transactions_partitions=4) as make:
            cfg = make()
            with ThreadPoolExecutor(max_workers=3) as pool:
                starts = [pool.submit(ensure_topics, cfg, kafka_bootstrap) for _ in range(3)]
                assert [start.result() for start in starts] == [4, 4, 4]
