"""Set-up that several integration modules share, made once per test run: a history with one terminal per
event (service_runs.unique_terminals says why) and a tiny model fitted on it."""

import pytest

from tests.integration.service_helpers import save_tiny_model
from tests.integration.service_runs import unique_terminal_history


@pytest.fixture(scope="session")
def unique_frame():  # ~2100 events, 34 accounts
    return unique_terminal_history(accounts=60, seed=5)


@pytest.fixture(scope="session")
def unique_model(tmp_path_factory, unique_frame) -> str:
    """An untrained tiny LSTM fitted on the first 20 days of `unique_frame`."""
    return save_tiny_model(unique_frame, 20, tmp_path_factory.mktemp("unique-model"), "unique-1")
