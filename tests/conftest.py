"""Shared pytest setup: fixtures for the real Kafka broker live in tests/kafka_broker.py."""

import sys

import pytest
import torch

pytest_plugins = ["tests.kafka_broker"]


@pytest.fixture
def one_torch_thread():
    """Detector code runs many tiny ops one after another: one thread is faster and timings are steadier.
    Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Each test starts with no MLflow experiment chosen: mlflow.set_experiment (which training calls)
    writes MLFLOW_EXPERIMENT_ID into os.environ and keeps the id in its module, and a later test's fresh
    tracking store (or a subprocess that inherits the variable) has no experiment of that id."""
    import os

    os.environ.pop("MLFLOW_EXPERIMENT_ID", None)
    os.environ.pop("MLFLOW_RUN_ID", None)
    fluent = sys.modules.get("mlflow.tracking.fluent")
    if fluent is not None and fluent.active_run() is None:
        fluent._active_experiment_id = None


@pytest.hookimpl(trylast=True)  # after tests/kafka_broker.py has marked the tests that need the broker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """How `make test` splits the suite over its two processes (pytest -n 2 --dist loadgroup): every module
    that needs the broker in one process, one after another, its tests first, since the broker is one and
    some tests restart it; every other module whole (its module fixtures made once) wherever a process is
    free. The broker's tests spend most of their time waiting on Kafka, which the other modules fill."""
    broker_modules = {item.module.__name__ for item in items if item.get_closest_marker("kafka")}
    for item in items:
        module = item.module.__name__
        item.add_marker(pytest.mark.xdist_group("broker" if module in broker_modules else module))
    items.sort(key=lambda item: item.module.__name__ not in broker_modules)  # stable: modules stay whole
