"""The checks of every serve setting (consumers/runtime/settings.py's ServeConfig runs them when it is made):
each names the setting, its value and what it may be.

Apart from the settings, so that settings.py reads as the list of settings with their defaults and reasons.
"""

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

from consumers.runtime.key_partition import key_partition
from consumers.runtime.settings_sources import env_name
from models.checks import is_finite_number, is_integer, is_number

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI")
TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")  # what Kafka accepts as a topic name


def check_settings(cfg: Any) -> None:
    """Refuses a ServeConfig (`cfg`) with a value out of its range, or of the wrong type, naming the first."""
    for name in ("max_amount", "max_ts_skew_s", "drift_refresh_s"):
        value = getattr(cfg, name)
        if not is_finite_number(value) or not value > 0:
            raise ValueError(f"serve config: {name} = {value!r}, expected a finite number > 0")
    for name, least in (
        ("transactions_partitions", 1),
        ("replication_factor", 1),
        ("max_poll_records", 1),
        ("poll_timeout_ms", 1),
        ("transaction_timeout_ms", 1),
        ("session_timeout_ms", 1),
        ("metadata_max_age_ms", 100),  # each read asks for every subscribed topic's metadata
        ("producer_batch_bytes", 1),
        ("producer_linger_ms", 0),
        ("producer_retry_backoff_ms", 0),
        ("fresh_fetch_ms", 0),  # 0: off
        ("terminal_deltas_retention_ms", 60_000),
        ("terminal_feed_interval_ms", 0),  # 0: before every batch
        ("terminal_idle_days", 0),  # 0: never; else more than 30 (consumers/terminals/idle.py)
        ("max_terminals_in_memory", 0),  # 0: no cap
        ("max_states_in_memory", 1),
        ("max_state_bytes_in_memory", 1),
        (
            "max_accounts_kept",
            0,
        ),  # 0: no bound; else at least twice the states memory holds (checked at start)
        ("max_message_bytes", 64),
        ("max_json_depth", 1),
        ("max_id_chars", 1),
        ("drift_window_events", 1),
    ):
        value = getattr(cfg, name)
        if not is_integer(value) or value < least:
            raise ValueError(f"serve config: {name} = {value!r}, expected an integer >= {least}")
    if not is_integer(cfg.metrics_port) or not 0 <= cfg.metrics_port < 65536:
        raise ValueError(f"serve config: metrics_port = {cfg.metrics_port!r}, expected 0 (off) or a port")
    flush_s = cfg.terminal_table_flush_s
    if not is_number(flush_s) or flush_s <= 0:
        raise ValueError(
            f"serve config: terminal_table_flush_s = {cfg.terminal_table_flush_s!r}, expected seconds > 0"
        )
    if cfg.restore_timeout_s <= 0:
        raise ValueError(f"serve config: restore_timeout_s = {cfg.restore_timeout_s!r}, expected > 0")
    if cfg.threshold is not None and not 0.0 <= cfg.threshold <= 1.0:
        raise ValueError(f"serve config: threshold = {cfg.threshold!r}, expected a probability in [0, 1]")
    if not is_integer(cfg.alert_reasons) or cfg.alert_reasons < 0:
        raise ValueError(
            f"serve config: alert_reasons = {cfg.alert_reasons!r}, expected an integer >= 0 (0: no reasons)"
        )
    if cfg.instance_id is not None and (not isinstance(cfg.instance_id, str) or not cfg.instance_id.strip()):
        raise ValueError(
            f"serve config: instance_id = {cfg.instance_id!r}, expected a non-empty name or null"
        )
    if cfg.key_mismatch not in ("dead-letter", "rekey"):
        raise ValueError(
            f"serve config: key_mismatch = {cfg.key_mismatch!r}, expected 'dead-letter' or 'rekey' (write "
            "the record again under its account's key)"
        )
    try:
        key_partition(cfg.producer_partitioner, 0)
    except ValueError as error:
        raise ValueError(f"serve config: {error}") from None
    if cfg.lost_feed_position not in ("fail", "earliest"):
        raise ValueError(
            f"serve config: lost_feed_position = {cfg.lost_feed_position!r}, expected 'fail' (stop with what "
            "was lost) or 'earliest' (go on from the first record still in the log, counting what was lost)"
        )
    if cfg.terminal_table_writer not in ("embedded", "external"):
        raise ValueError(
            f"serve config: terminal_table_writer = {cfg.terminal_table_writer!r}, expected 'embedded' "
            "(an instance runs it) or 'external' (txsentinel terminal-writer runs it)"
        )
    if not cfg.group_id:
        raise ValueError("serve config: group_id is empty; every service instance needs its group")
    check_fencing_timeouts(cfg)
    _check_kafka(cfg)
    for f in dataclasses.fields(cfg):  # last: the checks above say more about the values they know
        check_type(f.name, getattr(cfg, f.name), f.type)


