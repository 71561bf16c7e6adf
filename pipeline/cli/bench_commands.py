"""`txsentinel bench ...`: the benchmarks that print a table, each importing what it runs when it runs (the
stream bench pins its processes, and the others pin themselves to one core before polars sizes its pool)."""

import argparse
from dataclasses import replace
from pathlib import Path

import configs
from pipeline.bench.cores import pin_to_one_core
from pipeline.cli.errors import check_output, model_errors


def run_bench(args: argparse.Namespace) -> int:
    # The stream bench pins its service and raw loop and keeps itself off them; the quality bench trains as a
    # user would, on every core.
    if args.bench not in ("stream", "quality"):
        pin_to_one_core()
    if args.bench == "features":
        from pipeline.bench.features import run_feature_bench

        run_feature_bench(args.events, args.batch_events, args.seed, terminals=args.terminals)
    elif args.bench == "stream":
        from pipeline.bench.stream import main as run_stream_bench

        argv = ["--events", str(args.events), "--max-poll-records", str(args.max_poll_records)]
        argv += ["--detectors", *args.models] if args.models else []
        argv += [f"--model={uri}" for uri in args.model or []]
        argv += [f"--set={item}" for item in args.set or []]
        argv += ["--phase-log", str(args.phase_log)] if args.phase_log else []
        argv += ["--shadow"] if args.shadow else []
        return run_stream_bench(argv, load_model=_load_naming_the_uri)
    elif args.bench == "replay":
        from pipeline.bench.features import run_replay_bench

        run_replay_bench(
            args.events, args.models or ["lstm", "linear_transformer"], args.batch_events, args.seed
        )
    elif args.bench == "quality":
        from pipeline.bench.quality import QUICK_DATA, QualityConfig, print_table, run_quality
        from pipeline.data.generate import GenerateConfig

        check_output(args.out, "--out")
        sizes = {k: v for k, v in (("accounts", args.accounts), ("days", args.days)) if v is not None}
        world = QUICK_DATA if args.quick else GenerateConfig()
        world = world if args.world is None else world.with_file(args.world)
        values = {
            "data": args.data,
            "generate": replace(world, seed=args.seed, **sizes),
            "folds": args.folds,
            "train_config": args.config,
            "out": args.out,
        }
        values.update({k: v for k, v in (("models", args.models), ("seeds", args.seeds)) if v})
        if args.set:
            values["overrides"] = tuple(args.set)
        cfg = QualityConfig.quick(**values) if args.quick else QualityConfig(**values)
        table, _ = run_quality(cfg)
        print_table(table, cfg)
    elif args.bench == "restore":
        from pipeline.bench.broker import project_broker
        from pipeline.bench.restore import RestoreBenchConfig, format_table, run_restore_bench

        cfg = RestoreBenchConfig(
            accounts=args.accounts,
            scales=tuple(args.scales),
            detectors=tuple(args.models) or RestoreBenchConfig.detectors,
        )
        with project_broker() as bootstrap:
            print(format_table(run_restore_bench(cfg, bootstrap)))
    elif args.bench == "trees":
        from pipeline.bench.tree_head import print_tree_table, run_tree_bench

        with model_errors(args.model):  # the benches only read the model from the store
            print_tree_table(run_tree_bench(args.data, args.model, args.test_days))
    elif args.bench == "reasons":
        from pipeline.bench.reasons import run_reasons_bench

        with model_errors(args.model):
            run_reasons_bench(args.data, args.model, args.alert_share, args.batch_events)
    else:
        from pipeline.bench.models import run_model_bench

        run_model_bench(args.models or None)
    return 0


def _load_naming_the_uri(uri: str):
    from pipeline.registry.tracking import load_model

    with model_errors(uri):
        return load_model(uri)


