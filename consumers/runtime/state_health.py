"""The health of the held recurrent states: how large they are, whether any went non-finite, and how many
accounts are still at the initial state.

A state that grows without bound, turns NaN or is reset to nothing (a lost changelog, a wrong restore) shows
here before it shows in the scores. Read on the service's thread (the states change under it otherwise),
every drift_refresh_s, over at most SAMPLE_ROWS held accounts drawn at random: the softmax Transformer's
state is 64 KB an account, and a full pass over 500,000 of them would stall a batch.
"""

from typing import NamedTuple

import numpy as np
import torch

from consumers.runtime.metrics import Metrics

SAMPLE_ROWS = 4096
QUANTILES = (0.5, 0.9, 0.99, 1.0)


class StateHealth(NamedTuple):
    norms: dict[str, float]  # quantile -> L2 norm of the whole state of an account
    initial_ratio: float  # share still equal to the initial state
    nonfinite: int  # sampled accounts with a value that is not finite (scaled up to all held accounts)
    accounts: int  # held accounts


@torch.inference_mode()
def state_health(
    states: dict[str, torch.Tensor],
    rows: np.ndarray,
    init: dict[str, torch.Tensor],
    rng: np.random.Generator,
    sample_rows: int = SAMPLE_ROWS,
) -> StateHealth:
    """Health of the held accounts' states: states {key: [capacity, ...]} batched, rows [A] the held
    accounts' rows, init {key: [1, ...]} the state of an account with no history."""
    accounts = len(rows)
    if accounts == 0:
        return StateHealth({f"{q:g}": float("nan") for q in QUANTILES}, float("nan"), 0, 0)
    if accounts > sample_rows:
        rows = rng.choice(rows, size=sample_rows, replace=False)
    index = torch.from_numpy(np.sort(rows)).to(next(iter(states.values())).device)
    squares = torch.zeros(len(index), dtype=torch.float64)
    finite = torch.ones(len(index), dtype=torch.bool)
    initial = torch.ones(len(index), dtype=torch.bool)
    for key, batched in states.items():
        values = batched.index_select(0, index).reshape(len(index), -1).to("cpu", torch.float64)  # [S, D]
        squares += values.square().sum(dim=1)
        finite &= torch.isfinite(values).all(dim=1)
        start = init[key].reshape(1, -1).to("cpu", torch.float64)
        initial &= (values == start).all(dim=1)
    norms = squares.sqrt()[finite].numpy()
    quantiles = (
        np.quantile(norms, QUANTILES) if len(norms) else np.full(len(QUANTILES), np.nan)
    )  # [len(QUANTILES)]
    scale = accounts / len(index)
    return StateHealth(
        norms={f"{q:g}": float(v) for q, v in zip(QUANTILES, quantiles, strict=True)},
        initial_ratio=float(initial.double().mean()),
        nonfinite=round(int((~finite).sum()) * scale),
        accounts=accounts,
    )


def publish_state_health(health: StateHealth, metrics: Metrics) -> None:
    """Set the state-health gauges."""
    metrics.set_labelled("txsentinel_state_norm", health.norms)
    metrics.set("txsentinel_states_initial_ratio", health.initial_ratio)
    metrics.set("txsentinel_states_nonfinite", health.nonfinite)
