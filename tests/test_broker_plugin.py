"""The broker plugin's clean-up after the run (tests/kafka_broker.py): a broker a test process started and
could not stop, because it died first, is stopped when the run ends; one that was up before is left up."""

from types import SimpleNamespace

import pytest

from tests import kafka_broker


def session(worker: bool = False) -> SimpleNamespace:
    config = SimpleNamespace(stash=pytest.Stash())
    if worker:
        config.workerinput = {}
    return SimpleNamespace(config=config)


@pytest.fixture
def broker(monkeypatch) -> SimpleNamespace:
    state = SimpleNamespace(up=False, stops=0)
    monkeypatch.setattr(kafka_broker, "port_open", lambda port: state.up)
    monkeypatch.setattr(kafka_broker, "managed_broker_running", lambda: state.up)

    def run_kafka_script(command, timeout_s):
        assert command == "stop"
        state.stops += 1
        state.up = False

    monkeypatch.setattr(kafka_broker, "run_kafka_script", run_kafka_script)
    return state


def test_a_broker_started_during_the_run_and_left_up_is_stopped_at_its_end(broker):
    run = session()
    kafka_broker.pytest_sessionstart(run)
    broker.up = True  # a worker started it, then died before its fixture's teardown
    with pytest.warns(UserWarning, match="stopping the Kafka broker a test process started and left running"):
        kafka_broker.pytest_sessionfinish(run)
    assert broker.stops == 1 and not broker.up


def test_a_broker_up_before_the_run_or_stopped_by_its_fixture_is_left_alone(broker):
    broker.up = True
    run = session()
    kafka_broker.pytest_sessionstart(run)
    kafka_broker.pytest_sessionfinish(run)  # somebody's broker: it stays up
    broker.up = False
    stopped = session()
    kafka_broker.pytest_sessionstart(stopped)
    kafka_broker.pytest_sessionfinish(stopped)  # started and stopped by the fixture: nothing left to stop
    assert broker.stops == 0


def test_a_worker_leaves_the_clean_up_to_the_controlling_process(broker):
    worker = session(worker=True)
    kafka_broker.pytest_sessionstart(worker)
    broker.up = True
    kafka_broker.pytest_sessionfinish(worker)  # other workers may still be using it
    assert broker.stops == 0 and broker.up
