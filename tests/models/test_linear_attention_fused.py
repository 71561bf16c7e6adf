"""The linear Transformer's compiled serving step (models/linear_attention/fused.py) against its torch step,
the reference: same scores and running means to float rounding, on every branch of the update."""

import pytest
import torch

from consumers.scoring.state_store import StateStore
from models.contract import gather_states, scatter_states
from models.linear_transformer import LinearTransformerConfig, LinearTransformerDetector
from models.parity import random_events
from tests.models.conftest import TEST_DEVICE
from tests.models.helpers import max_state_diff

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the compiled step is the CPU serving path")

# float32: the kernel sums over the head dim in another order than torch, and its denominator in float32
# where torch's sum may keep more; 5,000-event streams in the contract suite stay within 1e-4.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def detector(dtype: torch.dtype, **config) -> LinearTransformerDetector:
    torch.manual_seed(0)
    return LinearTransformerDetector(LinearTransformerConfig(**config)).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("size", ["default", "tiny"])
def test_compiled_step_equals_the_torch_step(dtype, size):
    model = detector(dtype, **(LinearTransformerConfig.TINY if size == "tiny" else {}))
    x = random_events(model, 40, 30, seed=1)  # [B, T, F]
    # Accounts 0-39 start with 0-39 events of history: the first, second and later events of an account
    # take different branches of the update (torch.lerp's weight 1, 0.5, then below 0.5).
    with torch.no_grad():
        _, start = model(random_events(model, 40, 39, seed=2), lengths=torch.arange(40))
    torch_state, compiled_state = start, start
    for t in range(30):
        with torch.enable_grad():  # autograd on: the torch step (the compiled one does no autograd)
            expected, torch_state = model.step(x[:, t], torch_state)
        with torch.inference_mode():
            scores, compiled_state = model.step(x[:, t], compiled_state)
        assert (scores - expected).abs().max().item() <= TOLERANCE[dtype], t
        assert max_state_diff(compiled_state, torch_state) <= TOLERANCE[dtype], t
        torch_state = {key: value.detach() for key, value in torch_state.items()}


def test_the_store_steps_a_micro_batch_in_place_in_one_call(monkeypatch):
    model = detector(torch.float32)
    store = StateStore(model, capacity=8)
    accounts = [f"account-{i % 13}" for i in range(40)]  # 13 accounts, up to 4 events each, interleaved
    rows = store.rows(accounts)  # grows the store past its capacity
    x = random_events(model, 1, 40, seed=3)[0]  # [40, F] in arrival order
    expected, state = torch.empty(40), model.init_state(13)
    with torch.inference_mode():
        for i in range(40):  # the torch step, one event at a time
            account = torch.tensor([i % 13])
            score, part = model.step(x[i : i + 1], gather_states(state, account))
            expected[i] = score[0]
            scatter_states(state, account, part)
        # The compiled walk, not the base class's rounds: those would call `step` once a round.
        monkeypatch.setattr(model, "step", lambda *args: pytest.fail("step_in_place fell back to rounds"))
        in_place = model.step_in_place(x, store.states, torch.from_numpy(rows))
    assert (in_place - expected).abs().max().item() <= TOLERANCE[torch.float32]
    assert max_state_diff(store.gather(rows[:13]), state) <= TOLERANCE[torch.float32]


def test_with_autograd_on_step_in_place_takes_the_rounds_and_still_equals_stepping():
    model = detector(torch.float32, **LinearTransformerConfig.TINY)
    x = random_events(model, 3, 1, seed=4)[:, 0]  # [3, F]
    rows = torch.tensor([0, 3, 0])
    with torch.enable_grad():  # the compiled step does no autograd: the base class's rounds instead
        table = model.init_state(4)
        in_place = model.step_in_place(x, table, rows)
        assert in_place.requires_grad
        expected, state = torch.empty(3), model.init_state(4)
        for i, row in enumerate(rows.tolist()):
            index = torch.tensor([row])
            score, part = model.step(x[i : i + 1], gather_states(state, index))
            expected[i] = score[0]
            scatter_states(state, index, part)
    assert (in_place - expected).abs().max().item() <= 1e-6
    assert max_state_diff(table, state) <= 1e-6
    assert table["events"].tolist() == [2, 0, 0, 1]
