"""Every detector test runs on one torch thread (the fixture lives in tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _detector_tests_on_one_thread(one_torch_thread):
    yield
