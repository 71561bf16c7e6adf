"""The serve settings: defaults in code, a file of what differs, the environment, flags, their precedence,
secrets, and errors that name the setting and where its value came from."""

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from consumers.runtime.settings import (
    SECRETS,
    ServeConfig,
    load_serve_config,
    parse_settings,
    read_serve_config,
)
from consumers.runtime.settings_sources import format_settings
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
        ("lost_feed_position", "latest", "lost_feed_position = 'latest', expected 'fail'"),
        ("terminal_idle_days", -1, "terminal_idle_days = -1, expected an integer >= 0"),
        ("max_state_bytes_in_memory", 0, "max_state_bytes_in_memory = 0, expected an integer >= 1"),
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
    with pytest.raises(ValueError, match="max_amount = 1e\\+20: expected at most 1e\\+15"):
        MessageLimits.of(load_serve_config(None, overrides={"max_amount": 1e20}, env={}))


def test_a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("group_id: from-file\nmax_poll_records: 200\n")
    env = {"TXS_GROUP_ID": "from-env", "TXS_MAX_POLL_RECORDS": "300", "TXS_POLL_TIMEOUT_MS": "50"}
    cfg, origins = read_serve_config(path, {"group_id": "from-flag"}, env)
    assert (cfg.group_id, cfg.max_poll_records, cfg.poll_timeout_ms) == ("from-flag", 300, 50)
    assert origins == {
        "group_id": "command line",
        "max_poll_records": "TXS_MAX_POLL_RECORDS",
        "poll_timeout_ms": "TXS_POLL_TIMEOUT_MS",
    }
    cfg, origins = read_serve_config(path, None, {})
    assert (cfg.group_id, cfg.max_poll_records, cfg.poll_timeout_ms) == ("from-file", 200, 500)
    assert origins == {"group_id": str(path), "max_poll_records": str(path)}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max_ts_skew_s=1e-3", 0.001),  # YAML 1.1 read this as the string "1e-3"
        ("max_amount=5e6", 5e6),
        ("threshold=0.25", 0.25),
        ("threshold=null", None),
        ("instance_id=~", None),
        ("group_id=123", "123"),  # a name stays text: YAML made it an integer Kafka would refuse
        ("max_poll_records=1_000", 1000),
    ],
)
def test_text_from_a_flag_or_the_environment_takes_its_settings_type(text, expected):
    name, _, value = text.partition("=")
    assert parse_settings([text]) == {name: expected}
    cfg = load_serve_config(None, env={f"TXS_{name.upper()}": value})
    assert getattr(cfg, name) == expected and type(getattr(cfg, name)) is type(expected)


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("TXS_MAX_POLL_RECORDS", "lots", "max_poll_records = 'lots', expected an integer >= 1 (from TXS_MAX_POLL_RECORDS)"),
        ("TXS_THRESHOLD", "high", "threshold = 'high', expected a number or null (from TXS_THRESHOLD)"),
        ("TXS_RESTORE_TIMEOUT_S", "5m", "restore_timeout_s = '5m', expected a number (from TXS_RESTORE_TIMEOUT_S)"),
        ("TXS_BOOTSTRAP_SERVERS", "kafka:port", "bootstrap_servers = 'kafka:port', expected host:port[,host:port...]"),
        ("TXS_KAFKA_SECURITY_PROTOCOL", "TLS", "kafka_security_protocol = 'TLS', expected one of PLAINTEXT, SSL"),
        ("TXS_KAFKA_SSL_CAFILE", "/no/such/ca.pem", "kafka_ssl_cafile = '/no/such/ca.pem': no such file"),
        ("TXS_TOPIC_PREFIX", "team a/", "topic_prefix = 'team a/', expected letters, digits"),
        ("TXS_SCORES_TOPIC", "scores!", "scores_topic = 'scores!' makes topic 'scores!', expected 1 to 249"),
    ],
)  # fmt: skip
def test_a_bad_value_from_the_environment_names_its_variable(variable, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_serve_config(None, env={variable: value})


def test_a_secret_comes_from_its_variable_or_the_file_it_names_and_never_from_a_file_or_flag(tmp_path):
    secret = tmp_path / "sasl-password"
    secret.write_text("hunter2\n")  # as `echo hunter2 > FILE` writes it
    env = {"TXS_KAFKA_SASL_PASSWORD_FILE": str(secret), "TXS_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}
    cfg, origins = read_serve_config(None, None, env)
    assert cfg.kafka_security == {"security_protocol": "SASL_SSL", "sasl_plain_password": "hunter2"}
    assert origins["kafka_sasl_password"] == "TXS_KAFKA_SASL_PASSWORD_FILE"
    assert "hunter2" not in repr(cfg)
    with pytest.raises(ValueError, match="both TXS_KAFKA_SASL_PASSWORD and TXS_KAFKA_SASL_PASSWORD_FILE"):
        load_serve_config(None, env={**env, "TXS_KAFKA_SASL_PASSWORD": "hunter2"})
    with pytest.raises(ValueError, match=r"TXS_KAFKA_SSL_PASSWORD_FILE = '/nope': cannot read the secret"):
        load_serve_config(None, env={"TXS_KAFKA_SSL_PASSWORD_FILE": "/nope"})
    path = tmp_path / "serve.yaml"
    path.write_text("kafka_sasl_password: hunter2\n")
    refused = r"serve.yaml holds the secret kafka_sasl_password, but secrets come from the environment only"
    with pytest.raises(ValueError, match=refused):
        load_serve_config(path, env={})
    with pytest.raises(ValueError, match="the command line holds the secret kafka_ssl_password"):
        load_serve_config(None, parse_settings(["kafka_ssl_password=hunter2"]), env={})
    # A null secret (every setting of a config copied as overrides) sets nothing and hides no variable.
    copied = load_serve_config(None, {"kafka_sasl_password": None, "group_id": "g"}, env=env)
    assert copied.kafka_security["sasl_plain_password"] == "hunter2"


def test_the_printed_settings_mask_secrets_say_where_each_came_from_and_read_back_as_a_file(tmp_path):
    env = {"TXS_KAFKA_SASL_PASSWORD": "hunter2", "TXS_GROUP_ID": "g-env", "TXS_THRESHOLD": "0.7"}
    cfg, origins = read_serve_config(None, {"max_poll_records": 64}, env)
    text = format_settings(cfg, origins, SECRETS)
    assert "hunter2" not in text
    lines = {line.split(":")[0].lstrip("# "): line for line in text.splitlines()[1:]}
    assert set(lines) == {f.name for f in dataclasses.fields(ServeConfig)}
    assert lines["group_id"].endswith("# TXS_GROUP_ID") and lines["max_poll_records"].endswith(
        "# command line"
    )
    assert lines["kafka_sasl_password"].startswith("# kafka_sasl_password:") and "********" in text
    path = tmp_path / "printed.yaml"
    path.write_text(text)
    assert load_serve_config(path, env={"TXS_KAFKA_SASL_PASSWORD": "hunter2"}) == cfg


def test_every_setting_has_a_row_in_the_configuration_page():
    # Its environment variable follows from its name (TXS_ + NAME), as the page says.
    page = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()
    undocumented = [
        f.name for f in dataclasses.fields(ServeConfig) if not re.search(rf"^\| `{f.name}` \|", page, re.M)
    ]
    assert not undocumented, f"add a row for each to docs/configuration.md, section Serve: {undocumented}"
    assert "`TXS_` and the setting's name in upper case" in page


def test_the_transaction_timeout_is_below_the_session_timeout_by_default_and_must_stay_so():
    # A frozen instance's transaction is aborted (its producer fenced) before its partitions move on.
    cfg = ServeConfig()
    assert cfg.transaction_timeout_ms + 10_000 < cfg.session_timeout_ms  # + the broker's expiry check
    for transaction, session in ((45_000, 45_000), (60_000, 45_000), (8_000, 6_000)):
        with pytest.raises(ValueError) as refused:
            load_serve_config(
                None,
                overrides={"transaction_timeout_ms": transaction, "session_timeout_ms": session},
                env={},
            )
        message = str(refused.value)
        assert f"transaction_timeout_ms = {transaction}" in message
        assert f"session_timeout_ms = {session}" in message
    lowered = load_serve_config(
        None, overrides={"transaction_timeout_ms": 5000, "session_timeout_ms": 6000}, env={}
    )
    assert (lowered.transaction_timeout_ms, lowered.session_timeout_ms) == (5000, 6000)