def add_bench_commands(sub) -> argparse._SubParsersAction:
    """The `bench` command and its subcommands under `sub`; returns them (for flags every command takes)."""
    p = sub.add_parser("bench", help="benchmarks that print a table")
    bench = p.add_subparsers(dest="bench", required=True, metavar="WHAT")
    b = bench.add_parser("features", help="batch and streaming featurizer throughput on one core")
    b.add_argument("--events", type=int, default=1_000_000, help="events to featurize (default 1M)")
    b.add_argument("--batch-events", type=int, default=500, help="stream micro-batch size (default 500)")
    b.add_argument(
        "--terminals",
        type=int,
        default=1_000_000,
        help="terminals a table holds when the cap lets a tenth go, and ids hashed (default 1M)",
    )
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(run=run_bench)
    b = bench.add_parser("stream", help="the service end to end on the project's broker vs the raw client")
    b.add_argument(
        "models",
        nargs="*",
        help="untrained detectors (default: lstm linear_transformer, unless --model is given)",
    )
    b.add_argument(
        "--model",
        action="append",
        metavar="MODEL_URI",
        help="a trained model: models:/NAME@ALIAS, runs:/RUN_ID/model or a directory (repeatable)",
    )
    b.add_argument("--events", type=int, default=50_000)
    b.add_argument(
        "--max-poll-records",
        type=int,
        default=500,
        help="the service's and the raw loop's poll size (default 500)",
    )
    b.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="a serve setting for the service (repeatable)"
    )
    b.add_argument(
        "--phase-log",
        type=Path,
        metavar="DIR",
        help="write each service run's per-batch log (events, phase and commit seconds) into DIR",
    )
    b.add_argument(
        "--shadow",
        action="store_true",
        help="also bench each model with a shadow challenger (an untrained detector of its type), a row each",
    )
    b.set_defaults(run=run_bench)
    b = bench.add_parser("replay", help="history replayed through the live scorer (the backtest path)")
    b.add_argument("models", nargs="*", help="detectors (default: lstm linear_transformer)")
    b.add_argument("--events", type=int, default=1_000_000)
    b.add_argument("--batch-events", type=int, default=500)
    b.add_argument("--seed", type=int, default=3)
    b.set_defaults(run=run_bench)
    b = bench.add_parser("quality", help="every detector and baseline on one dataset, published protocol")
    b.add_argument("--data", type=Path, default=None, help="dataset directory (default: generate one)")
    b.add_argument("--accounts", type=int, default=None, help="accounts to generate (default 5000)")
    b.add_argument("--days", type=int, default=None, help="days to generate (default 180)")
    b.add_argument("--seed", type=int, default=0, help="the generated dataset's seed (default 0)")
    b.add_argument(
        "--world", **configs.option("generate", "generator settings of the generated dataset, a YAML")
    )
    b.add_argument(
        "--models", nargs="+", default=None, help="models to train (default: 3 detectors, 3 baselines)"
    )
    b.add_argument("--seeds", type=int, default=None, help="training seeds per detector (default 3)")
    b.add_argument("--folds", type=int, default=1, help="prequential test weeks (default 1)")
    b.add_argument("--config", **configs.option("train", "a training profile YAML for every model"))
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a training setting")
    b.add_argument("--quick", action="store_true", help="a CI-sized run: small data and detectors, 1 seed")
    b.add_argument("--out", type=Path, default=Path("runs/bench-quality"), help="dataset, runs, quality.json")
    b.set_defaults(run=run_bench)
    b = bench.add_parser("restore", help="restore time and memory of N account states from a real changelog")
    b.add_argument("models", nargs="*", help="detectors to bench (default: all)")
    b.add_argument("--accounts", type=int, default=1_000_000, help="account records in each changelog")
    b.add_argument(
        "--scales", type=int, nargs="+", default=[100_000, 300_000, 1_000_000], help="accounts restored"
    )
    b.set_defaults(run=run_bench)
    b = bench.add_parser("reasons", help="alerts' top reasons per fraud scenario, and their cost")
    b.add_argument("--data", type=Path, required=True, help="a generated dataset directory")
    b.add_argument(
        "--model", required=True, help="models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN/model or a dir"
    )
    b.add_argument("--alert-share", type=float, default=0.01, help="share of events alerted in the cost run")
    b.add_argument("--batch-events", type=int, default=500)
    b.set_defaults(run=run_bench)
    b = bench.add_parser("trees", help="the hybrid's tree recipes over one trained detector's scores")
    b.add_argument("--data", type=Path, required=True, help="the dataset the detector was trained on")
    b.add_argument(
        "--model", required=True, help="models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN/model or a dir"
    )
    b.add_argument("--test-days", type=int, default=7, help="the test week's days, as it was trained (7)")
    b.set_defaults(run=run_bench)
    b = bench.add_parser("models", help="detector training/serving cost, state size, step time vs history")
    b.add_argument("models", nargs="*", help="detectors to bench (default: all)")
    b.set_defaults(run=run_bench)

    return bench
