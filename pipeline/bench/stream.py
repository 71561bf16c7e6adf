"""Streaming benchmark: the scoring service end to end against the raw kafka-python ceiling, on the real broker.

For one model (`run_stream_bench`), all in one run on the same machine:
  (0)  warm-up: a discarded raw run over up to 20k events, so that neither loop pays the broker's JIT.
  (i)  the service: `consumers.service.loop.serve` in a subprocess pinned to ONE core (os.sched_setaffinity),
       started on a topic that already holds the N generated events (a backlog). Events/s = scores / (last -
       first score record timestamp).
  (ii) raw ceiling: a subprocess pinned to the same core runs a plain consume -> produce loop with
       kafka-python over the same backlog, shaped like the service (same group consumer settings and
       max_poll_records, one transactional producer, every record re-sent to an output topic at its input
       partition number, as the service sends scores, send_offsets_to_transaction + commit per poll). Rate =
       records / (last - first output record timestamp). It runs right before and right after (i), and the
       ceiling is the mean of the two ("raw drift": how far the second moved from the first).
  (iii) the service again, fed at about half its measured rate (a rate-limited producer, 10 ms slices): the
       operating latency = score record timestamp - input record timestamp (both Kafka CreateTime, ms; the
       score's is taken at its send inside the transaction, before the commit that makes it visible, which
       returns behind the next batch). Its p99 is also given without the first 10% of the events (the
       stream's start: first transactions). "busy @half": the share of that run's span the service's main
       thread spent on batches (its own txsentinel_batch_seconds: decode, score, encode, send; scraped from
       /metrics). Well above 50% means the VM slowed down after (i), so the run was not at half load.
  (iv) the raw loop fed at the same rate, with the same latency measure (its output record's timestamp is
       taken at its send): what kafka-python's transactions and the broker take on their own at that rate,
       with nothing scored. The raw loop commits in line (poll, send, commit, poll ...), where the service
       scores the next batch while a commit runs.
The harness itself keeps off the measured core (so does a broker it starts), and reads the outputs only
once a loop has finished: while one runs, only the broker (and in (iii) and (iv) the rate-limited producer)
runs beside it.

Run: `python -m pipeline.bench.stream [--events N] [--detectors lstm ...] [--model URI ...] [--shadow]`;
`--detectors` are untrained, default-size detectors (threshold at a 1% alert rate), `--model` any model the
service loads (`models:/txsentinel@champion`, `runs:/...`, a directory), with its own threshold. `--shadow`
benches each model twice, alone and with a shadow challenger (serve --shadow: an untrained default-size
detector of the same type, other weights), a row each. The broker is the project's (scripts/kafka.sh): reused
if it is up, otherwise started and stopped again at the end.

Run with `python -m`, this module is imported again by each spawned child (multiprocessing re-imports the
main module) before the child pins its core: like stream_harness, it imports no polars, torch or MLflow at
the top, and the three functions that need them import them inside.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import signal
import tempfile
import uuid
from pathlib import Path

import numpy as np

from consumers.runtime.metrics import free_port, scrape
from consumers.runtime.settings import load_serve_config, parse_settings
from pipeline.bench.broker import kafka_port, port_open, project_broker
from pipeline.bench.stream_harness import (
    create_topic,
    default_core,
    delete_prefix,
    generated_events,
    keep_off,
    log_prefix,
    produce,
    raw_child,
    read_timestamps,
    service_child,
    wait_owned,
    wait_scored,
)
from pipeline.bench.stream_models import build_default_model


def _service_run(ctx, bootstrap, model_dir, msgs, overrides, core, rate, timeout_s, phase_log=None) -> dict:
    """The service over `topic_prefix`transactions: a backlog of `msgs` already there (rate None), or fed at
    `rate` events/s once it has joined its group. `phase_log`: a file for its per-batch log (service_child)."""
    prefix = overrides["topic_prefix"]
    produced_rate = None
    port = free_port()
    overrides = {**overrides, "metrics_host": "127.0.0.1", "metrics_port": port}
    args = (overrides, model_dir, bootstrap, core, None if phase_log is None else str(phase_log))
    proc = ctx.Process(target=service_child, args=args, daemon=True)
    proc.start()
    try:
        wait_owned(bootstrap, overrides["group_id"], proc)
        if rate is not None:
            produced_rate = produce(bootstrap, prefix + "transactions", msgs, rate)
        wait_scored(port, len(msgs), proc, timeout_s)  # nothing of the harness runs beside the service
        scores, seen = read_timestamps(bootstrap, prefix + "scores", len(msgs), timeout_s, proc=proc)
        inputs = _input_times(bootstrap, prefix + "transactions", len(msgs), timeout_s, rate)
        busy_s = scrape(port, "txsentinel_batch_seconds_sum")  # main-thread time on batches
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)  # serve() finishes its batch and leaves the group
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    summary = _timing(scores, inputs)
    return {
        "events": len(msgs),
        "scores": seen,
        **summary,
        "producer_events_per_s": produced_rate,
        # The share of the scoring span the service spent inside batches: near 100% means saturated, which
        # a half-rate run must not be (its rate comes from the full-speed run, and the VM's pace drifts).
        "busy_share": busy_s / summary["span_s"],
    }


def _input_times(bootstrap: str, topic: str, count: int, timeout_s: float, rate: float | None) -> dict | None:
    """{event: input timestamp} of a run fed at `rate`, for its latency; None for a backlog, whose latency
    would be only its age."""
    return None if rate is None else read_timestamps(bootstrap, topic, count, timeout_s)[0]


def _timing(outputs: dict, inputs: dict | None = None) -> dict:
    """{event: output timestamp}, and {event: input timestamp} when latency is wanted (ms) -> the rate over
    the outputs' span, and the latency percentiles."""
    ts = np.array(sorted(outputs.values()), dtype=np.int64)
    span_s = max((ts[-1] - ts[0]) / 1000.0, 1e-3)
    rate = {"events_per_s": (len(ts) - 1) / span_s, "span_s": span_s}
    if inputs is None:
        return rate
    by_input_time = sorted(outputs, key=inputs.__getitem__)
    lat = np.array([outputs[e] - inputs[e] for e in by_input_time], dtype=np.float64)
    steady = lat[len(lat) // 10 :]  # without the stream's start (first transactions, fetch warm-up)
    return {
        **rate,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "p99_ms_after_first_10pct": float(np.percentile(steady, 99)),
        "max_ms": float(lat.max()),
    }


def _raw_run(
    ctx, bootstrap, prefix, msgs, partitions, max_poll_records, core, rate, timeout_s, run=""
) -> dict:
    """The raw loop over `msgs`: a backlog already in `prefix`transactions (rate None), or fed at `rate`
    events/s once it has joined its group (then its latency too: the client's floor at that rate). `run`
    names its output topic and group, so that several runs can read one backlog."""
    source, sink, group = prefix + "transactions", f"{prefix}raw-out{run}", f"{prefix}raw-group{run}"
    create_topic(bootstrap, sink, partitions)
    args = (bootstrap, source, sink, group, len(msgs), max_poll_records, core)
    proc = ctx.Process(target=raw_child, args=args, daemon=True)
    proc.start()
    try:
        if rate is not None:
            wait_owned(bootstrap, group, proc)
            produce(bootstrap, source, msgs, rate)
        proc.join(timeout_s)  # it exits once it has committed every record: read them afterwards
        if proc.exitcode != 0:
            raise RuntimeError(
                f"the raw loop did not finish within {timeout_s} s (exit code {proc.exitcode})"
            )
        out, seen = read_timestamps(bootstrap, sink, len(msgs), timeout_s)  # the values are the inputs
        inputs = _input_times(bootstrap, source, len(msgs), timeout_s, rate)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    return {"events": seen, **_timing(out, inputs)}


def _warm_up_broker(ctx, bootstrap, msgs, partitions, max_poll_records, core, timeout_s) -> None:
    """A discarded raw run over up to 20k events: a freshly started broker's JIT is still compiling the
    produce/fetch/transaction paths, and whichever loop ran first measured 30-50% slower for it."""
    prefix = f"bench-warm-{uuid.uuid4().hex[:8]}-"
    warm = msgs[:20_000]
    try:
        create_topic(bootstrap, prefix + "transactions", partitions)
        produce(bootstrap, prefix + "transactions", warm, None)
        _raw_run(ctx, bootstrap, prefix, warm, partitions, max_poll_records, core, None, timeout_s)
    finally:
        delete_prefix(bootstrap, prefix)


def run_stream_bench(
    model,
    bootstrap: str,
    events: int = 50_000,
    partitions: int = 3,
    max_poll_records: int = 500,
    half_rate_seconds: float = 20.0,
    core: int | None = -1,
    timeout_s: float = 600.0,
    settings: dict | None = None,
    phase_logs: Path | None = None,
    shadow: str | None = None,
) -> dict:
    """Benchmark one model (a LoadedModel or a model directory/URI loadable by the service) on `bootstrap`.

    core: the CPU the service and the raw loop are pinned to (-1: the highest allowed; None: no pinning).
    settings: serve settings for the service runs (e.g. {"max_states_in_memory": 300}); not the raw loop.
    phase_logs: a path stem; the service's runs write their per-batch logs to `<stem>.full.log` and
    `<stem>.half.log` (a line a batch: events, each phase's seconds, the commit's; epoch timestamps).
    shadow: a model (directory or URI) the service steps in shadow on every event (serve --shadow).
    Returns {"service": {...}, "raw": {...}, "half_rate": {...}, "raw_half_rate": {...}, "ratio": service/raw,
    ...}.
    """
    from pipeline.registry.artifact import LoadedModel, save_model_dir  # torch, polars (module docstring)

    core = default_core() if core == -1 else core
    ctx = mp.get_context("spawn")  # a clean interpreter per child: no forked Kafka threads or torch state
    with tempfile.TemporaryDirectory(prefix="bench-model-") as tmp:
        if isinstance(model, LoadedModel):
            model_dir = str(save_model_dir(Path(tmp) / "model", model.detector, model.spec, dict(model.meta)))
        else:
            model_dir = str(model)
        msgs, _ = generated_events(events)
        _warm_up_broker(ctx, bootstrap, msgs, partitions, max_poll_records, core, timeout_s)
        prefixes = [f"bench-{uuid.uuid4().hex[:8]}-{run}-" for run in ("full", "half", "raw-half")]
        base = {
            "max_poll_records": max_poll_records,
            "transactions_partitions": partitions,
            "poll_timeout_ms": 100,
            **(settings or {}),
            **({} if shadow is None else {"shadow_model_uri": shadow}),
        }

        def service(prefix: str, msgs: list, rate: float | None, run: str) -> dict:
            overrides = {**base, "topic_prefix": prefix, "group_id": prefix + "group"}
            log = None if phase_logs is None else phase_logs.with_name(f"{phase_logs.name}.{run}.log")
            return _service_run(ctx, bootstrap, model_dir, msgs, overrides, core, rate, timeout_s, log)

        def raw(prefix: str, msgs: list, rate: float | None, run: str = "") -> dict:
            args = (partitions, max_poll_records, core, rate, timeout_s, run)
            return _raw_run(ctx, bootstrap, prefix, msgs, *args)

        try:
            for prefix in prefixes:
                create_topic(bootstrap, prefix + "transactions", partitions)
            produce(bootstrap, prefixes[0] + "transactions", msgs, None)  # the backlog all three runs read
            # The ceiling brackets the service's run: this VM's pace drifts by up to 2x within minutes, and
            # one raw run after the service (as before) moved the ratio by as much.
            raw_before = raw(prefixes[0], msgs, None, "-before")
            full = service(prefixes[0], msgs, None, "full")
            raw_after = raw(prefixes[0], msgs, None, "-after")
            ceiling = (raw_before["events_per_s"] + raw_after["events_per_s"]) / 2
            rate = full["events_per_s"] / 2
            n_half = int(min(events, max(1000, rate * half_rate_seconds)))
            half = service(prefixes[1], msgs[:n_half], rate, "half")
            half["target_events_per_s"] = rate
            raw_half = raw(prefixes[2], msgs[:n_half], rate)  # the client's latency at the same rate
            raw_half["target_events_per_s"] = rate
        finally:
            for prefix in prefixes:
                delete_prefix(bootstrap, prefix)
    return {
        "service": full,
        "raw": {"events_per_s": ceiling, "before": raw_before, "after": raw_after},
        "half_rate": half,
        "raw_half_rate": raw_half,
        "ratio": full["events_per_s"] / ceiling,
        "pinned_core": core,
        "mode": "service and raw loop each in a spawned subprocess pinned to one core",
        "max_poll_records": max_poll_records,
        "partitions": partitions,
        "settings": settings or {},
        "shadow": shadow,
    }


def format_table(results: dict[str, dict]) -> str:
    """One row a model: throughput against the raw ceiling, then latency at half rate, the service's beside
    the raw loop's at the same rate (what the client and the broker alone take)."""
    width = max([20, *(len(name) + 2 for name in results)])
    head = (
        f"{'model':<{width}}{'service ev/s':>14}{'raw ceiling ev/s':>18}{'raw drift':>11}{'svc/ceiling':>13}"
        f"{'half-rate ev/s':>16}{'p50 / p99 ms @half':>20}{'raw p50 / p99 @half':>21}"
        f"{'p99 @half, 10% on':>19}{'busy @half':>12}"
    )
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        s, h, rh, ceiling = r["service"], r["half_rate"], r["raw_half_rate"], r["raw"]["events_per_s"]
        drift = (r["raw"]["after"]["events_per_s"] - r["raw"]["before"]["events_per_s"]) / ceiling
        lines.append(
            f"{name:<{width}}{s['events_per_s']:>14.0f}{ceiling:>18.0f}{100 * drift:>+10.0f}%"
            f"{100 * r['ratio']:>12.1f}%{h['events_per_s']:>16.0f}"
            f"{h['p50_ms']:>11.0f} / {h['p99_ms']:<6.0f}{rh['p50_ms']:>12.0f} / {rh['p99_ms']:<6.0f}"
            f"{h['p99_ms_after_first_10pct']:>19.0f}{100 * h['busy_share']:>11.0f}%"
        )
    return "\n".join(lines)


def _phase_log_stem(directory: Path | None, model_name: str) -> Path | None:
    """DIR/<model name as a file name> ("lstm models:/txsentinel@champion" -> "lstm_models_txsentinel_champion")."""
    if directory is None:
        return None
    return directory / re.sub(r"[^A-Za-z0-9_.-]+", "_", model_name).strip("_")


def _with_shadow(name: str, model, tmp: Path) -> list[tuple]:
    """(row name, model, shadow) of a model alone and with a shadow: an untrained detector of the same type
    at its default size, other weights (seed 1), its own threshold at a 1% alert rate. The same type, so the
    row's cost is a second step of that detector and a second state record of its size per changed account."""
    detector = name if isinstance(model, str) else model.name  # an untrained one's name, or a loaded model's
    shadow = build_default_model(detector, tmp / "shadow", seed=1, version=f"bench-{detector}-shadow")
    return [(name, model, None), (f"{name} + shadow", model, shadow)]


def main(argv: list[str] | None = None, load_model=None) -> int:
    """`load_model(uri) -> LoadedModel` resolves each --model (default: the registry's load_model; the CLI
    passes one that names a URI that does not resolve)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument(
        "--detectors",
        nargs="+",
        help="untrained detectors (default: lstm linear_transformer, unless --model)",
    )
    parser.add_argument(
        "--model", action="append", default=[], metavar="URI", help="a trained model (repeatable)"
    )
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--max-poll-records", type=int, default=500)
    parser.add_argument(
        "--shadow",
        action="store_true",
        help="also bench each model with a shadow challenger: an untrained default-size detector of its type",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="a serve setting (repeatable)")
    parser.add_argument(
        "--phase-log",
        type=Path,
        metavar="DIR",
        help="write each service run's per-batch log here (MODEL.full.log, MODEL.half.log)",
    )
    args = parser.parse_args(argv)
    if args.phase_log is not None:
        args.phase_log.mkdir(parents=True, exist_ok=True)
    settings = parse_settings(args.set)
    load_serve_config(config_file=None, overrides=settings, env={})  # a bad setting fails now, not in a child
    detectors = args.detectors or ([] if args.model else ["lstm", "linear_transformer"])
    # A URI is resolved once, here: a bad one fails before any broker work, and the children load a directory.
    if load_model is None:
        from pipeline.registry.tracking import load_model  # MLflow, torch (module docstring)
    trained = {uri: load_model(uri) for uri in args.model}
    core = default_core()
    already_up = port_open(kafka_port())
    keep_off(core)
    print(
        log_prefix,
        f"service and raw loop on core {core}; harness off it; broker "
        + ("already running (it may use any core)" if already_up else "started here, off that core"),
        flush=True,
    )
    results = {}
    with project_broker() as bootstrap, tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        models = {name: build_default_model(name, Path(tmp)) for name in detectors}
        models |= {f"{loaded.name} {uri}": loaded for uri, loaded in trained.items()}
        runs = [(name, model, None) for name, model in models.items()]
        if args.shadow:  # each model's row, then its row with a shadow beside it
            runs = [run for name, model, _ in runs for run in _with_shadow(name, model, Path(tmp))]
        for name, model, shadow in runs:
            print(log_prefix, f"{name}: {args.events} events on {bootstrap} ...", flush=True)
            results[name] = run_stream_bench(
                model, bootstrap, events=args.events, partitions=args.partitions,
                max_poll_records=args.max_poll_records, core=core, settings=settings,
                phase_logs=_phase_log_stem(args.phase_log, name), shadow=shadow,
            )  # fmt: skip
            print(log_prefix, json.dumps(results[name], default=float), flush=True)
    print(format_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
