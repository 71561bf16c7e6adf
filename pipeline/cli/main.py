"""`txsentinel` command line: parses arguments into configs and calls plain functions.

Each command imports what it runs inside its own function, on purpose: at the top, `txsentinel serve` would
also load Lightning for training (measured: as long again as the service's own imports, which take
seconds), `--help` would wait for every command's imports, and `bench` could not pin the process to one core
before polars sizes its thread pool (polars does so when it is imported). Only modules that import none of
torch, polars, Lightning, MLflow or Kafka are imported at the top.
"""

import argparse
import sys
import traceback
from dataclasses import replace
from datetime import date
from pathlib import Path

import configs
from consumers.runtime.settings import load_serve_config, parse_settings
from pipeline.cli.bench_commands import add_bench_commands
from pipeline.cli.errors import (
    EXIT_INPUT,
    EXIT_OUTSIDE,
    OperatorError,
    check_output,
    model_errors,
    tracking_errors,
)
from pipeline.cli.logs import add_logging_flags
from pipeline.cli.monitor import add_monitor_command
from pipeline.cli.serving import (
    add_live_compare_flags,
    add_serve_settings,
    run_live_compare,
    run_serve,
    run_terminal_writer,
)


def _generate(args: argparse.Namespace) -> int:
    from pipeline.cli.commands import run_generate
    from pipeline.data.dataset import check_output_dir
    from pipeline.data.generate import GenerateConfig

    check_output_dir(args.out)  # before any work: a file, a path under one, or a directory of other files
    # Defaults < the --config file < the flags given < --set.
    cfg = GenerateConfig() if args.config is None else GenerateConfig().with_file(args.config)
    flags = {"accounts": args.accounts, "days": args.days, "seed": args.seed, "start_date": args.start_date}
    cfg = replace(cfg, **{key: value for key, value in flags.items() if value is not None})
    run_generate(cfg.with_settings(args.set), args.out)
    return 0


def _ingest(args: argparse.Namespace) -> int:
    from pipeline.data.dataset import check_output_dir
    from pipeline.data.ingest import IngestConfig, IngestError, ingest
    from pipeline.data.mapping import MappingError

    check_output_dir(args.out)  # before any work: a file, a path under one, or a directory of other files
    cfg = IngestConfig(
        input=args.input,
        mapping=args.mapping,
        out=args.out,
        on_invalid=args.on_invalid,
        label_delay_days=args.label_delay_days,
    )
    try:
        report = ingest(cfg)
    except (IngestError, MappingError) as error:  # the input or the mapping: the operator's to fix
        print(error, file=sys.stderr)
        return EXIT_INPUT
    print(report.format())
    return 0


def _features(args: argparse.Namespace) -> int:
    from pipeline.cli.commands import run_features

    check_output(args.out, "--out", directory=False)
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
    check_output(cfg.out_dir, "out_dir")
    train(cfg)
    return 0


def _promote(args: argparse.Namespace) -> int:
    from pipeline.registry.tracking import promote

    version = promote(args.alias, args.model_name, run_id=args.run_id, version=args.version)
    print(f"{args.model_name}@{args.alias} -> version {version}")
    return 0


def _schemas(args: argparse.Namespace) -> int:
    from consumers.scoring.message_limits import MessageLimits
    from consumers.scoring.topic_schemas import write_schemas

    limits = MessageLimits.of(load_serve_config(args.config, parse_settings(args.set)))
    check_output(args.out, "--out")
    for path in write_schemas(args.out, limits):
        print(path)
    return 0


