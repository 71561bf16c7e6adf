"""The serve settings: defaults in code, a file of what differs, precedence, and errors that name the setting
and the file."""

import dataclasses
import re

import pytest
import yaml

from consumers.runtime.settings import ServeConfig, load_serve_config, parse_settings
from consumers.scoring.message_limits import MessageLimits, parse_ts


def test_without_a_file_or_with_an_empty_one_the_settings_are_the_defaults(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("# nothing differs from the defaults here\n")
    assert load_serve_config(None, env={}) == ServeConfig()
    assert load_serve_config(path, env={}) == ServeConfig()


def test_a_file_changes_what_it_names_and_nothing_else(tmp_path):
    changed = {"topic_prefix": "p-", "terminal_table_flush_s": 2.5, "instance_id": "pod-0", "threshold": 0.8}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(changed))
    assert load_serve_config(path, env={}) == dataclasses.replace(ServeConfig(), **changed)


def test_overrides_win_over_the_file(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("max_poll_records: 200\ngroup_id: from-file\n")
    cfg = load_serve_config(path, overrides={"group_id": "from-flag"}, env={})
    assert (cfg.max_poll_records, cfg.group_id) == (200, "from-flag")


def test_an_unknown_setting_is_named_with_its_file(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("max_poll_record: 200\n")  # one letter short
    with pytest.raises(ValueError, match=r"unknown serve setting\(s\) \['max_poll_record'\] in .*serve.yaml"):
        load_serve_config(path, env={})


def test_secrets_are_refused_in_a_file_and_taken_from_the_environment_only(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("sasl_plain_password: hunter2\n")
    with pytest.raises(ValueError, match=r"from the environment only.*TXS_KAFKA_SASL_PASSWORD"):
        load_serve_config(path, env={})
    env = {"TXS_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "TXS_KAFKA_SASL_PASSWORD": "hunter2"}
    cfg = load_serve_config(None, env=env)
    assert cfg.kafka_security == {"security_protocol": "SASL_SSL", "sasl_plain_password": "hunter2"}
    assert "hunter2" not in repr(cfg)  # logs print the config


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("producer_retry_backoff_ms", -1, "producer_retry_backoff_ms = -1, expected an integer >= 0"),
        ("terminal_table_flush_s", 0, "terminal_table_flush_s = 0, expected seconds > 0"),
        ("terminal_table_flush_s", "2s", "terminal_table_flush_s = '2s', expected seconds > 0"),
        ("terminal_table_writer", "thread", "terminal_table_writer = 'thread', expected 'embedded'"),
        ("terminal_feed_interval_ms", -5, "terminal_feed_interval_ms = -5, expected an integer >= 0"),
        ("max_poll_records", 0, "max_poll_records = 0, expected an integer >= 1"),
        ("max_poll_records", True, "max_poll_records = True, expected an integer >= 1"),
        ("threshold", 1.5, "threshold = 1.5, expected a probability in"),
        ("metrics_port", 70000, "metrics_port = 70000, expected 0"),
        ("group_id", "", "group_id is empty"),
        ("max_amount", float("inf"), "max_amount = inf, expected a finite number > 0"),
        ("max_ts_skew_s", 0, "max_ts_skew_s = 0, expected a finite number > 0"),
        ("max_json_depth", 0, "max_json_depth = 0, expected an integer >= 1"),
        ("key_mismatch", "drop", "key_mismatch = 'drop', expected 'dead-letter' or 'rekey'"),
    ],
)
def test_a_bad_value_is_refused_with_its_name(setting, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_serve_config(None, overrides={setting: value}, env={})


def test_set_flags_are_read_as_yaml_values_and_a_flag_without_a_value_is_refused():
    flags = ["max_states_in_memory=300", "threshold=null", "group_id = g-1"]
    assert parse_settings(flags) == {"max_states_in_memory": 300, "threshold": None, "group_id": "g-1"}
    with pytest.raises(ValueError, match="--set 'max_poll_records': expected key=value"):
        parse_settings(["max_poll_records"])


def test_the_message_settings_are_the_decoders_limits_with_the_same_defaults(tmp_path):
    # Two layers that may not import each other hold the same names: one source of truth, held here.
    assert MessageLimits.of(ServeConfig()) == MessageLimits()
    path = tmp_path / "serve.yaml"
    path.write_text("max_amount: 5000\nearliest_ts: 2020-01-01\nmax_ts_skew_s: 60\n")  # YAML: a date
    cfg = load_serve_config(path, env={})
    limits = MessageLimits.of(cfg)
    assert (limits.max_amount, limits.max_ts_skew_s) == (5000, 60)
    assert limits.earliest_us == parse_ts("2020-01-01T00:00:00Z", "earliest_ts")
    with pytest.raises(ValueError, match="max_amount = 1e\\+20: expected at most 1e15"):
        MessageLimits.of(load_serve_config(None, overrides={"max_amount": 1e20}, env={}))
