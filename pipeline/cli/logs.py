"""Logging of the long-running commands: text lines for a terminal, JSON lines for a log pipeline.

`--log-format json` writes one JSON object a line to stderr: timestamp (UTC, ISO-8601, ms), level, logger,
message, then the record's structured fields. The code logs in one style, `"event key=%s key=%d", a, b`,
so the fields are read from the format string and its arguments, with their types (a list stays a list);
`extra={...}` fields join them. An exception's traceback goes in `exception`, a thread other than the main
one in `thread`.
"""

import argparse
import json
import logging
import math
import os
import re
from collections.abc import Callable
from datetime import UTC, datetime

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
FORMATS = ("text", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
BASE = ("timestamp", "level", "logger", "message")
# A LogRecord's own attributes: whatever else it has came through extra={...}.
_RECORD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
# One %-placeholder of a log format string (printf-style; %% is a literal percent sign).
_PLACEHOLDER = re.compile(r"%(?:\(\w+\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[diouxXeEfFgGcrsa%]")
_KEY = re.compile(r"(\w+)=$")


def _plain(value, conversion: str = "s"):
    """`value` as JSON can hold it: numbers, strings, lists and dicts as they are; the rest as text."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value) if conversion == "r" else str(value)


def fields_of(record: logging.LogRecord) -> dict:
    """The `key=%x` fields of a record's format string, paired with its arguments, and its extra fields."""
    fields = {}
    args = record.args if isinstance(record.args, tuple) else ()
    if isinstance(record.msg, str) and args:
        placeholders = [m for m in _PLACEHOLDER.finditer(record.msg) if m.group() != "%%"]
        # Widths given as * take an argument of their own: pairing would be off, so no fields then.
        if len(placeholders) == len(args) and not any("*" in m.group() for m in placeholders):
            for match, value in zip(placeholders, args, strict=True):
                key = _KEY.search(record.msg, 0, match.start())
                if key is not None and key.end() == match.start():
                    fields[key.group(1)] = _plain(value, match.group()[-1])
    for key, value in vars(record).items():
        if key not in _RECORD_ATTRS:
            fields[key] = _plain(value)
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object a line: timestamp, level, logger, message, then the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        at = datetime.fromtimestamp(record.created, UTC)
        line = {
            "timestamp": at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in fields_of(record).items():
            line[f"field_{key}" if key in BASE else key] = value  # a field never hides the four above
        if record.threadName != "MainThread":
            line.setdefault("thread", record.threadName)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(log_format: str = "text", level: str = "INFO") -> None:
    """Root logging to stderr in `log_format` (text or json) at `level`, replacing any handler there."""
    if log_format not in FORMATS:
        raise ValueError(f"log format {log_format!r}: expected one of {', '.join(FORMATS)} (TXS_LOG_FORMAT)")
    if level.upper() not in LEVELS:
        raise ValueError(f"log level {level!r}: expected one of {', '.join(LEVELS)} (TXS_LOG_LEVEL)")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(log_format == "json")  # a warning's text would be the one line not in JSON


def add_logging_flags(parser: argparse.ArgumentParser, always: bool) -> None:
    """--log-format and --log-level on a command whose `run` default is set; defaults from TXS_LOG_FORMAT and
    TXS_LOG_LEVEL. The command's run then configures logging first: always (serve: text at INFO by
    default), or only when a flag or variable asks (train keeps its own output otherwise)."""
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default=os.environ.get("TXS_LOG_FORMAT"),
        help="text (default) or json: one JSON object a line, with the structured fields (TXS_LOG_FORMAT)",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LEVELS,
        default=os.environ.get("TXS_LOG_LEVEL"),
        help="DEBUG, INFO (default), WARNING or ERROR (TXS_LOG_LEVEL)",
    )
    run: Callable[[argparse.Namespace], int] = parser.get_default("run")

    def run_logged(args: argparse.Namespace) -> int:
        if always or args.log_format or args.log_level:
            configure_logging(args.log_format or "text", args.log_level or "INFO")
        return run(args)

    parser.set_defaults(run=run_logged)
