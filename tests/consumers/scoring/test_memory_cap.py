"""The memory cap in bytes: what one held account costs, measured per detector, and how many accounts a cap
in bytes holds (consumers/scoring/held_accounts.py); the service holds that many, letting the rest go as
the count cap does (consumers/service/dormant.py, tests/consumers/service/test_dormant.py)."""

import pytest
import torch

from consumers.runtime.settings import load_serve_config
from consumers.scoring.held_accounts import ACCOUNT_OVERHEAD_BYTES, STORE_ROW_BYTES
from consumers.scoring.messages import Transaction
from consumers.scoring.scorer import Scorer
from consumers.service.loop import _Service
from models.registry import REGISTRY, build_detector
from pipeline.features.definitions import FEATURE_NAMES
from pipeline.features.spec import FeatureSpec
from pipeline.features.state import ACCOUNT_STATE
from pipeline.registry.artifact import LoadedModel

N = len(FEATURE_NAMES)


def model(name: str, **config) -> LoadedModel:
    torch.manual_seed(0)
    spec = FeatureSpec(mean=(0.0,) * N, std=(1.0,) * N)
    return LoadedModel(detector=build_detector(name, {"num_features": N, **config}), spec=spec)


def events(accounts: int) -> list[Transaction]:
    return [
        Transaction(f"E{i}", f"A{i}", 1_700_000_000_000_000 + i, 10.0, f"T{i % 7}") for i in range(accounts)
    ]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_an_accounts_bytes_are_its_store_row_as_allocated_plus_its_records(name):
    scorer = Scorer(model(name))
    scorer.score(events(30))  # rows for 30 accounts in a store of 1024: the measure holds at any count
    store = scorer.store
    allocated = sum(t.numel() * t.element_size() for t in store.states.values())  # [capacity, ...] each
    assert store.row_bytes * store.capacity == allocated  # the measure is what the store really holds
    assert scorer.state_bytes_per_account == (
        store.row_bytes + ACCOUNT_STATE.itemsize + STORE_ROW_BYTES + ACCOUNT_OVERHEAD_BYTES
    )


def test_the_default_detectors_cost_what_the_docs_say_and_the_softmax_window_dominates():
    kib = {name: Scorer(model(name)).state_bytes_per_account / 1024 for name in sorted(REGISTRY)}
    assert 2.0 < kib["lstm"] < 2.5  # ~2.2 KB
    assert 9.5 < kib["linear_transformer"] < 10.5  # ~9.9 KB
    assert 64 < kib["transformer"] < 68  # ~67 KB: 500,000 of them would be ~33 GB


def test_the_byte_cap_binds_where_states_are_large_and_the_count_cap_where_they_are_small():
    cfg = load_serve_config(None, env={})
    lstm, softmax = Scorer(model("lstm")), Scorer(model("transformer"))
    assert lstm.states_within(cfg.max_states_in_memory, cfg.max_state_bytes_in_memory) == 500_000
    held = softmax.states_within(cfg.max_states_in_memory, cfg.max_state_bytes_in_memory)
    assert held == cfg.max_state_bytes_in_memory // softmax.state_bytes_per_account  # ~128,000
    assert held * softmax.state_bytes_per_account <= 8 * 2**30 < (held + 1) * softmax.state_bytes_per_account


def test_a_byte_cap_that_holds_no_state_is_refused_naming_the_setting_and_the_size():
    scorer = Scorer(model("transformer"))
    with pytest.raises(
        ValueError, match=r"max_state_bytes_in_memory = 1000 holds no account state: one takes \d+"
    ):
        scorer.states_within(500_000, 1000)


def test_the_service_holds_what_the_byte_cap_allows_and_the_store_stops_doubling_there():
    loaded = model("lstm", d_model=8, num_layers=1)
    per_account = Scorer(loaded).state_bytes_per_account
    cfg = load_serve_config(
        None, overrides={"max_state_bytes_in_memory": 1500 * per_account, "max_poll_records": 50}, env={}
    )
    service = _Service(cfg, loaded)
    assert service.dormant.capacity == 1500  # evicted beyond it after each commit, as the count cap does
    store = service.scorer.store
    assert store.row_limit == 1500 + 2 * 50  # the two batches not yet committed
    service.scorer.score(events(1600))
    assert store.capacity == 1600  # doubling from 1024 stopped at the limit, not 2048
    service.scorer.score(events(1700))
    assert store.capacity == 3200  # more than the limit: doubling again, nothing refused
