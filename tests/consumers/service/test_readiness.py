"""What the service's /readyz says through a start, rebalances, a failed restore and the stop; and the model
it names in txsentinel_model_info. The broker side (503 -> 200 over HTTP) is tests/integration/test_probes.py."""

import threading
from dataclasses import replace

import pytest

from consumers.service.stats import model_info
from models.registry import build_detector
from pipeline.features.definitions import FEATURE_NAMES, FEATURE_VERSION
from pipeline.features.spec import FeatureSpec
from pipeline.registry.artifact import LoadedModel
from tests.consumers.service.test_loop import P0, P1, make_service


def test_ready_once_started_and_its_assigned_partitions_are_restored():
    service, _ = make_service([])
    ready, text = service.probes.ready()
    assert not ready and "start: creating topics" in text and "partitions: waiting for the group" in text
    service.probes.done("start")  # what start() does last
    restoring = []
    service._restore = lambda partitions: restoring.append(service.probes.ready())
    service.on_assigned([P0, P1])  # paused; the poll loop restores them before its next poll
    assert service.probes.ready() == (
        False,
        "not ready: partitions: restoring the states of partitions [0, 1]",
    )
    service._catch_up()
    assert restoring == [(False, "not ready: partitions: restoring the states of partitions [0, 1]")]
    assert service.probes.ready() == (True, "ready")


def test_a_rebalance_is_not_ready_until_the_next_assignment_is_restored_even_an_empty_one():
    service, _ = make_service([])
    service.probes.done("start")
    service.on_assigned([P0, P1])
    service.on_revoked([P0, P1])
    assert service.probes.ready() == (
        False,
        "not ready: partitions: rebalancing: partitions revoked, waiting for the next assignment",
    )
    service.on_assigned([])  # more members than partitions: a spare, ready to take over
    assert service.probes.ready() == (True, "ready")


def test_a_failed_restore_is_not_ready_and_says_why():
    service, _ = make_service([])
    service.probes.done("start")

    def fail(partitions):
        raise TimeoutError("changelog partition 1: 10 of 90 records in 300 s")

    service._restore = fail
    service.on_assigned([P1])
    with pytest.raises(TimeoutError):  # in the poll loop, which stops the service with it
        service._catch_up()
    ready, text = service.probes.ready()
    assert not ready and "restoring partitions [1] failed: TimeoutError('changelog partition 1" in text


def test_stopping_is_not_ready_and_the_loop_beats_while_it_runs():
    service, _ = make_service([({}, None)], fresh_fetch_ms=0)
    service.probes.done("start")
    service.on_assigned([P0, P1])
    stop = threading.Event()
    beats = []
    service.probes.beat = lambda: beats.append(1) or stop.set()  # one cycle, then stop
    service.run(stop)
    assert beats == [1]
    ready, text = service.probes.ready()
    assert not ready and "stop: stopping" in text


def test_model_info_names_the_detector_the_feature_version_and_the_registered_version():
    service, _ = make_service([])
    labels = service.metrics._info["txsentinel_model_info"]
    assert labels == {
        "name": "", "version": "", "detector": "lstm", "feature_version": str(FEATURE_VERSION), "source": "",
    }  # fmt: skip
    model = replace(_loaded_model(), source="models:/fraud/7")
    assert model_info(model) == {
        "name": "fraud", "version": "7", "detector": "lstm", "feature_version": str(FEATURE_VERSION),
        "source": "models:/fraud/7",
    }  # fmt: skip
    assert model_info(replace(model, source="runs:/0123/model"))["version"] == ""


def _loaded_model() -> LoadedModel:
    n = len(FEATURE_NAMES)
    detector = build_detector("lstm", {"num_features": n, "d_model": 8, "num_layers": 1})
    return LoadedModel(detector=detector, spec=FeatureSpec(mean=(0.0,) * n, std=(1.0,) * n))
