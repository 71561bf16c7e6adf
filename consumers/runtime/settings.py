"""The scoring service's settings: a frozen dataclass whose defaults serve as they are, and which checks
every value it is given (consumers/runtime/settings_checks.py). Each setting comes from the first of: a flag
(`--set`, `--group-id`, ...), the environment (TXS_<NAME>), the deployment's YAML file (`txsentinel serve
--config FILE`, holding only what it changes), the defaults here (consumers/runtime/settings_sources.py
reads the layers).

Secrets (the Kafka passwords) come from the environment only, never from a file or a flag: TXS_<NAME>, or a
file that TXS_<NAME>_FILE names.
"""

import dataclasses
import datetime
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from consumers.runtime.settings_checks import check_settings, check_type
from consumers.runtime.settings_sources import env_name, from_text, read_layers, unknown
from models.checks import read_yaml_file

# setting -> the kafka-python client setting it is passed as
KAFKA_SECURITY = {
    "kafka_security_protocol": "security_protocol",
    "kafka_sasl_mechanism": "sasl_mechanism",
    "kafka_sasl_username": "sasl_plain_username",
    "kafka_sasl_password": "sasl_plain_password",
    "kafka_ssl_cafile": "ssl_cafile",
    "kafka_ssl_certfile": "ssl_certfile",
    "kafka_ssl_keyfile": "ssl_keyfile",
    "kafka_ssl_password": "ssl_password",
}
SECRETS = frozenset({"kafka_sasl_password", "kafka_ssl_password"})


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
    # the shadow challenger's scores (serve --shadow); its changelog is <changelog_topic>.<its fingerprint>
    shadow_scores_topic: str = "shadow-scores"
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
    # A labels or terminal-deltas position that has left its log (the table writer was down longer than the
    # deltas' retention, or labels were deleted unread): "fail" stops the reader with what was lost; "earliest"
    # goes on from the first record still there, logging and counting the records lost
    # (txsentinel_feed_records_lost_total). Never a silent jump. docs/operations.md, "Lost feed positions".
    lost_feed_position: str = "fail"
    # A terminal with no event and no fraud report for this many days (before the newest event day seen) leaves
    # every scorer's memory, and the table writer writes its tombstone: the table stops growing. More than
    # the longest terminal window (30 days), so evicting changes no feature of an event at most this many
    # days minus 30 older than the newest (consumers/terminals/idle.py). 0: never.
    terminal_idle_days: int = 90
    # The most terminals a holder (every scorer, the table writer) keeps, whatever their activity: beyond it,
    # those with the least history go at once (no fraud report and the fewest events inside the windows, then
    # the least recently active), down to 90% of it, and the writer writes their tombstones. Unlike
    # idle eviction this changes features (a terminal let go loses the counts still in its windows), so each
    # time is logged as an error and counted (txsentinel_terminals_capped_total). A terminal held costs ~1 KB
    # (docs/operations.md, "Too many terminals"): set it above the terminals active within terminal_idle_days.
    # 0: no cap.
    max_terminals_in_memory: int = 5_000_000
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
    # How often the consumer asks for the topics' metadata: how soon partitions added to `transactions` are
    # seen (their records are then dead-lettered: growing the partitions is a new deployment).
    metadata_max_age_ms: int = 300_000
    transactional_id_prefix: str = "txsentinel-scorer"
    # A stable name for this instance (e.g. its pod name: --set instance_id=$HOSTNAME). Its transactional id
    # is then {transactional_id_prefix}-{instance_id}, and a restarted instance aborts the open transaction its
    # crashed predecessor left (init_transactions) instead of every reader waiting transaction_timeout_ms.
    # Two live instances must never share one: the later fences the earlier. None: a random id per start.
    instance_id: str | None = None
    # How long the broker keeps a crashed instance's open transaction before aborting it; until then
    # read_committed readers of its output partitions (and the changelog restore) wait behind it. Below
    # session_timeout_ms (check_fencing_timeouts): a frozen instance's transaction is aborted, and its
    # producer fenced, before the group hands its partitions on. The broker looks for expired transactions
    # every 10 s (transaction.abort.timed.out.transaction.cleanup.interval.ms): 30 s + 10 s < 45 s.
    transaction_timeout_ms: int = 30_000
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
    # The same cap in bytes: a state's size is fixed per detector (Scorer.state_bytes_per_account measures
    # it: ~2.2 KB an account for the default LSTM, ~9.9 KB for the linear Transformer, ~67 KB for the softmax
    # Transformer's window), so memory holds min(max_states_in_memory, this // that) accounts.
    max_state_bytes_in_memory: int = 8 * 2**30
    # Accounts an instance keeps in all, held in memory or dormant in the changelog (whose place costs ~190
    # bytes with short ids, up to ~1.2 KB with the longest: ~1.8 GB at this default with short ids). Past
    # it, the least recently written dormant accounts are let go, down to 90% of it, each deleted from the
    # changelog with a tombstone in the batch's transaction: they start again from the initial state if they
    # return. Logged, and counted (txsentinel_accounts_let_go_total; docs/operations.md, "Too many
    # accounts"). At least twice the states memory holds; 0: no bound.
    max_accounts_kept: int = 10_000_000
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
    # ts at most this far after the instance's clock, label_ts after its record's timestamp (the same for every
    # reader of it): a far-future event would move its account's and its terminal's day forward for good
    max_ts_skew_s: float = 3600.0
    # A transaction whose record key is missing or is not its account_id: "dead-letter" it, or "rekey": write
    # it again to `transactions` under its account's key (in the batch's transaction), so it is scored from
    # its account's partition, in order with the account's other events from there on.
    key_mismatch: str = "dead-letter"
    # The rule the producers of `transactions` pick a keyed record's partition by, so that a record off its
    # key's partition (sent to a partition named by hand) is caught as key_mismatch says: "murmur2" (the Java
    # client, kafka-python, librdkafka's murmur2_random), "crc32" (librdkafka's default) or "unchecked"
    # (a rule of the producers' own, trusted to keep each account on one partition).
    producer_partitioner: str = "murmur2"
    # Fields of a transaction or label that the service does not know (real topics carry extra ones):
    # "ignore" reads the message and counts it (txsentinel_unknown_fields_total), "refuse" dead-letters it.
    unknown_fields: str = "ignore"
    # The form of ts and label_ts in transactions and labels, and of ts in scores and alerts: "iso8601"
    # ("2026-03-01T12:00:00.250Z", an offset required) or "epoch_ms" (1772366400250, a JSON integer);
    # docs/topics.md.
    timestamp_format: str = "iso8601"
    metrics_port: int = 0  # 0: no metrics endpoint
    # Drift and state health (docs/operations.md): over the last this many scored events, published this often
    drift_window_events: int = 20_000
    drift_refresh_s: float = 5.0
    # The address /metrics listens on: this host only by default; a scraper elsewhere needs "0.0.0.0" (or the
    # pod's address) and a network that keeps strangers out, since the endpoint has no authentication.
    metrics_host: str = "127.0.0.1"
    # The Kafka cluster; "127.0.0.1:39092" is the project's development broker (scripts/kafka.sh).
    bootstrap_servers: str = "127.0.0.1:39092"  # host:port[,host:port...]
    # How long the start waits for a first answer from the cluster before it gives up with an error.
    bootstrap_timeout_ms: int = 30_000
    # What `serve` scores with: models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN/model or a directory.
    model_uri: str | None = None
    shadow_model_uri: str | None = (
        None  # a challenger stepped in shadow (docs/operations.md, "Shadow challenger")
    )
    # Kafka security (TLS, SASL), passed to every client as KAFKA_SECURITY names them; None: the client's default.
    kafka_security_protocol: str | None = None  # SECURITY_PROTOCOLS; the client's default is PLAINTEXT
    kafka_sasl_mechanism: str | None = None  # SASL_MECHANISMS
    kafka_sasl_username: str | None = None
    kafka_ssl_cafile: str | None = None  # paths of PEM files
    kafka_ssl_certfile: str | None = None
    kafka_ssl_keyfile: str | None = None
    # Secrets (SECRETS): from the environment only, and kept out of repr, which logs print.
    kafka_sasl_password: str | None = field(default=None, repr=False)
    kafka_ssl_password: str | None = field(default=None, repr=False)  # the key file's

    def __post_init__(self):
        if isinstance(self.earliest_ts, datetime.date):  # YAML reads an unquoted date or time as one
            when = self.earliest_ts
            if not isinstance(when, datetime.datetime):
                when = datetime.datetime(when.year, when.month, when.day)
            if when.tzinfo is None:
                when = when.replace(tzinfo=datetime.UTC)
            object.__setattr__(self, "earliest_ts", when.isoformat())
        check_settings(self)

    def topic(self, name: str) -> str:
        """The full name of topic `name` ("transactions", "scores", ...), prefix included."""
        return self.topic_prefix + getattr(self, f"{name}_topic")

    @property
    def kafka_security(self) -> dict[str, str]:
        """The kafka-python settings of the security settings that are set."""
        return {client: getattr(self, name) for name, client in KAFKA_SECURITY.items() if getattr(self, name)}


