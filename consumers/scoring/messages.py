"""JSON messages on the `transactions` and `labels` topics: decoding and validation, and the encoders that
write them (the demo, the benches and the tests produce with these). What the service writes is in
consumers/scoring/outputs.py; the JSON Schemas of every topic are generated in consumers/scoring/topic_schemas.py.

transactions (key = account_id, UTF-8):
    {"event_id": "E1", "account_id": "A1", "ts": "2026-03-01T12:00:00.250000Z", "amount": 12.5,
     "terminal_id": "T9", "category": "grocery", "channel": "pos", "country": "FR"}   (last three optional)
labels (key = account_id):
    {"event_id": "E1", "account_id": "A1", "terminal_id": "T9", "is_fraud": true,
     "label_ts": "2026-03-04T09:00:00Z"}
With timestamp_format = epoch_ms, ts and label_ts are epoch milliseconds instead: "ts": 1772366400250.

The decoders are total: for ANY bytes, decode_transaction and decode_label return a valid event or raise
MessageError, whose text is the reason a person can act on; the service sends such a message to
`dead-letter` with that reason instead of stopping. What a valid event is, within MessageLimits
(consumers/scoring/message_limits.py checks each value):
- at most `max_message_bytes` of UTF-8 JSON (NaN and Infinity are not JSON), nested at most
  `max_json_depth` deep (checked before parsing: the parser recurses), one object with the required
  fields, each named once (readers disagree on which of two values counts); fields of other names are
  ignored and counted (UnknownFields), or refused with unknown_fields = refuse;
- ids (event, account, terminal) and the optional texts of at most `max_id_chars` printable characters:
  no control, format or surrogate characters (a lone surrogate does not encode to UTF-8), no separators
  but the space, nothing that prints as nothing (pipeline/data/ids.py);
- an amount that is a finite number, >= 0 and <= `max_amount`: an amount near the float maximum overflows
  the sums of the features;
- timestamps (ts, label_ts) in the timestamp_format, ISO-8601 with a UTC offset or epoch milliseconds, not
  before `earliest_ts` and not after now + `max_ts_skew_s`: one far-future event would move its account's
  and its terminal's day forward for good. A label read from its topic is judged by the timestamp of its
  Kafka record instead of a clock (label_ts at most `max_ts_skew_s` after it): the scorers and the table
  writer all read every label, and a bound read against each one's clock would let one refuse what another
  folds in (consumers/terminals/feed.py says when a label dated ahead is folded).
"""

import json
from dataclasses import dataclass
from typing import NamedTuple

from consumers.scoring.json_text import json_depth, parse_json
from consumers.scoring.message_limits import (
    DEFAULT_LIMITS,
    MessageError,
    MessageLimits,
    amount,
    cut,
    format_ts,
    read_ts,
    show,
    text,
)

TRANSACTION_FIELDS = ("event_id", "account_id", "ts", "amount", "terminal_id")
OPTIONAL_TRANSACTION_FIELDS = ("category", "channel", "country")
LABEL_FIELDS = ("event_id", "account_id", "terminal_id", "is_fraud", "label_ts")


class Transaction(NamedTuple):
    # A NamedTuple, not a frozen dataclass: the service builds one per event, in 0.4 us instead of 3.2.
    event_id: str
    account_id: str
    ts_us: int
    amount: float
    terminal_id: str
    category: str | None = None
    channel: str | None = None
    country: str | None = None


@dataclass(frozen=True)
class Label:
    event_id: str
    account_id: str
    terminal_id: str
    is_fraud: bool
    label_ts_us: int


class UnknownFields:
    """Counts the decoded messages that carried fields of no known name (ignored, by default), and keeps the
    first MAX_NAMES of those names, cut as reasons cut values (a name may be as long as the message), so the
    service can say once which fields its topics carry in a line of bounded length."""

    MAX_NAMES = 64

    def __init__(self):
        self.messages = 0
        self.names: set[str] = set()
        self.new_names: list[str] = []  # seen for the first time since the last take()

    def saw(self, names: list[str]) -> None:
        self.messages += 1
        for name in map(cut, names):
            if name not in self.names and len(self.names) < self.MAX_NAMES:
                self.names.add(name)
                self.new_names.append(name)

    def take(self) -> tuple[int, list[str]]:
        """(messages counted, names first seen) since the last take."""
        taken = self.messages, self.new_names
        self.messages, self.new_names = 0, []
        return taken


