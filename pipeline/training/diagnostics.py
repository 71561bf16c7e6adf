"""What every trained detector reports besides detection quality: does serving reproduce training, how big
is an account's state, and what does a micro-batched step cost. The step-cost timer here is the one the
benches use too."""

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from models.contract import RecurrentDetector
from models.parity import random_events, step_vs_forward_error
from models.state_codec import encode_account_state
from pipeline.training.sequences import AccountSequences

STEP_BATCH = 256  # accounts per micro-batched step, as the service runs it


def account_inputs(seqs: AccountSequences, account: int) -> torch.Tensor:
    rows = seqs.rows(account)
    x = np.concatenate([seqs.x[rows], seqs.terminal_bucket[rows, None].astype(np.float32)], axis=1)
    return torch.from_numpy(x)  # [T, F + 1]


def parallel_vs_recurrent_error(
    detector: RecurrentDetector, seqs: AccountSequences, accounts: int = 8
) -> float:
    """Max |forward - step-by-step| of the logits over the longest `accounts` held-out histories."""
    detector.eval()
    chosen = np.argsort(-seqs.lengths, kind="stable")[:accounts]
    errors = [step_vs_forward_error(detector, account_inputs(seqs, int(a))[None]) for a in chosen]
    return max(errors, default=0.0)


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
