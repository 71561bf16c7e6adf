"""The GPU path, checked and timed: `scripts/gpu_check.sh` (or `python -m pipeline.bench.gpu_check`).

For every registered detector at its default size, on the GPU:
- serving == training in float32 (step-by-step vs forward, chunked-with-state vs whole), max |diff|, with
  TF32 off; and step vs forward again under torch's defaults, where cuDNN may use TF32 (LSTM forward);
- bf16 autocast forward vs float32 forward, max |diff| of the logits;
- training with the real LightningModule and data module (bf16-mixed, chunks with the state carried):
  sequences/s (account chunks) and events/s;
- micro-batched serving: step events/s over 4,096 accounts.
Prints one table. Needs only torch, pytorch-lightning, numpy and scikit-learn (no polars, MLflow or Kafka),
so it runs on a bare GPU machine from a copy of the repository. `--device cpu --quick` runs the same code
small, which is how the test suite keeps it from rotting.
"""

import argparse
import time
from contextlib import contextmanager

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

from models.contract import RecurrentDetector
from models.parity import forward_in_chunks, random_events, step_vs_forward_error
from models.registry import REGISTRY, build_detector
from pipeline.features import FEATURE_NAMES
from pipeline.training.datamodule import HistoryDataModule, Window
from pipeline.training.diagnostics import step_cost_us_per_event
from pipeline.training.module import DetectorModule
from pipeline.training.sequences import AccountSequences

NUM_FEATURES = len(FEATURE_NAMES)


@contextmanager
def tf32(allowed: bool):
    """cuDNN's and cuBLAS's TF32 switches for the block (torch's defaults: cuDNN on, cuBLAS off)."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


@torch.inference_mode()
def parity(detector: RecurrentDetector, events: int) -> tuple[float, float, float, float]:
    """Max |logit difference| on [8, events]: (step vs forward, chunked vs whole) in IEEE float32, step vs
    forward under torch's default TF32 settings, and bf16 autocast vs float32."""
    x = random_events(detector, 8, events)
    with tf32(allowed=False):
        whole, _ = detector(x)
        step_error = step_vs_forward_error(detector, x)
        chunked, _ = forward_in_chunks(detector, x, 256)
        chunk_error = float((whole - chunked).abs().max())
    step_error_defaults = step_vs_forward_error(detector, x)
    bf16_error = float("nan")
    if x.device.type != "cpu":
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            low, _ = detector(x)
        bf16_error = float((whole - low.float()).abs().max())
    return step_error, chunk_error, step_error_defaults, bf16_error


def _synthetic_sequences(accounts: int, events: int, seed: int = 0) -> AccountSequences:
    rng = np.random.default_rng(seed)
    n = accounts * events
    return AccountSequences(
        account_ids=np.array([f"A{i}" for i in range(accounts)]),
        offsets=np.arange(0, n + 1, events, dtype=np.int64),
        x=rng.standard_normal((n, NUM_FEATURES), dtype=np.float32),
        terminal_bucket=rng.integers(0, 4096, n),
        ts_us=np.tile(np.arange(events, dtype=np.int64) * 60_000_000, accounts),
        event_ids=np.arange(n).astype(str),
        target=(rng.random(n) < 0.01).astype(np.float32),
        is_fraud=rng.random(n) < 0.01,
    )


def train_throughput(
    name: str, device: str, accounts: int, events: int, chunk: int, steps: int
) -> tuple[float, float]:
    """(sequences/s, events/s) of `steps` Lightning training steps, after 3 warm-up steps."""
    seqs = _synthetic_sequences(accounts, events)
    everything = Window(0, int(seqs.ts_us.max()) + 1)
    data = HistoryDataModule(
        train=(seqs, everything),
        validation=(seqs, everything),
        test=None,
        batch_accounts=256,
        chunk_events=chunk,
    )
    module = DetectorModule(
        build_detector(name, {"num_features": NUM_FEATURES}),
        learning_rate=1e-3,
        weight_decay=0.01,
        warmup_steps=2,
        pos_weight=10.0,
        num_events={"val": len(seqs.x)},
    )
    times: list[float] = []

    class Clock(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter())

    on_gpu = device != "cpu"
    trainer = pl.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=1,
        precision="bf16-mixed" if on_gpu else "32-true",
        max_steps=steps + 3,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[Clock()],
    )
    trainer.fit(module, datamodule=data)
    if on_gpu:
        torch.cuda.synchronize()
    times.append(time.perf_counter())
    elapsed = times[-1] - times[3]
    timed_steps = len(times) - 4
    sequences = min(256, accounts) * timed_steps  # account chunks of `chunk` events each
    return sequences / elapsed, sequences * chunk / elapsed


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run on CPU")
    args = parser.parse_args(argv)
    device = args.device
    if device != "cpu" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible to torch; run on a GPU machine or pass --device cpu --quick")
    sizes = (
        {
            "parity_events": 64,
            "accounts": 16,
            "events": 64,
            "chunk": 32,
            "steps": 2,
            "step_batch": 64,
            "step_seconds": 0.1,
        }
        if args.quick
        else {
            "parity_events": 2048,
            "accounts": 4096,
            "events": 1024,
            "chunk": 256,
            "steps": 30,
            "step_batch": 4096,
            "step_seconds": 2.0,
        }
    )
    gpu = torch.cuda.get_device_name() if device != "cpu" else "cpu"
    print(f"device: {gpu}; torch {torch.__version__}")
    results = {}
    for name in sorted(REGISTRY):
        torch.manual_seed(0)
        detector = build_detector(name, {"num_features": NUM_FEATURES}).to(device).eval()
        step_err, chunk_err, step_err_tf32, bf16_err = parity(detector, sizes["parity_events"])
        seq_s, ev_s = train_throughput(
            name, device, sizes["accounts"], sizes["events"], sizes["chunk"], sizes["steps"]
        )
        results[name] = {
            "step_vs_forward": step_err,
            "chunked_vs_whole": chunk_err,
            "step_vs_forward_torch_defaults": step_err_tf32,
            "bf16_vs_fp32": bf16_err,
            "train_sequences_per_s": seq_s,
            "train_events_per_s": ev_s,
            "step_events_per_s": 1e6
            / step_cost_us_per_event(detector.to(device), sizes["step_batch"], sizes["step_seconds"]),
        }
    columns = [  # (heading, result key, format)
        ("step=fwd", "step_vs_forward", ".1e"),
        ("chunk=whole", "chunked_vs_whole", ".1e"),
        ("step=fwd tf32", "step_vs_forward_torch_defaults", ".1e"),
        ("bf16-fp32", "bf16_vs_fp32", ".1e"),
        ("train seq/s", "train_sequences_per_s", ",.0f"),
        ("train ev/s", "train_events_per_s", ",.0f"),
        ("step ev/s", "step_events_per_s", ",.0f"),
    ]
    print(f"{'detector':20s}" + "".join(f" {heading:>13s}" for heading, _, _ in columns))
    for name, r in results.items():
        print(f"{name:20s}" + "".join(f" {r[key]:>13{spec}}" for _, key, spec in columns))
    return results


if __name__ == "__main__":
    main()
