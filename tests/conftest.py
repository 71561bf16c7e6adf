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
