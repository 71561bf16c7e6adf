"""Pytest plugin: the project's real Apache Kafka broker (scripts/kafka.sh) for tests marked ``kafka``.

Fixtures:
- ``kafka_broker`` (session): a :class:`KafkaBroker`; reuses a broker already listening on TXS_KAFKA_PORT
  (default 39092), otherwise starts one with ``scripts/kafka.sh start`` and stops it when the session ends.
- ``kafka_bootstrap`` (session): its bootstrap address, ``"127.0.0.1:PORT"``.
- ``topic_factory`` (function): creates uniquely named topics and deletes them after the test.

Every test that uses one of these fixtures gets the ``kafka`` marker, so ``pytest -m "not kafka"`` skips them.
"""

from __future__ import annotations

import subprocess
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import pytest
from kafka import KafkaAdminClient

from pipeline.bench.broker import (
    KAFKA_SCRIPT,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    kafka_port,
    port_open,
    run_kafka_script,
)

KAFKA_FIXTURES = {"kafka_broker", "kafka_bootstrap", "topic_factory"}
_BROKER_UP_AT_START = pytest.StashKey[bool]()  # in the controlling process: was a broker up before the run


@dataclass
class KafkaBroker:
    bootstrap: str
    # True when scripts/kafka.sh runs this broker (so the tests may restart it); False for a broker that
    # something else started on our port.
    managed: bool

    def restart(self) -> None:
        """Stops and starts the broker on the same data, to test what survives a restart."""
        if not self.managed:
            pytest.skip(
                f"the broker at {self.bootstrap} was not started by scripts/kafka.sh, so cannot restart it"
            )
        run_kafka_script("stop", STOP_TIMEOUT_S)
        run_kafka_script("start", START_TIMEOUT_S)


def managed_broker_running() -> bool:
    """Whether scripts/kafka.sh runs a broker (not merely: something listens on the port)."""
    return subprocess.run([str(KAFKA_SCRIPT), "status"], capture_output=True, check=False).returncode == 0


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaBroker]:
    port = kafka_port()
    bootstrap = f"127.0.0.1:{port}"
    if port_open(port):
        # Somebody's broker is up already (e.g. `scripts/kafka.sh start` in a terminal): use it, leave it running.
        yield KafkaBroker(bootstrap, managed=managed_broker_running())
        return
    run_kafka_script("start", START_TIMEOUT_S)
    try:
        yield KafkaBroker(bootstrap, managed=True)
    finally:
        run_kafka_script("stop", STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_broker: KafkaBroker) -> str:
    return kafka_broker.bootstrap


def _admin(bootstrap: str) -> KafkaAdminClient:
    return KafkaAdminClient(bootstrap_servers=bootstrap, client_id="txsentinel-tests-admin")


@pytest.fixture
def topic_factory(kafka_bootstrap: str) -> Iterator[Callable[..., str]]:
    """``create(prefix="test", partitions=1, config=None) -> name``; the topics are deleted afterwards."""
    created: list[str] = []

    def create(prefix: str = "test", partitions: int = 1, config: Mapping[str, object] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        spec = {
            "num_partitions": partitions,
            "replication_factor": 1,
            "configs": {key: str(value) for key, value in (config or {}).items()},
        }
        # A fresh admin client per call: a test may restart the broker between two calls.
        admin = _admin(kafka_bootstrap)
        try:
            # wait_for_metadata: CreateTopics returns before every partition has a leader; producing
            # earlier fails with UNKNOWN_TOPIC_OR_PARTITION.
            admin.create_topics({name: spec}, wait_for_metadata=True)
        finally:
            admin.close()
        created.append(name)
        return name

    yield create

    if created:
        try:
            admin = _admin(kafka_bootstrap)
            try:
                admin.delete_topics(created)
            finally:
                admin.close()
        except Exception as exc:  # a failed cleanup must not hide the test's own result
            warnings.warn(
                f"could not delete test topics {created} at {kafka_bootstrap}: {exc!r}", stacklevel=1
            )


def uses_the_broker_fixtures(item: pytest.Item) -> bool:
    return bool(KAFKA_FIXTURES.intersection(getattr(item, "fixturenames", ())))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if uses_the_broker_fixtures(item):
            item.add_marker(pytest.mark.kafka)


def pytest_sessionstart(session: pytest.Session) -> None:
    # In the controlling process only: xdist workers have `workerinput`, and a run without xdist has one process.
    if not hasattr(session.config, "workerinput"):
        session.config.stash[_BROKER_UP_AT_START] = port_open(kafka_port())


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop a broker this run started and did not stop: the worker that started it died before its session
    fixture's teardown (a crash, a kill by timeout). A broker that was up before the run is left running."""
    if hasattr(session.config, "workerinput") or session.config.stash.get(_BROKER_UP_AT_START, True):
        return
    if managed_broker_running():
        warnings.warn("stopping the Kafka broker a test process started and left running", stacklevel=1)
        run_kafka_script("stop", STOP_TIMEOUT_S)