def parse_settings(items: list[str] | None) -> dict[str, Any]:
    """`--set KEY=VALUE` flags -> overrides, each value read as its setting's type (300 -> int, 1e-3 ->
    float, null -> None where a setting may be null)."""
    overrides = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected key=value, e.g. --set max_poll_records=200")
        overrides[key.strip()] = from_text(ServeConfig, key.strip(), text.strip())
    return overrides


def read_serve_config(
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[ServeConfig, dict[str, str]]:
    """(the settings, {setting: where it came from}): `overrides` (flags) win over `env` (os.environ when
    None), which wins over `config_file`, which wins over the defaults."""
    overrides = dict(overrides or {})
    from_file = read_yaml_file(config_file, "serve settings") if config_file is not None else {}
    for where, given in ((f" in {config_file}", from_file), (" among the flags", overrides)):
        wrong = unknown(ServeConfig, given)
        if wrong:
            known = sorted(f.name for f in dataclasses.fields(ServeConfig))
            raise ValueError(
                f"unknown serve setting(s) {wrong}{where}; known: {known}. Secrets come from the environment "
                f"only: {', '.join(env_name(name) for name in sorted(SECRETS))} (or *_FILE naming a file)"
            )
    env = os.environ if env is None else env
    values, origins = read_layers(ServeConfig, overrides, env, from_file, str(config_file), SECRETS)
    try:
        try:
            return ServeConfig(**values), origins
        except TypeError:
            # a check compared a value of the wrong type before the type check came to it: say which value
            for f in dataclasses.fields(ServeConfig):
                if f.name in values:
                    check_type(f.name, values[f.name], f.type)
            raise
    except ValueError as error:
        # "serve config: NAME ...": say where NAME's value came from
        named = re.match(r"serve config: (\w+)", str(error))
        if named is None or named[1] not in origins:
            raise
        raise ValueError(f"{error} (from {origins[named[1]]})") from error


def load_serve_config(
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> ServeConfig:
    """The settings: `overrides` (flags, tests) over `env` (os.environ when None) over `config_file`."""
    return read_serve_config(config_file, overrides, env)[0]
