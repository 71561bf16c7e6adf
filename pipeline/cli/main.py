"""`txsentinel` command line: parses arguments into configs and calls plain functions.

Each command imports what it runs inside its own function, on purpose: at the top, `txsentinel serve` would
also load Lightning for training (measured: as long again as the service's own imports, which take
seconds), `--help` would wait for every command's imports, and `bench` could not pin the process to one core
before polars sizes its thread pool (polars does so when it is imported). Only modules that import none of
torch, polars, Lightning, MLflow or Kafka are imported at the top.
"""

import argparse
import logging
import sys
from dataclasses import replace
from datetime import date
from pathlib import Path

from consumers.runtime.settings import load_serve_config, parse_settings
from pipeline.bench.cores import pin_to_one_core


def _generate(args: argparse.Namespace) -> int:
    from pipeline.cli.commands import run_generate
    from pipeline.data.generate import GenerateConfig

    cfg = GenerateConfig(accounts=args.accounts, days=args.days, seed=args.seed, start_date=args.start_date)
    run_generate(cfg, args.out)
    return 0


def _ingest(args: argparse.Namespace) -> int:
    from pipeline.data.ingest import IngestConfig, IngestError, ingest
    from pipeline.data.mapping import MappingError

    cfg = IngestConfig(
        input=args.input,
        mapping=args.mapping,
        out=args.out,
        on_invalid=args.on_invalid,
        label_delay_days=args.label_delay_days,
    )
    try:
        report = ingest(cfg)
    except (IngestError, MappingError) as error:
        print(error, file=sys.stderr)
        return 1
    print(report.format())
    return 0


def _features(args: argparse.Namespace) -> int:
    from pipeline.cli.commands import run_features

    run_features(args.data, args.out)
    return 0


def _train(args: argparse.Namespace) -> int:
    from pipeline.training.config import load_train_config
    from pipeline.training.train import train

    cfg = load_train_config(
        args.data,
        args.config,
        args.set or [],
        model=args.model,
        train_period=args.train_period,
        test_period=args.test_period,
        accelerator=args.accelerator,
        devices=args.devices,
    )
    train(cfg)
    return 0


def _promote(args: argparse.Namespace) -> int:
    from pipeline.registry.tracking import promote

    version = promote(args.alias, args.model_name, run_id=args.run_id, version=args.version)
    print(f"{args.model_name}@{args.alias} -> version {version}")
    return 0