def _object(
    value: bytes, fields: tuple[str, ...], optional: tuple[str, ...], limits, unknown: UnknownFields | None
) -> dict:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise MessageError(f"expected the message's bytes, got {type(value).__name__}")
    if len(value) > limits.max_message_bytes:
        raise MessageError(f"message is {len(value)} bytes; the limit is {limits.max_message_bytes}")
    value = bytes(value)
    # A flat message has one bracket; counting them is C speed, the exact depth is needed only past that.
    if value.count(b"[") + value.count(b"{") > limits.max_json_depth:
        depth = json_depth(value)
        if depth > limits.max_json_depth:
            raise MessageError(f"JSON nested {depth} deep; the limit is {limits.max_json_depth}")
    try:
        # UTF-8 only: json.loads of bytes would also take UTF-16 and UTF-32. NaN and Infinity parse (Python's
        # json allows them) and are refused where a number is checked.
        data = parse_json(value.decode("utf-8"))
    except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise MessageError(f"not valid UTF-8 JSON: {cut(str(error))}") from None
    if not isinstance(data, dict):
        raise MessageError(f"expected a JSON object, got {type(data).__name__}")
    missing = [f for f in fields if data.get(f) is None]
    if missing:
        raise MessageError(f"missing required field(s): {', '.join(missing)}")
    if len(data) > len(fields):  # the usual message has exactly the required fields
        strangers = sorted(set(data) - set(fields) - set(optional))
        if strangers and limits.unknown_fields == "refuse":
            shown = cut(", ".join(name if name.isprintable() else repr(name) for name in strangers))
            raise MessageError(
                f"unknown field(s): {shown}; expected {', '.join(fields + optional)} (setting unknown_fields "
                "= refuse; ignore reads such messages)"
            )
        if strangers and unknown is not None:
            unknown.saw(strangers)
    return data


def decode_transaction(
    value: bytes,
    limits: MessageLimits | None = None,
    now_us: int | None = None,
    unknown: UnknownFields | None = None,
) -> Transaction:
    """A valid transaction, or MessageError with the reason (module docstring: what is valid). `now_us`:
    the clock the future bound is read against, microseconds since the epoch (default: time.time);
    `unknown` counts the messages with fields of no known name, when they are ignored."""
    limits = DEFAULT_LIMITS if limits is None else limits
    data = _object(value, TRANSACTION_FIELDS, OPTIONAL_TRANSACTION_FIELDS, limits, unknown)
    spent = amount(data["amount"], limits)
    optional = [data.get(field) for field in OPTIONAL_TRANSACTION_FIELDS]
    for field, given in zip(OPTIONAL_TRANSACTION_FIELDS, optional, strict=True):
        if given is not None:
            text(given, field, limits, required=False)
    return Transaction(
        text(data["event_id"], "event_id", limits),
        text(data["account_id"], "account_id", limits),
        read_ts(data["ts"], "ts", limits, now_us),
        spent,
        text(data["terminal_id"], "terminal_id", limits),
        *optional,
    )


def transactions_from_frame(frame) -> list[Transaction]:
    """The rows of a canonical polars frame (event_id, account_id, ts, amount, terminal_id) as Transactions."""
    columns = (
        frame["event_id"].to_list(),
        frame["account_id"].to_list(),
        frame["ts"].dt.epoch("us").to_list(),
        frame["amount"].to_list(),
        frame["terminal_id"].to_list(),
    )
    return [Transaction(e, a, t, m, term) for e, a, t, m, term in zip(*columns, strict=True)]


def _ts(ts_us: int, timestamp_format: str) -> str | int:
    return ts_us // 1000 if timestamp_format == "epoch_ms" else format_ts(ts_us)


def encode_transaction(tx: Transaction, timestamp_format: str = "iso8601") -> bytes:
    data = {
        "event_id": tx.event_id,
        "account_id": tx.account_id,
        "ts": _ts(tx.ts_us, timestamp_format),
        "amount": tx.amount,
        "terminal_id": tx.terminal_id,
    }
    for field in OPTIONAL_TRANSACTION_FIELDS:
        if getattr(tx, field) is not None:
            data[field] = getattr(tx, field)
    return json.dumps(data, separators=(",", ":")).encode("utf-8")


def decode_label(
    value: bytes,
    limits: MessageLimits | None = None,
    now_us: int | None = None,
    unknown: UnknownFields | None = None,
    sent_us: int | None = None,
) -> Label:
    """A valid label, or MessageError with the reason: decode_transaction's rules for its ids and label_ts.
    `sent_us`: the timestamp of the record it came in (microseconds since the epoch); given, label_ts is
    bounded by it rather than by the clock (module docstring)."""
    limits = DEFAULT_LIMITS if limits is None else limits
    data = _object(value, LABEL_FIELDS, (), limits, unknown)
    if not isinstance(data["is_fraud"], bool):
        raise MessageError(f"field 'is_fraud': expected true or false, got {show(data['is_fraud'])}")
    return Label(
        event_id=text(data["event_id"], "event_id", limits),
        account_id=text(data["account_id"], "account_id", limits),
        terminal_id=text(data["terminal_id"], "terminal_id", limits),
        is_fraud=data["is_fraud"],
        label_ts_us=read_ts(data["label_ts"], "label_ts", limits, now_us, sent_us),
    )


def encode_label(label: Label, timestamp_format: str = "iso8601") -> bytes:
    data = {
        "event_id": label.event_id,
        "account_id": label.account_id,
        "terminal_id": label.terminal_id,
        "is_fraud": label.is_fraud,
        "label_ts": _ts(label.label_ts_us, timestamp_format),
    }
    return json.dumps(data, separators=(",", ":")).encode("utf-8")
