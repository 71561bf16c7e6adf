"""What every trained detector reports besides detection quality: does serving reproduce training, how big
is an account's state, and what does a micro-batched step cost. The step-cost timer here is the one the
benches use too."""

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from models.contract import RecurrentDetector
from models.hybrid import HybridDetector
from models.parity import both_paths, paths_error, random_events
from models.state_codec import encode_account_state
from pipeline.training.sequences import AccountSequences

STEP_BATCH = 256  # accounts per micro-batched step, as the service runs it


def account_inputs(seqs: AccountSequences, account: int) -> torch.Tensor:
    rows = seqs.rows(account)
    x = np.concatenate([seqs.x[rows], seqs.terminal_bucket[rows, None].astype(np.float32)], axis=1)
    return torch.from_numpy(x)  # [T, F + 1]


def parity_metrics(
    detector: RecurrentDetector, seqs: AccountSequences, accounts: int = 8
) -> dict[str, float]:
    """Does serving reproduce training, over the longest `accounts` held-out histories.

    test/parallel_vs_recurrent_max_abs: max |forward - step-by-step| of the logits; for a hybrid, of its
    base's, the recurrent part (its trees read one event at a time). The trees are piecewise constant in the
    base score, so a base score within float error (~1e-6) of one of their split points lands in another leaf
    on each path: test/hybrid_split_flips counts those events (a hybrid only; of order one in 10^4). The
    service and the backtest both step, so they agree on every event; only the test metrics, which come from
    forward, may score such an event otherwise.
    """
    chosen = np.argsort(-seqs.lengths, kind="stable")[:accounts]
    return parity_over(detector, [account_inputs(seqs, int(a))[None] for a in chosen])


def parity_over(detector: RecurrentDetector, inputs: list[Tensor]) -> dict[str, float]:
    """parity_metrics over histories given as inputs, each [1, T, F + 1]."""
    detector.eval()
    hybrid = isinstance(detector, HybridDetector)
    base = detector.base if hybrid else detector
    errors, flips = [], 0
    for x in inputs:
        # The base runs once each way; a hybrid's trees then read both paths' base scores
        whole, stepped = both_paths(base, x)
        errors.append(paths_error(whole, stepped))
        if hybrid:
            flips += _differing_events(detector, x, whole, stepped)
    metrics = {"test/parallel_vs_recurrent_max_abs": max(errors, default=0.0)}
    if hybrid:
        metrics["test/hybrid_split_flips"] = float(flips)
    return metrics


@torch.inference_mode()
def _differing_events(
    hybrid: HybridDetector, x: Tensor, whole: Tensor, stepped: Tensor, tolerance: float = 1e-4
) -> int:
    # whole, stepped [B, T]: the base's scores of x [B, T, F + 1] by forward and by step
    apart = hybrid.head_score(x, whole).double() - hybrid.head_score(x, stepped).double()
    return int((apart.abs() > tolerance).sum())


def state_bytes_per_account(detector: RecurrentDetector) -> int:
    with torch.inference_mode():
        return len(encode_account_state(detector, detector.init_state(1)))


def seconds_per_call(fns: dict[str, Callable[[], object]], seconds: float = 1.0) -> dict[str, float]:
    """Per function, the median over rounds of the mean time per call, waiting for the GPU where one runs.

    Rounds of ~0.05 s, the functions taking turns round after round, so the drift of a shared machine hits
    each one alike; at least 5 rounds each, more until `seconds` have passed."""
    calls = {}
    for key, fn in fns.items():
        fn()  # warm-up: allocator, oneDNN primitives, CUDA kernels
        _synchronize()
        start = time.perf_counter()
        fn()
        _synchronize()
        calls[key] = max(1, int(0.05 / max(time.perf_counter() - start, 1e-6)))
    times: dict[str, list[float]] = {key: [] for key in fns}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or min(len(t) for t in times.values()) < 5:
        for key, fn in fns.items():
            fn()  # untimed: brings this function's tensors back into cache after the previous one's
            _synchronize()
            start = time.perf_counter()
            for _ in range(calls[key]):
                fn()
            _synchronize()
            times[key].append((time.perf_counter() - start) / calls[key])
    return {key: statistics.median(t) for key, t in times.items()}


def _synchronize() -> None:
    # CUDA runs asynchronously: a clock read right after a launch would time the launch, not the work.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@torch.inference_mode()
def step_cost_us_per_event(
    detector: RecurrentDetector, batch: int = STEP_BATCH, seconds: float = 0.25
) -> float:
    """Micro-seconds per event of one batched step over `batch` accounts with no history, on the detector's
    device (seconds_per_call over `seconds`)."""
    detector.eval()
    x = random_events(detector, batch, 1)[:, 0]  # [B, F]
    state = detector.init_state(batch)
    step_s = seconds_per_call({"step": lambda: detector.step(x, state)}, seconds)["step"]
    return step_s / batch * 1e6
