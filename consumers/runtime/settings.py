"""The scoring service's settings: a frozen dataclass whose defaults serve as they are; a deployment's YAML
file (`txsentinel serve --config FILE`) holds only what it changes, and `--set` overrides come last.

Kafka security (TLS, SASL) comes from TXS_KAFKA_* environment variables only, never from a file in the
repository, so no secret is ever committed next to the code.
"""

import dataclasses
import datetime
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# environment variable -> kafka-python client setting
SECURITY_ENV = {
    "TXS_KAFKA_SECURITY_PROTOCOL": "security_protocol",
    "TXS_KAFKA_SASL_MECHANISM": "sasl_mechanism",
    "TXS_KAFKA_SASL_USERNAME": "sasl_plain_username",
    "TXS_KAFKA_SASL_PASSWORD": "sasl_plain_password",
    "TXS_KAFKA_SSL_CAFILE": "ssl_cafile",
    "TXS_KAFKA_SSL_CERTFILE": "ssl_certfile",
    "TXS_KAFKA_SSL_KEYFILE": "ssl_keyfile",
}


@dataclass(frozen=True)
class ServeConfig:
    # Topics; every name gets `topic_prefix` in front (tests isolate themselves with a unique prefix).
    topic_prefix: str = ""
    transactions_topic: str = "transactions"
    labels_topic: str = "labels"
    scores_topic: str = "scores"
    alerts_topic: str = "alerts"
    dead_letter_topic: str = "dead-letter"
    changelog_topic: str = "account-state-changelog"  # compacted; partition count = transactions'
    # compacted, one partition: every terminal's record and the positions they reflect (consumers/terminals/table.py)
    terminal_table_topic: str = "terminal-risk-table"
    # each scored batch's terminal event counts, read by every instance (consumers/terminals/deltas.py);
    # as many partitions as transactions, time retention (terminal_deltas_retention_ms)
    terminal_deltas_topic: str = "terminal-deltas"
    # The table writer commits the changed terminals this often; a restore then folds at most about this
    # long of deltas on top of the table. Each flush costs ~30 us per changed terminal (a kafka-python send),
    # so a longer interval is cheaper wherever terminals are busy (docs/benchmarks.md, "The terminal table writer").
    terminal_table_flush_s: float = 10.0
    # "embedded": the instance that owns transactions partition 0 runs the table writer on a thread;
    # "external": no instance does, run `txsentinel terminal-writer` (one process per deployment) instead.
    terminal_table_writer: str = "embedded"
    # How long deltas stay in their topic: the table writer must read them before they go (days, not
    # seconds: a writer that is down longer than this loses counts). Used only when the topic is created.
    terminal_deltas_retention_ms: int = 7 * 24 * 3600 * 1000
    # How often a scorer reads `labels` and the other instances' deltas and folds them into its terminal
    # state: a label (or another instance's batch) counts for the events scored after it is folded, within
    # about this long of its commit. Each read costs a fetch round trip on the scorer's core, so reading
    # before every batch (0) is dearest where batches are small: at a trickle, where latency is decided.
    terminal_feed_interval_ms: int = 250
    # Used only when the service creates a missing transactions topic; an existing one keeps its own.
    transactions_partitions: int = 3
    replication_factor: int = 1
    group_id: str = "txsentinel-scorer"
    # A batch is one poll: its processing must stay well inside max_poll_interval_ms (docs/architecture.md, "The serving path per poll").
    max_poll_records: int = 500
    poll_timeout_ms: int = 500
    # After a poll, wait up to this long for the fetch it pipelined, so records that arrived during the last
    # batch join this one instead of the next (see service._top_up); 0 turns it off.
    fresh_fetch_ms: int = 5
    max_poll_interval_ms: int = 300_000
    # How long the group waits for a silent (crashed) member before moving its partitions elsewhere.
    session_timeout_ms: int = 45_000
    transactional_id_prefix: str = "txsentinel-scorer"
    # A stable name for this instance (e.g. its pod name: --set instance_id=$HOSTNAME). Its transactional id
    # is then {transactional_id_prefix}-{instance_id}, and a restarted instance aborts the open transaction its
    # crashed predecessor left (init_transactions) instead of every reader waiting transaction_timeout_ms.
    # Two live instances must never share one: the later fences the earlier. None: a random id per start.
    instance_id: str | None = None
    # How long the broker keeps a crashed instance's open transaction before aborting it; until then
    # read_committed readers of its output partitions (and the changelog restore) wait behind it.
    transaction_timeout_ms: int = 60_000
    # The producer holds a batch's records until its commit flushes them: with linger below a batch's
    # processing time, kafka-python ships many small requests (and wakes its sender thread per record
    # batch), which on one core competes with scoring for the interpreter.
    producer_linger_ms: int = 1_000
    producer_batch_bytes: int = 1_048_576  # per partition; a batch's scores for one partition fit one
    # A batch's transaction begins as soon as the previous commit returns, while the broker may still be
    # writing that commit's markers; it answers CONCURRENT_TRANSACTIONS and the client retries after this
    # backoff (kafka-python's default of 100 ms put p90 latency at a trickle from 20 to ~100 ms).
    producer_retry_backoff_ms: int = 10
    # Account states held in memory; the least recently active beyond this wait in the changelog and are read
    # back when their account returns (consumers/service/dormant.py). An account's state record is ~1.6 KB for the
    # default LSTM and ~9.3 KB for the default linear Transformer; a dormant account costs ~190 bytes.
    max_states_in_memory: int = 500_000
    restore_timeout_s: float = 300.0  # per assignment: reading the changelog partitions of new partitions
    threshold: float | None = None  # alert threshold on the probability; None: the model's own
    # The top inputs behind each alert, in its record (consumers/scoring/explain.py); 0: none
    alert_reasons: int = 3
    # What a valid transaction or label is: anything else goes to dead-letter with the reason. The same names
    # and defaults as consumers/scoring/messages.py's MessageLimits, which checks them at start (a test holds
    # the two together); docs/operations.md lists what is refused and why.
    max_message_bytes: int = 65_536
    max_json_depth: int = 8  # the formats are flat: deeper nesting is refused before the parser recurses
    max_id_chars: int = 256  # event, account and terminal ids, and the optional texts
    max_amount: float = 1e9  # at most 1e15: the features' sums of any history stay finite
    earliest_ts: str = (
        "2000-01-01T00:00:00+00:00"  # ts and label_ts before it are typos (2000 at the earliest)
    )
    # ts and label_ts at most this far after the instance's clock: a far-future event would move its account's
    # and its terminal's day forward for good
    max_ts_skew_s: float = 3600.0
    # A transaction whose record key is missing or is not its account_id: "dead-letter" it, or "rekey": write
    # it again to `transactions` under its account's key (in the batch's transaction), so it is scored from
    # its account's partition, in order with the account's other events from there on.
    key_mismatch: str = "dead-letter"
    metrics_port: int = 0  # 0: no metrics endpoint
    # The address /metrics listens on: this host only by default; a scraper elsewhere needs "0.0.0.0" (or the
    # pod's address) and a network that keeps strangers out, since the endpoint has no authentication.
    metrics_host: str = "127.0.0.1"
    # kafka-python settings from the environment (SECURITY_ENV); kept out of repr: it may hold a password.
    security: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    def __post_init__(self):
        if isinstance(self.earliest_ts, datetime.date):  # YAML reads an unquoted date or time as one
            when = self.earliest_ts
            if not isinstance(when, datetime.datetime):
                when = datetime.datetime(when.year, when.month, when.day)
            if when.tzinfo is None:
                when = when.replace(tzinfo=datetime.UTC)
            object.__setattr__(self, "earliest_ts", when.isoformat())
        for name in ("max_amount", "max_ts_skew_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"serve config: {name} = {value!r}, expected a finite number > 0")
        for name, least in (
            ("transactions_partitions", 1),
            ("replication_factor", 1),
            ("max_poll_records", 1),
            ("poll_timeout_ms", 1),
            ("transaction_timeout_ms", 1),
            ("session_timeout_ms", 1),
            ("producer_batch_bytes", 1),
            ("producer_linger_ms", 0),
            ("producer_retry_backoff_ms", 0),
            ("fresh_fetch_ms", 0),  # 0: off
            ("terminal_deltas_retention_ms", 60_000),
            ("terminal_feed_interval_ms", 0),  # 0: before every batch
            ("max_states_in_memory", 1),
            ("max_message_bytes", 64),
            ("max_json_depth", 1),
            ("max_id_chars", 1),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"serve config: {name} = {value!r}, expected an integer >= {least}")
        if not isinstance(self.metrics_port, int) or not 0 <= self.metrics_port < 65536:
            raise ValueError(
                f"serve config: metrics_port = {self.metrics_port!r}, expected 0 (off) or a port"
            )
        flush_s = self.terminal_table_flush_s
        if not isinstance(flush_s, int | float) or isinstance(flush_s, bool) or flush_s <= 0:
            raise ValueError(
                f"serve config: terminal_table_flush_s = {self.terminal_table_flush_s!r}, expected seconds > 0"
            )
        if self.restore_timeout_s <= 0:
            raise ValueError(f"serve config: restore_timeout_s = {self.restore_timeout_s!r}, expected > 0")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(
                f"serve config: threshold = {self.threshold!r}, expected a probability in [0, 1]"
            )
        if type(self.alert_reasons) is not int or self.alert_reasons < 0:
            raise ValueError(
                f"serve config: alert_reasons = {self.alert_reasons!r}, expected an integer >= 0 (0: no reasons)"
            )
        if self.instance_id is not None and (
            not isinstance(self.instance_id, str) or not self.instance_id.strip()
        ):
            raise ValueError(
                f"serve config: instance_id = {self.instance_id!r}, expected a non-empty name or null"
            )
        if self.key_mismatch not in ("dead-letter", "rekey"):
            raise ValueError(
                f"serve config: key_mismatch = {self.key_mismatch!r}, expected 'dead-letter' or 'rekey' (write "
                "the record again under its account's key)"
            )
        if self.terminal_table_writer not in ("embedded", "external"):
            raise ValueError(
                f"serve config: terminal_table_writer = {self.terminal_table_writer!r}, expected 'embedded' "
                "(an instance runs it) or 'external' (txsentinel terminal-writer runs it)"
            )
        if not self.group_id:
            raise ValueError("serve config: group_id is empty; every service instance needs its group")

    def topic(self, name: str) -> str:
        """The full name of topic `name` ("transactions", "scores", ...), prefix included."""
        return self.topic_prefix + getattr(self, f"{name}_topic")

    @property
    def kafka_security(self) -> dict[str, str]:
        return dict(self.security)


def parse_settings(items: list[str] | None) -> dict[str, Any]:
    """`--set KEY=VALUE` flags -> overrides; each value is read as YAML (200 -> int, null -> None)."""
    overrides = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected key=value, e.g. --set max_poll_records=200")
        overrides[key.strip()] = yaml.safe_load(text)
    return overrides


def security_from_env(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((setting, env[var]) for var, setting in SECURITY_ENV.items() if env.get(var))


def load_serve_config(
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> ServeConfig:
    """Defaults < YAML file < `overrides` (CLI flags, tests); security settings from `env` (os.environ)."""
    values: dict[str, Any] = {}
    if config_file is not None:
        loaded = yaml.safe_load(Path(config_file).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(
                f"{config_file}: expected a mapping of serve settings, got {type(loaded).__name__}"
            )
        values.update(loaded)
    values.update(overrides or {})
    known = {f.name for f in dataclasses.fields(ServeConfig)} - {"security"}
    unknown = sorted(set(values) - known)
    if unknown:
        where = f" in {config_file}" if config_file else ""
        raise ValueError(
            f"unknown serve setting(s) {unknown}{where}; known: {sorted(known)}. Kafka security settings "
            f"come from the environment only: {sorted(SECURITY_ENV)}"
        )
    values["security"] = security_from_env(os.environ if env is None else env)
    return ServeConfig(**values)
