"""What every trained detector reports besides detection quality: does serving reproduce training, how big
is an account's state, and what does a micro-batched step cost."""

import time

import numpy as np
import torch

from models.contract import RecurrentDetector
from models.state_codec import encode_account_state
from pipeline.training.sequences import AccountSequences

STEP_BATCH = 256  # accounts per micro-batched step, as the service runs it


def account_inputs(seqs: AccountSequences, account: int) -> torch.Tensor:
    rows = seqs.rows(account)
    x = np.concatenate([seqs.x[rows], seqs.terminal_bucket[rows, None].astype(np.float32)], axis=1)
    return torch.from_numpy(x)  # [T, F + 1]


@torch.inference_mode()
def parallel_vs_recurrent_error(
    detector: RecurrentDetector, seqs: AccountSequences, accounts: int = 8
) -> float:
    """Max |forward - step-by-step| of the logits over the longest `accounts` held-out histories."""
    detector.eval()
    chosen = np.argsort(-seqs.lengths, kind="stable")[:accounts]
    worst = 0.0
    for account in chosen:
        x = account_inputs(seqs, int(account))[None]  # [1, T, F + 1]
        parallel, _ = detector(x)
        state = detector.init_state(1)
        stepped = []
        for t in range(x.shape[1]):
            score, state = detector.step(x[:, t], state)
            stepped.append(score)
        worst = max(worst, float((parallel[0] - torch.cat(stepped)).abs().max()))
    return worst


def state_bytes_per_account(detector: RecurrentDetector) -> int:
    with torch.inference_mode():
        return len(encode_account_state(detector, detector.init_state(1)))


@torch.inference_mode()
def step_cost_us_per_event(detector: RecurrentDetector, batch: int = STEP_BATCH, repeats: int = 20) -> float:
    """Micro-seconds per event of one batched step over `batch` accounts (median of `repeats`)."""
    detector.eval()
    c = detector.config
    x = torch.cat([torch.randn(batch, c.num_features), torch.zeros(batch, 1)], dim=1)
    state = detector.init_state(batch)
    detector.step(x, state)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        detector.step(x, state)
        times.append(time.perf_counter() - start)
    return float(np.median(times) / batch * 1e6)
