"""/healthz and /readyz: what is awaited, and a loop that has stopped coming round."""

import urllib.error
import urllib.request

import pytest

from consumers.runtime.endpoints import StatusServer
from consumers.runtime.metrics import Metrics
from consumers.runtime.probes import Probes


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture
def served():
    clock = Clock()
    probes = Probes(stall_after_s=60, clock=clock)
    server = StatusServer(Metrics(), probes, "127.0.0.1", 0)
    yield probes, clock, server.port
    server.close()


def test_readyz_is_503_naming_what_is_awaited_until_nothing_is(served):
    probes, _, port = served
    probes.wait_for("start", "starting the producer")
    probes.wait_for("partitions", "restoring the states of partitions [0, 2]")
    assert get(port, "/readyz") == (
        503,
        "not ready: start: starting the producer; partitions: restoring the states of partitions [0, 2]\n",
    )
    probes.done("start")
    assert get(port, "/readyz") == (503, "not ready: partitions: restoring the states of partitions [0, 2]\n")
    probes.done("partitions")
    assert get(port, "/readyz") == (200, "ready\n")
    probes.wait_for("partitions", "rebalancing")  # a rebalance: not ready again
    assert get(port, "/readyz")[0] == 503
    assert get(port, "/healthz") == (200, "alive\n")  # awaiting is not dying


def test_healthz_is_503_once_the_loop_has_not_come_round_within_its_limit(served):
    probes, clock, port = served
    clock.now += 59
    assert get(port, "/healthz") == (200, "alive\n")
    clock.now += 2
    assert get(port, "/healthz") == (503, "stalled: the loop has not come round for 61 s (limit 60 s)\n")
    probes.beat()
    assert get(port, "/healthz") == (200, "alive\n")


def test_other_paths_are_404_naming_the_ones_served(served):
    _, _, port = served
    status, body = get(port, "/ready")
    assert status == 404 and "/metrics, /healthz, /readyz" in body
    assert get(port, "/metrics")[0] == 200


def test_probes_without_a_stall_limit_are_alive_and_with_nothing_awaited_ready():
    probes = Probes()
    assert probes.alive() == (True, "alive") and probes.ready() == (True, "ready")
