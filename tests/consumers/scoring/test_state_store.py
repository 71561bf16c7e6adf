"""The state store's rows (consumers/scoring/state_store.py): a row handed out starts at the detector's
init_state whatever memory held before, growth keeps every held account's state, and a reservation makes room
once instead of doubling (and copying) its way there."""

import numpy as np
import pytest
import torch

from consumers.scoring.state_store import StateStore
from models.registry import REGISTRY, build_detector

TINY = {"num_features": 5, "d_model": 8, "num_layers": 1, "dropout": 0.0}


def store_of(name: str, capacity: int) -> StateStore:
    torch.manual_seed(0)
    overrides = {"window_events": 4} if name == "transformer" else {}
    return StateStore(build_detector(name, {**TINY, **overrides}), capacity=capacity)


def held_rows(store: StateStore, accounts: list[str]) -> dict[str, torch.Tensor]:
    return store.gather(np.asarray([store.slot_of[a] for a in accounts], dtype=np.int64))


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_rows_handed_out_start_at_init_state_whatever_the_rows_held(name):
    store = store_of(name, capacity=4)
    store.reserve(100)
    assert store.capacity >= 100
    with torch.inference_mode():  # the store's tensors are inference tensors
        for value in store.states.values():
            value.fill_(float("nan") if value.is_floating_point() else -7)  # what free memory may hold
    store.rows(["a", "b"])  # one at a time, as scoring allocates
    store.add(["c", "d"])  # in a block, as a restore that does not overwrite them does
    store.evict("a")
    store.rows(["e"])  # takes a's freed row
    init = store.detector.init_state(1)
    for key, value in held_rows(store, ["b", "c", "d", "e"]).items():
        torch.testing.assert_close(value, init[key].expand_as(value), rtol=0, atol=0)


def test_growth_keeps_every_held_accounts_state_and_a_reservation_grows_once():
    store = store_of("lstm", capacity=2)
    first = [f"a{i}" for i in range(3)]
    rows = store.add(first)  # past capacity 2: grows
    marked = {k: torch.randn_like(v) for k, v in store.gather(rows).items()}
    with torch.inference_mode():
        store.scatter(rows, marked)
    store.reserve(500)
    capacity = store.capacity
    assert capacity == 3 + 500  # exactly the room asked for: no doubling past it
    store.add([f"b{i}" for i in range(500)])
    assert store.capacity == capacity  # no growth (and no copy) on the way
    for key, value in held_rows(store, first).items():
        torch.testing.assert_close(value, marked[key], rtol=0, atol=0)
    store.add(["one more"])  # past the reservation: doubling again, the held states kept
    assert store.capacity == 2 * capacity
    for key, value in held_rows(store, first).items():
        torch.testing.assert_close(value, marked[key], rtol=0, atol=0)
    store.reserve(1)  # room there already: nothing changes
    assert store.capacity == 2 * capacity
