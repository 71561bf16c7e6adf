"""`txsentinel serve` and `txsentinel terminal-writer`: their settings from flags, the environment, a file
and the defaults (consumers/runtime/settings.py), `--print-config`, and the operator's mistakes as one line.

Like pipeline/cli/main.py, each command imports the service inside its function: the parser is built from
this module for every command, and must not wait for torch, MLflow or Kafka.
"""

import argparse
import logging
from pathlib import Path

from pipeline.cli.errors import kafka_errors, model_errors


def add_serve_settings(p: argparse.ArgumentParser) -> None:
    # Every setting also comes from TXS_<NAME> in the environment, below these flags (docs/configuration.md).
    p.add_argument(
        "--bootstrap-servers",
        default=None,
        help="Kafka bootstrap servers, host:port[,...] (default: the project's broker, 127.0.0.1:39092)",
    )
    p.add_argument("--group-id", default=None, help="the scoring consumer group (default txsentinel-scorer)")
    p.add_argument(
        "--config", type=Path, default=None, help="YAML of the serve settings that differ from the defaults"
    )
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a setting (repeatable)")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective settings, where each came from, secrets masked; then exit",
    )


def serve_config(args: argparse.Namespace):
    """The serve settings of `serve` and `terminal-writer`: (ServeConfig, where each setting came from)."""
    from consumers.runtime.settings import parse_settings, read_serve_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    named = {"bootstrap_servers": args.bootstrap_servers, "group_id": args.group_id}
    named["model_uri"] = getattr(args, "model", None)
    named["shadow_model_uri"] = getattr(args, "shadow", None)
    flags = {name: value for name, value in named.items() if value is not None}
    flags.update(parse_settings(args.set))  # last: --set wins over the named flags
    return read_serve_config(args.config, flags)


def _print_config(cfg, origins: dict[str, str]) -> int:
    from consumers.runtime.settings import SECRETS
    from consumers.runtime.settings_sources import format_settings

    print(format_settings(cfg, origins, SECRETS))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    cfg, origins = serve_config(args)
    if args.print_config:
        return _print_config(cfg, origins)
    if cfg.model_uri is None:
        raise ValueError(
            "no model to serve: pass --model URI, or set TXS_MODEL_URI (or model_uri in --config)"
        )
    from consumers.service.loop import serve
    from pipeline.registry.tracking import load_model

    with model_errors(cfg.model_uri):
        model = load_model(cfg.model_uri)
    shadow = None
    if cfg.shadow_model_uri is not None:
        with model_errors(cfg.shadow_model_uri):
            shadow = load_model(cfg.shadow_model_uri)
    with kafka_errors(cfg):
        serve(cfg, model, cfg.bootstrap_servers, shadow=shadow)  # logs "serve stopped" with its stats
    return 0


def run_terminal_writer(args: argparse.Namespace) -> int:
    cfg, origins = serve_config(args)
    if args.print_config:
        return _print_config(cfg, origins)
    from consumers.terminals.writer import run_writer

    with kafka_errors(cfg):
        stats = run_writer(cfg, cfg.bootstrap_servers)
    print(f"terminal writer stopped: {stats}")
    return 0


def add_live_compare_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--live",
        action="store_true",
        help="the served model and its shadow challenger on live traffic (scores, shadow-scores, labels)",
    )
    p.add_argument("--since", default="7d", help="with --live: how far back, e.g. 7d or 12h (default 7d)")
    p.add_argument("--k", type=int, default=100, help="with --live: CP@k's k (default 100)")
    p.add_argument(
        "--no-mlflow",
        action="store_true",
        help="do not log the comparison to MLflow (from a store this user can only read it is not logged either: "
        "a line says so)",
    )
    add_serve_settings(p)


def run_live_compare(args: argparse.Namespace) -> int:
    cfg, _ = serve_config(args)
    from pipeline.evaluation.live_compare import LiveCompareConfig, format_table, live_compare
    from pipeline.registry.tracking_store import unwritable_tracking

    since = args.since.strip()
    units = {"d": 1.0, "h": 1 / 24}
    try:
        days = float(since[:-1]) * units[since[-1:]]
    except (KeyError, ValueError):
        raise ValueError(f"--since {since!r}: expected a number of days or hours, e.g. 7d or 12h") from None
    # A store it cannot use is refused before the topics are read; one this user can only read is not logged to.
    read_only = unwritable_tracking() if not args.no_mlflow else None
    config = LiveCompareConfig(since_days=days, k=args.k, log_to_mlflow=not (args.no_mlflow or read_only))
    with kafka_errors(cfg):
        table = live_compare(cfg, cfg.bootstrap_servers, config)
    print(format_table(table))
    if read_only:
        print(f"the comparison was not logged to MLflow: {read_only}")
    return 0