def _backtest(args: argparse.Namespace) -> int:
    from pipeline.data.splits import Period
    from pipeline.evaluation.backtest import BacktestConfig, backtest
    from pipeline.registry.tracking import load_model

    check_output(args.out, "--out")
    cfg = BacktestConfig(  # the flags are checked before the model is fetched
        data=args.data,
        model_uri=args.model,
        test_period=Period.parse(args.test_period) if args.test_period else None,
        folds=args.folds,
        k=args.k,
        out=args.out,
        log_to_mlflow=not args.no_mlflow,
    )
    with model_errors(args.model):
        model = load_model(args.model)
    backtest(cfg, model)
    if args.out is not None:
        print(f"report written to {args.out}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    if args.live:
        return run_live_compare(args)
    from pipeline.evaluation.compare import compare

    check_output(args.out, "--out")
    compare(
        experiment=args.experiment,
        metric=args.metric,
        out=args.out,
        data=args.data,
        log_to_mlflow=not args.no_mlflow,
    )
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
    p.add_argument("--accounts", type=int, help="number of accounts (default 5000)")
    p.add_argument("--days", type=int, help="days of history (default 180)")
    p.add_argument("--seed", type=int, help="random seed; same seed, same dataset (default 0)")
    p.add_argument("--start-date", type=date.fromisoformat, help="first day, ISO (default 2026-01-01)")
    p.add_argument(
        "--config", **configs.option("generate", "YAML of generator settings, applied before the flags")
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other generator setting (pipeline.data.world.GenerateConfig), e.g. --set "
        "takeover_accounts_per_day=0; repeatable, applied after the flags above",
    )
    p.set_defaults(run=_generate)

    p = sub.add_parser("ingest", help="map a CSV / Parquet / NDJSON file onto the canonical schema")
    p.add_argument("input", type=Path, help="input file (.csv, .parquet, .ndjson/.jsonl)")
    p.add_argument("--mapping", required=True, **configs.option("data", "mapping YAML"))
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
        help="when the input has is_fraud but no label_ts: label_ts = ts + this many days (default 7, at most "
        "3650)",
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
        help="lstm | transformer | linear_transformer | hybrid | logreg | random_forest | hist_gbdt | isolation_forest "
        "(default linear_transformer)",
    )
    p.add_argument("--config", **configs.option("train", "YAML of train settings"))
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
    add_logging_flags(p, always=False)

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
        "--model",
        default=None,
        help="models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN/model or a dir (or TXS_MODEL_URI)",
    )
    p.add_argument(
        "--shadow",
        default=None,
        help="a challenger scored in shadow on the same events, to shadow-scores, never alerting "
        "(or TXS_SHADOW_MODEL_URI)",
    )
    add_serve_settings(p)
    p.set_defaults(run=run_serve)
    add_logging_flags(p, always=True)

    p = sub.add_parser(
        "terminal-writer",
        help="the terminal-risk table's one writer, in its own process (serve with terminal_table_writer=external)",
    )
    add_serve_settings(p)
    p.set_defaults(run=run_terminal_writer)
    add_logging_flags(p, always=True)

    p = sub.add_parser(
        "schemas",
        help="write the JSON Schemas of the topics (transactions, labels, scores, alerts, dead-letter)",
    )
    p.add_argument("--out", type=Path, required=True, help="directory for the <topic>.schema.json files")
    p.add_argument(
        "--config", type=Path, default=None, help="the serve settings' YAML (the schemas follow it)"
    )
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="a serve setting, e.g. timestamp_format=epoch_ms"
    )
    p.set_defaults(run=_schemas)

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
    add_logging_flags(p, always=False)

    p = sub.add_parser("compare", help="one table and plots of the runs in an MLflow experiment")
    p.add_argument("--experiment", default="txsentinel")
    p.add_argument("--metric", default="test/ap", help="MLflow metric to sort by (default test/ap)")
    p.add_argument("--out", type=Path, default=None, help="write the table and plots here")
    p.add_argument(
        "--data", type=Path, default=None, help="dataset, for known-fraud exclusions in CP@k plots"
    )
    add_live_compare_flags(p)
    p.set_defaults(run=_compare)

    add_monitor_command(sub)
    bench = add_bench_commands(sub)

    p = sub.add_parser("demo", help="the main job end to end on embedded defaults (what `make demo` runs)")
    p.add_argument("--accounts", type=int, default=800)
    p.add_argument("--days", type=int, default=90)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--workdir", type=Path, default=Path("runs/demo"), help="where datasets and outputs go")
    p.set_defaults(run=_demo)
    add_logging_flags(p, always=False)
    for command in (*sub.choices.values(), *bench.choices.values()):
        command.add_argument(
            "--debug", action="store_true", help="on an error, print the traceback as well as its one line"
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with tracking_errors():
            return args.run(args)
    except OperatorError as error:
        return _refuse(args, error, error.exit_code)
    except (ValueError, FileNotFoundError) as error:
        # Bad input from the user: say what and where, without a traceback.
        return _refuse(args, error, EXIT_INPUT)
    except OSError as error:
        if error.filename is None:
            raise
        # A file the work could not write or read after all (a full disk, a permission changed), named.
        return _refuse(args, error, EXIT_OUTSIDE)


def _refuse(args: argparse.Namespace, error: Exception, exit_code: int) -> int:
    if args.debug:
        traceback.print_exc()
    print(f"txsentinel {args.command}: {error}", file=sys.stderr)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
