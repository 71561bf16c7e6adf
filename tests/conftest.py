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
    """A test that uses the broker from a module not in BROKER_MODULES_ELSEWHERE fails here, before its
    fixtures. And each test starts with no MLflow experiment chosen: mlflow.set_experiment (which training
    calls) writes MLFLOW_EXPERIMENT_ID into os.environ and keeps the id in its module, and a later test's
    fresh tracking store (or a subprocess that inherits the variable) has no experiment of that id."""
    import os

    if item.nodeid in _UNLISTED_BROKER_USERS:
        pytest.fail(
            f"{item.nodeid} uses the Kafka broker, but its module is not in tests/conftest.py's "
            "BROKER_MODULES_ELSEWHERE: add it, so that `make test` runs it in the broker's process",
            pytrace=False,
        )
    os.environ.pop("MLFLOW_EXPERIMENT_ID", None)
    os.environ.pop("MLFLOW_RUN_ID", None)
    fluent = sys.modules.get("mlflow.tracking.fluent")
    if fluent is not None and fluent.active_run() is None:
        fluent._active_experiment_id = None


# How `make test` splits the suite over two processes (pytest -n 2 --dist loadscope): every module that uses the
# broker in one process, one after another and first, since the broker is one and some of them restart it;
# every other module whole (its module fixtures made once) in whichever process is free. The broker's tests
# spend most of their time waiting on Kafka, which the other modules fill. Modules outside tests/integration/
# that use the broker are named here; a test that uses it from a module not named fails in its setup.
BROKER_MODULES_ELSEWHERE = {
    "tests/pipeline/bench/test_restore.py",
    "tests/test_demo.py",
    "tests/test_packaging.py",
    "tests/test_readme_commands_on_the_broker.py",
}


def uses_the_broker(path: str) -> bool:
    """path: a test module's, relative to the repository root, as in a node id."""
    return path.startswith("tests/integration/") or path in BROKER_MODULES_ELSEWHERE


def module_path(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


# Set at collection: the tests that use the broker from a module not in BROKER_MODULES_ELSEWHERE. Each fails in
# its setup, before a fixture starts a broker (a collection error would read as an INTERNALERROR under xdist).
_UNLISTED_BROKER_USERS: set[str] = set()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Imported by pytest_plugins first, its assertions rewritten; its own hook may mark the items after this.
    from tests.kafka_broker import uses_the_broker_fixtures

    for item in items:
        needs = item.get_closest_marker("kafka") is not None or uses_the_broker_fixtures(item)
        if needs and not uses_the_broker(module_path(item.nodeid)):
            _UNLISTED_BROKER_USERS.add(item.nodeid)
    items.sort(key=lambda item: not uses_the_broker(module_path(item.nodeid)))  # stable: modules stay whole


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown to a run without the plugin
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Whatever --dist asks to split (load, loadscope, loadfile, ...): modules whole, and every module that
    uses the broker one scope, run in one process (see BROKER_MODULES_ELSEWHERE). pytest-xdist's own
    loadgroup would do it with marks, but with pytest 9.2 it no longer groups anything (pytest-xdist issue
    1386). --dist each runs everything in every process: left to xdist."""
    if config.getvalue("dist") == "each":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class BrokerApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = module_path(nodeid)
            return "the broker's modules" if uses_the_broker(path) else path

    return BrokerApart(config, log)