def _add_serve_settings(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bootstrap-servers", default="127.0.0.1:39092", help="Kafka bootstrap (default: project's)"
    )
    p.add_argument("--group-id", default=None, help="the scoring consumer group (default from the config)")
    p.add_argument(
        "--config", type=Path, default=None, help="YAML of the serve settings that differ from the defaults"
    )
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a setting (repeatable)")


def _serve_config(args: argparse.Namespace):
    """The serve settings of `serve` and `terminal-writer`: the YAML, then --group-id and --set; and logging."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    overrides = parse_settings(args.set)
    if args.group_id:
        overrides["group_id"] = args.group_id
    return load_serve_config(args.config, overrides)


def _serve(args: argparse.Namespace) -> int:
    from consumers.service.loop import serve

    stats = serve(_serve_config(args), args.model, args.bootstrap_servers)
    print(f"serve stopped: {stats}")
    return 0


def _terminal_writer(args: argparse.Namespace) -> int:
    from consumers.terminals.writer import run_writer

    stats = run_writer(_serve_config(args), args.bootstrap_servers)
    print(f"terminal writer stopped: {stats}")
    return 0


def _backtest(args: argparse.Namespace) -> int:
    from pipeline.data.splits import Period
    from pipeline.evaluation.backtest import BacktestConfig, backtest

    backtest(
        BacktestConfig(
            data=args.data,
            model_uri=args.model,
            test_period=Period.parse(args.test_period) if args.test_period else None,
            folds=args.folds,
            k=args.k,
            out=args.out,
            log_to_mlflow=not args.no_mlflow,
        )
    )
    if args.out is not None:
        print(f"report written to {args.out}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from pipeline.evaluation.compare import compare

    compare(experiment=args.experiment, metric=args.metric, out=args.out, data=args.data)
    return 0


def _bench(args: argparse.Namespace) -> int:
    # The stream bench pins its service and raw loop and keeps itself off them; the quality bench trains as a
    # user would, on every core.
    if args.bench not in ("stream", "quality"):
        pin_to_one_core()
    if args.bench == "features":
        from pipeline.bench.features import run_feature_bench

        run_feature_bench(events=args.events, batch_events=args.batch_events, seed=args.seed)
    elif args.bench == "stream":
        from pipeline.bench.stream import main as run_stream_bench

        argv = ["--events", str(args.events), "--max-poll-records", str(args.max_poll_records)]
        argv += ["--detectors", *args.models] if args.models else []
        argv += [f"--model={uri}" for uri in args.model or []]
        argv += [f"--set={item}" for item in args.set or []]
        argv += ["--phase-log", str(args.phase_log)] if args.phase_log else []
        return run_stream_bench(argv)
    elif args.bench == "replay":
        from pipeline.bench.features import run_replay_bench

        run_replay_bench(
            args.events, args.models or ["lstm", "linear_transformer"], args.batch_events, args.seed
        )
    elif args.bench == "quality":
        from pipeline.bench.quality import QUICK_DATA, QualityConfig, print_table, run_quality
        from pipeline.data.generate import GenerateConfig

        sizes = {k: v for k, v in (("accounts", args.accounts), ("days", args.days)) if v is not None}
        values = {
            "data": args.data,
            "generate": replace(QUICK_DATA if args.quick else GenerateConfig(), seed=args.seed, **sizes),
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
    elif args.bench == "reasons":
        from pipeline.bench.reasons import run_reasons_bench

        run_reasons_bench(args.data, args.model, args.alert_share, args.batch_events)
    else:
        from pipeline.bench.models import run_model_bench

        run_model_bench(args.models or None)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from pipeline.cli.demo import DemoConfig, run_demo

    return run_demo(DemoConfig(accounts=args.accounts, days=args.days, seed=args.seed, workdir=args.workdir))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="txsentinel",
        description="Fraud and anomaly detection on transaction streams: sequence detectors trained in "
        "parallel, served one event at a time from Kafka.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="write a synthetic dataset with known fraud")
    p.add_argument("--out", type=Path, required=True, help="dataset directory to write")
    p.add_argument("--accounts", type=int, default=5000, help="number of accounts (default 5000)")
    p.add_argument("--days", type=int, default=180, help="days of history (default 180)")
    p.add_argument("--seed", type=int, default=0, help="random seed; same seed, same dataset (default 0)")
    p.add_argument("--start-date", type=date.fromisoformat, default=date(2026, 1, 1), help="first day, ISO")
    p.set_defaults(run=_generate)

    p = sub.add_parser("ingest", help="map a CSV / Parquet / NDJSON file onto the canonical schema")
    p.add_argument("input", type=Path, help="input file (.csv, .parquet, .ndjson/.jsonl)")
    p.add_argument("--mapping", type=Path, required=True, help="mapping YAML (examples in configs/data/)")
    p.add_argument("--out", type=Path, required=True, help="dataset directory to write")
    p.add_argument(
        "--on-invalid",
        choices=("fail", "quarantine"),
        default="fail",
        help="fail: write nothing and list every problem (default); quarantine: keep good rows, "
        "write bad ones with reasons to DATASET_DIR/quarantine.parquet",
    )
    p.add_argument(
        "--label-delay-days",
        type=float,
        default=7.0,
        help="when the input has is_fraud but no label_ts: label_ts = ts + this many days (default 7)",
    )
    p.set_defaults(run=_ingest)

    p = sub.add_parser("features", help="compute per-event features of a dataset and summarise them")
    p.add_argument("--data", type=Path, required=True, help="dataset directory")
    p.add_argument("--out", type=Path, default=None, help="write the feature table to this Parquet file")
    p.set_defaults(run=_features)

    p = sub.add_parser("train", help="train a detector or baseline, test it, track it in MLflow")
    p.add_argument("--data", type=Path, required=True, help="dataset directory")
    p.add_argument(
        "--model",
        default=None,
        help="lstm | transformer | linear_transformer | logreg | random_forest | hist_gbdt | isolation_forest "
        "(default linear_transformer)",
    )
    p.add_argument("--config", type=Path, default=None, help="YAML of train settings (configs/train/*.yaml)")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a setting, e.g. --set max_epochs=3 --set model_config.d_model=32 (repeatable)",
    )
    p.add_argument("--train-period", default=None, help="START:END ISO dates, end exclusive")
    p.add_argument("--test-period", default=None, help="START:END ISO dates, end exclusive")
    p.add_argument("--accelerator", default=None, help="cpu (default) | gpu")
    p.add_argument("--devices", type=int, default=None, help="GPUs to use; > 1 trains with DDP")
    p.set_defaults(run=_train)

    p = sub.add_parser("promote", help="point a registered-model alias (e.g. champion) at a version")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--run",
        dest="run_id",  # not "run": set_defaults(run=...) holds the command's function
        default=None,
        help="the training run whose registered version to promote",
    )
    which.add_argument("--version", type=int, default=None, help="the model version to promote")
    p.add_argument("--alias", default="champion")
    p.add_argument("--model-name", default="txsentinel", help="registered model name (default txsentinel)")
    p.set_defaults(run=_promote)

    p = sub.add_parser("serve", help="score a Kafka stream: one member of the scoring consumer group")
    p.add_argument(
        "--model", required=True, help="models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN/model or a dir"
    )
    _add_serve_settings(p)
    p.set_defaults(run=_serve)

    p = sub.add_parser(
        "terminal-writer",
        help="the terminal-risk table's one writer, in its own process (serve with terminal_table_writer=external)",
    )
    _add_serve_settings(p)
    p.set_defaults(run=_terminal_writer)

    p = sub.add_parser("backtest", help="replay history through the live scorer and report with the protocol")
    p.add_argument("--data", type=Path, required=True, help="dataset directory")
    p.add_argument(
        "--model", required=True, help="models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN/model or a dir"
    )
    p.add_argument(
        "--test-period", default=None, help="START:END ISO dates, end exclusive (default: last 14 days)"
    )
    p.add_argument("--folds", type=int, default=1, help="prequential folds, shifted back by the test length")
    p.add_argument("--k", type=int, default=100, help="k of Card Precision@k (default 100)")
    p.add_argument("--out", type=Path, default=None, help="write JSON, CSV and plots here")
    p.add_argument("--no-mlflow", action="store_true", help="do not log the results to MLflow")
    p.set_defaults(run=_backtest)

    p = sub.add_parser("compare", help="one table and plots of the runs in an MLflow experiment")
    p.add_argument("--experiment", default="txsentinel")
    p.add_argument("--metric", default="test/ap", help="MLflow metric to sort by (default test/ap)")
    p.add_argument("--out", type=Path, default=None, help="write the table and plots here")
    p.add_argument(
        "--data", type=Path, default=None, help="dataset, for known-fraud exclusions in CP@k plots"
    )
    p.set_defaults(run=_compare)

    p = sub.add_parser("bench", help="benchmarks that print a table")
    bench = p.add_subparsers(dest="bench", required=True, metavar="WHAT")
    b = bench.add_parser("features", help="batch and streaming featurizer throughput on one core")
    b.add_argument("--events", type=int, default=1_000_000, help="events to featurize (default 1M)")
    b.add_argument("--batch-events", type=int, default=500, help="stream micro-batch size (default 500)")
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(run=_bench)
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
    b.set_defaults(run=_bench)
    b = bench.add_parser("replay", help="history replayed through the live scorer (the backtest path)")
    b.add_argument("models", nargs="*", help="detectors (default: lstm linear_transformer)")
    b.add_argument("--events", type=int, default=1_000_000)
    b.add_argument("--batch-events", type=int, default=500)
    b.add_argument("--seed", type=int, default=3)
    b.set_defaults(run=_bench)
    b = bench.add_parser("quality", help="every detector and baseline on one dataset, published protocol")
    b.add_argument("--data", type=Path, default=None, help="dataset directory (default: generate one)")
    b.add_argument("--accounts", type=int, default=None, help="accounts to generate (default 5000)")
    b.add_argument("--days", type=int, default=None, help="days to generate (default 180)")
    b.add_argument("--seed", type=int, default=0, help="the generated dataset's seed (default 0)")
    b.add_argument(
        "--models", nargs="+", default=None, help="models to train (default: 3 detectors, 3 baselines)"
    )
    b.add_argument("--seeds", type=int, default=None, help="training seeds per detector (default 3)")
    b.add_argument("--folds", type=int, default=1, help="prequential test weeks (default 1)")
    b.add_argument("--config", type=Path, default=None, help="a training profile YAML for every model")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a training setting")
    b.add_argument("--quick", action="store_true", help="a CI-sized run: small data and detectors, 1 seed")
    b.add_argument("--out", type=Path, default=Path("runs/bench-quality"), help="dataset, runs, quality.json")
    b.set_defaults(run=_bench)
    b = bench.add_parser("reasons", help="alerts' top reasons per fraud scenario, and their cost")
    b.add_argument("--data", type=Path, required=True, help="a generated dataset directory")
    b.add_argument(
        "--model", required=True, help="models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN/model or a dir"
    )
    b.add_argument("--alert-share", type=float, default=0.01, help="share of events alerted in the cost run")
    b.add_argument("--batch-events", type=int, default=500)
    b.set_defaults(run=_bench)
    b = bench.add_parser("models", help="detector training/serving cost, state size, step time vs history")
    b.add_argument("models", nargs="*", help="detectors to bench (default: all)")
    b.set_defaults(run=_bench)

    p = sub.add_parser("demo", help="the main job end to end on embedded defaults (what `make demo` runs)")
    p.add_argument("--accounts", type=int, default=800)
    p.add_argument("--days", type=int, default=90)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--workdir", type=Path, default=Path("runs/demo"), help="where datasets and outputs go")
    p.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as error:
        # Bad input from the user: say what and where, without a traceback.
        print(f"txsentinel {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