def _check_kafka(cfg: Any) -> None:
    servers = cfg.bootstrap_servers
    if not isinstance(servers, str) or not all(
        re.fullmatch(r"[^\s:,]+(:\d{1,5})?", server.strip()) for server in servers.split(",")
    ):
        raise ValueError(f"serve config: bootstrap_servers = {servers!r}, expected host:port[,host:port...]")
    if not is_integer(cfg.bootstrap_timeout_ms) or cfg.bootstrap_timeout_ms < 1:
        raise ValueError(
            f"serve config: bootstrap_timeout_ms = {cfg.bootstrap_timeout_ms!r}, expected an integer >= 1"
        )
    if not isinstance(cfg.topic_prefix, str) or not TOPIC_NAME.fullmatch(cfg.topic_prefix or "x"):
        raise ValueError(
            f"serve config: topic_prefix = {cfg.topic_prefix!r}, expected letters, digits, '.', '_' or '-'"
        )
    for name in (f.name for f in dataclasses.fields(cfg) if f.name.endswith("_topic")):
        topic = f"{cfg.topic_prefix}{getattr(cfg, name)}"
        if not TOPIC_NAME.fullmatch(topic):
            raise ValueError(
                f"serve config: {name} = {getattr(cfg, name)!r} makes topic {topic!r}, expected 1 to 249 "
                "letters, digits, '.', '_' or '-' in all"
            )
    for name, allowed in (
        ("kafka_security_protocol", SECURITY_PROTOCOLS),
        ("kafka_sasl_mechanism", SASL_MECHANISMS),
    ):
        if getattr(cfg, name) not in (None, *allowed):
            raise ValueError(
                f"serve config: {name} = {getattr(cfg, name)!r}, expected one of {', '.join(allowed)}"
            )
    for name in ("kafka_ssl_cafile", "kafka_ssl_certfile", "kafka_ssl_keyfile"):
        path = getattr(cfg, name)
        if path is not None and not Path(path).is_file():
            raise ValueError(f"serve config: {name} = {path!r}: no such file ({env_name(name)})")


_TYPE_NAMES = {str: "text", int: "an integer", float: "a number", bool: "true or false", type(None): "null"}


def check_type(name: str, value: Any, hint: Any) -> None:
    """Refuses `value` unless it is of type `hint` (a bool is not a number; an integer is)."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        allowed = typing.get_args(hint)
    else:
        allowed = (typing.get_origin(hint) or hint,)  # tuple[str, ...]: a tuple
    for kind in allowed:
        if kind is float and is_number(value):
            return
        if kind in (int, float) and isinstance(value, bool):
            continue
        if isinstance(kind, type) and isinstance(value, kind):
            return
    expected = " or ".join(_TYPE_NAMES.get(kind, str(kind)) for kind in allowed)
    raise ValueError(f"serve config: {name} = {value!r}, expected {expected}")


def check_fencing_timeouts(cfg: Any) -> None:
    """Refuse a transaction timeout at or above the session timeout.

    An instance that freezes (a GC pause, SIGSTOP, a stalled VM) with a transaction open loses its partitions
    after session_timeout_ms. Its transaction must be aborted by then, which also fences its producer, so
    that its successor restores states and offsets the frozen instance can no longer add to when it wakes.
    """
    if cfg.transaction_timeout_ms >= cfg.session_timeout_ms:
        raise ValueError(
            f"serve config: transaction_timeout_ms = {cfg.transaction_timeout_ms} is not below "
            f"session_timeout_ms = {cfg.session_timeout_ms}: an instance frozen with a transaction open "
            "could commit it after the group has handed its partitions to another instance. Lower "
            "transaction_timeout_ms (by the broker's 10 s check for expired transactions, ideally) or raise "
            "session_timeout_ms"
        )
