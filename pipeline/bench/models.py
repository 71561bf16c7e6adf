"""Detector cost on one CPU thread at default size: training throughput, serving throughput and latency,
state size, and whether a step's cost stays flat as an account's history grows.

    .venv/bin/python -m pipeline.bench.models [lstm transformer linear_transformer]
"""

import sys

import torch

from models.contract import RecurrentDetector, State, gather_states
from models.parity import random_events
from models.registry import REGISTRY, build_detector
from models.state_codec import encode_account_state
from pipeline.training.diagnostics import STEP_BATCH, seconds_per_call

TRAIN_BATCH, TRAIN_EVENTS = 32, 256  # one training chunk: B accounts x T events
HISTORIES = (10, 1_000, 100_000)  # events of history before the timed steps
HISTORY_CHUNK_EVENTS = 2_048  # chunk of the forward pass that builds a long history cheaply
# Targets at the default size (d_model=64, 2 layers); detectors not listed have none.
TARGETS = {
    "lstm": {"step_events_per_s": 250_000, "state_bytes": 1024},
    "linear_transformer": {"step_events_per_s": 80_000, "state_bytes": 9 * 1024},
}


def _history_state(detector: RecurrentDetector, events: int) -> State:
    # The state of one account after `events` random events, via forward in chunks (fast, and exact).
    x = random_events(detector, 1, events, seed=events)
    state = detector.init_state(1)
    for start in range(0, events, HISTORY_CHUNK_EVENTS):
        _, state = detector(x[:, start : start + HISTORY_CHUNK_EVENTS], state)
    return state


def bench_detector(detector: RecurrentDetector) -> dict[str, float]:
    """Costs of one detector (float32, one thread); see the module docstring."""
    results = {}

    detector.train()
    x = random_events(detector, TRAIN_BATCH, TRAIN_EVENTS, seed=1)
    target = (
        torch.rand(TRAIN_BATCH, TRAIN_EVENTS, generator=torch.Generator().manual_seed(2)) < 0.02
    ).float()

    def train_step() -> None:
        scores, _ = detector(x)
        torch.nn.functional.binary_cross_entropy_with_logits(scores, target).backward()
        detector.zero_grad(set_to_none=True)

    train_s = seconds_per_call({"train": train_step}, seconds=3.0)["train"]
    results["train_events_per_s"] = TRAIN_BATCH * TRAIN_EVENTS / train_s

    detector.eval()
    with torch.inference_mode():
        histories = {n: _history_state(detector, n) for n in HISTORIES}
        events = random_events(detector, STEP_BATCH, 1, seed=3)[:, 0]  # [B, F]
        many = torch.zeros(STEP_BATCH, dtype=torch.long)  # every account of the batch has the same history
        batched = {n: gather_states(state, many) for n, state in histories.items()}
        one = histories[HISTORIES[-1]]
        steps = {str(n): (lambda s=state: detector.step(events, s)) for n, state in batched.items()}
        seconds = seconds_per_call({**steps, "latency": lambda: detector.step(events[:1], one)}, seconds=4.0)
        step_s = [seconds[str(n)] for n in HISTORIES]
        results["step_events_per_s"] = STEP_BATCH * len(step_s) / sum(step_s)
        for n, s in zip(HISTORIES, step_s, strict=True):
            results[f"step_ms_after_{n}"] = s * 1e3
        results["step_cost_spread"] = max(step_s) / min(step_s) - 1.0
        # Flat: the LSTM and linear Transformer within 10%; the Transformer bounded by its window (no
        # dearer after 100,000 events than after 1,000, well past W).
        if "window_events" in detector.config.to_dict():
            results["history_flat"] = float(step_s[-1] <= 1.1 * step_s[1])
        else:
            results["history_flat"] = float(results["step_cost_spread"] <= 0.10)
        results["latency_ms"] = seconds["latency"] * 1e3
        results["state_bytes"] = len(encode_account_state(detector, one))
        results["state_payload_bytes"] = sum(v.element_size() * v.numel() for v in one.values())
        sizes = {len(encode_account_state(detector, state)) for state in histories.values()}
        results["state_bytes_constant"] = float(len(sizes) == 1)
    return results


def _table(results: dict[str, dict[str, float]]) -> str:
    rows = [
        (
            "detector",
            "train ev/s",
            f"step ev/s B={STEP_BATCH}",
            "latency ms B=1",
            "state B (payload)",
            "step ms after " + " / ".join(f"{n:,}" for n in HISTORIES) + " ev",
            "spread",
        )
    ]
    for name, r in results.items():
        target = TARGETS.get(name, {})
        step = f"{r['step_events_per_s']:,.0f}"
        if "step_events_per_s" in target:
            step += f" (>= {target['step_events_per_s']:,})"
        state = f"{r['state_bytes']:,.0f} ({r['state_payload_bytes']:,.0f})"
        if "state_bytes" in target:
            state += f" (<= {target['state_bytes']:,})"
        rows.append(
            (
                name,
                f"{r['train_events_per_s']:,.0f}",
                step,
                f"{r['latency_ms']:.3f}",
                state,
                " / ".join(f"{r[f'step_ms_after_{n}']:.2f}" for n in HISTORIES),
                f"{r['step_cost_spread']:+.0%} {'flat' if r['history_flat'] else 'NOT FLAT'}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_model_bench(models: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Bench each detector (all registered when None) at its default config; prints a table."""
    torch.set_num_threads(1)
    names = list(REGISTRY) if models is None else models
    results = {}
    for name in names:
        torch.manual_seed(0)
        results[name] = bench_detector(build_detector(name))
        print(f"{name}: {results[name]}", flush=True)
    # This shared machine's speed drifts by tens of percent between runs: a fixed matmul shows its mood.
    a, b = torch.randn(STEP_BATCH, 64), torch.randn(64, 256)
    matmul_us = seconds_per_call({"mm": lambda: a @ b})["mm"] * 1e6
    print(
        f"\nmachine speed check: [{STEP_BATCH}, 64] @ [64, 256] float32 matmul {matmul_us:.0f} us"
        f"\ndetectors at default size, float32, 1 thread; training chunks of {TRAIN_BATCH} x {TRAIN_EVENTS} "
        f"events (forward + backward); state bytes = codec record per account (tensor payload)."
    )
    print(_table(results))
    print(
        "spread: slowest over fastest step across the histories; flat = within 10% for the\n"
        "LSTM and the linear Transformer, and for the Transformer no dearer after 100,000 events than after\n"
        "1,000 (its state stops growing at its window)."
    )
    return results


if __name__ == "__main__":
    run_model_bench(sys.argv[1:] or None)
