"""docs/operations.md against the code: its metrics table, its alert rules, its log line and its rollout
settings name what the service has, so a reader who copies them gets something that works."""

import json
import logging
import re
from pathlib import Path

import yaml

from consumers.runtime.metrics import HISTOGRAMS, METRICS
from consumers.runtime.settings import load_serve_config
from pipeline.cli.logs import JsonFormatter

PAGE = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()


def block(language: str, starting: str) -> str:
    (found,) = [
        b for b in re.findall(rf"```{language}\n(.*?)```", PAGE, flags=re.S) if b.startswith(starting)
    ]
    return found


def test_the_metrics_table_lists_every_metric_of_the_service():
    listed = set(re.findall(r"^\| `(txsentinel_\w+)` \|", PAGE, flags=re.M))
    assert listed == set(METRICS)


def test_the_alert_rules_are_rules_on_metrics_the_service_has():
    rules = yaml.safe_load(block("yaml", "groups:"))["groups"][0]["rules"]
    assert len(rules) >= 8
    suffixes = ("_bucket", "_sum", "_count")
    for rule in rules:
        assert {"alert", "expr", "labels", "annotations"} <= rule.keys(), rule
        assert rule["labels"]["severity"] in ("page", "ticket") and rule["annotations"]["summary"]
        for name in re.findall(r"\btxsentinel_\w+", rule["expr"]):
            base = next((name.removesuffix(s) for s in suffixes if name.removesuffix(s) in HISTOGRAMS), name)
            assert base in METRICS, f"rule {rule['alert']} names {name}, which the service does not have"


def test_the_rollout_settings_are_serve_settings():
    settings = yaml.safe_load(block("yaml", "group_id:"))
    cfg = load_serve_config(config_file=None, overrides=settings, env={})
    assert (
        cfg.topic("changelog") == "account-state-changelog-v8" and cfg.topic("transactions") == "transactions"
    )


def test_the_json_log_line_is_what_the_formatter_writes():
    shown = json.loads(block("json", "{\"timestamp\"").strip())
    record = logging.LogRecord(
        "consumers.service.restore", logging.INFO, "restore.py", 1,
        "restore done partitions=%s records=%d states=%d dormant=%d seconds=%.3f", ([0, 1], 12, 9, 0, 0.042), None,
    )  # fmt: skip
    written = json.loads(JsonFormatter().format(record))
    assert list(written) == list(shown)
    assert {k: v for k, v in written.items() if k != "timestamp"} == {
        k: v for k, v in shown.items() if k != "timestamp"
    }
