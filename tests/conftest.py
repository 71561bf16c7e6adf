"""Shared pytest setup: fixtures for the real Kafka broker live in tests/kafka_broker.py."""

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
