"""--log-format json: one JSON object a line, with the fields of the record's `key=%x` pairs, typed."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli.logs import JsonFormatter, configure_logging, fields_of
from pipeline.cli.main import build_parser


def record(msg: str, *args, **kwargs) -> logging.LogRecord:
    made = logging.LogRecord("consumers.service.restore", logging.INFO, "restore.py", 1, msg, args, None)
    made.__dict__.update(kwargs)
    return made


def test_fields_come_from_the_format_string_with_their_types():
    msg = "restore done partitions=%s records=%d states=%d seconds=%.3f error=%r 100%% done"
    got = fields_of(record(msg, [0, 2], 12, 9, 0.25, TimeoutError("slow")))
    assert got == {
        "partitions": [0, 2], "records": 12, "states": 9, "seconds": 0.25, "error": "TimeoutError('slow')",
    }  # fmt: skip


def test_a_placeholder_without_a_key_is_skipped_and_a_mismatch_gives_no_fields():
    assert fields_of(record("batch aborted (%s) attempt=%d", "x", 2)) == {"attempt": 2}
    assert fields_of(record("width %*d n=%d", 5, 1, 2)) == {}  # * takes an argument of its own
    assert fields_of(record("no arguments n=%d")) == {}


def test_a_json_line_has_the_four_keys_first_then_fields_extra_and_the_exception():
    try:
        raise ValueError("bad")
    except ValueError:
        exc_info = sys.exc_info()
    made = record("serve started topic=%s partitions=%d message=%s", "tx", 3, "m", batch=7)
    made.exc_info = exc_info
    line = json.loads(JsonFormatter().format(made))
    assert list(line)[:4] == ["timestamp", "level", "logger", "message"]
    assert line["message"] == "serve started topic=tx partitions=3 message=m"
    assert line["level"] == "INFO" and line["logger"] == "consumers.service.restore"
    assert line["topic"] == "tx" and line["partitions"] == 3 and line["batch"] == 7
    assert line["field_message"] == "m"  # a field never hides the message
    assert line["timestamp"].endswith("Z") and len(line["timestamp"]) == len("2026-03-01T12:00:00.123Z")
    assert "ValueError: bad" in line["exception"]


def test_non_finite_floats_and_objects_stay_valid_json():
    line = json.loads(JsonFormatter().format(record("lag=%f state=%s", float("nan"), object())))
    assert line["lag"] == "nan" and line["state"].startswith("<object object")


def test_serve_configures_logging_from_flags_and_the_environment(monkeypatch):
    monkeypatch.setenv("TXS_LOG_FORMAT", "json")
    monkeypatch.setenv("TXS_LOG_LEVEL", "warning")
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert (args.log_format, args.log_level) == ("json", "WARNING")
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--log-format", "text", "--log-level", "debug"]
    )
    assert (args.log_format, args.log_level) == ("text", "DEBUG")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--log-format", "xml"])


def test_a_bad_variable_is_named():
    with pytest.raises(ValueError, match=r"log format 'xml': expected one of text, json \(TXS_LOG_FORMAT\)"):
        configure_logging("xml")


def test_json_logging_writes_only_json_lines_to_stderr_at_its_level():
    code = (
        "import logging, sys; from pipeline.cli.logs import configure_logging;"
        "configure_logging('json', 'INFO');"
        "logging.getLogger('consumers.service.loop').info('serve started partitions=%d group=%s', 3, 'g');"
        "logging.getLogger('x').debug('hidden')"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert len(lines) == 1 and lines[0]["partitions"] == 3 and lines[0]["group"] == "g"
