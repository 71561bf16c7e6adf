"""JSON messages on the `transactions`, `labels` and `scores` topics: encoding, decoding and validation.

transactions (key = account_id, UTF-8):
    {"event_id": "E1", "account_id": "A1", "ts": "2026-03-01T12:00:00.250000Z", "amount": 12.5,
     "terminal_id": "T9", "category": "grocery", "channel": "pos", "country": "FR"}   (last three optional)
labels (key = account_id):
    {"event_id": "E1", "account_id": "A1", "terminal_id": "T9", "is_fraud": true,
     "label_ts": "2026-03-04T09:00:00Z"}
scores and alerts (key = account_id), written by the service:
    {"event_id": "E1", "account_id": "A1", "ts": "2026-03-01T12:00:00.250000Z", "score": 0.0213,
     "alert": false, "out_of_order": false, "model_version": "3"}

A message that does not decode raises MessageError with a reason a person can act on; the service sends it
to `dead-letter` with that reason instead of stopping.
"""

import base64
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from json.encoder import encode_basestring_ascii as _json_string
from typing import NamedTuple

import numpy as np

MAX_MESSAGE_BYTES = 64 * 1024
# Timestamps outside this range are typos or unit mix-ups (seconds read as milliseconds), not transactions.
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
LATEST = datetime(2100, 1, 1, tzinfo=UTC)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

TRANSACTION_FIELDS = ("event_id", "account_id", "ts", "amount", "terminal_id")
OPTIONAL_TRANSACTION_FIELDS = ("category", "channel", "country")
LABEL_FIELDS = ("event_id", "account_id", "terminal_id", "is_fraud", "label_ts")


class MessageError(ValueError):
    """A message that cannot be scored; the text is the dead-letter reason."""


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


def format_ts(ts_us: int) -> str:
    seconds, micros = divmod(int(ts_us), 1_000_000)
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{micros:06d}Z"


def parse_ts(value: object, field: str) -> int:
    """ISO-8601 text with a UTC offset (or Z) -> microseconds since the epoch."""
    if not isinstance(value, str):
        raise MessageError(
            f"field {field!r}: expected an ISO-8601 timestamp string, got {type(value).__name__}"
        )
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise MessageError(f"field {field!r}: {value!r} is not an ISO-8601 timestamp") from None
    if parsed.tzinfo is None:
        raise MessageError(f"field {field!r}: {value!r} has no UTC offset; add 'Z' or '+00:00'")
    if not EARLIEST <= parsed < LATEST:
        raise MessageError(f"field {field!r}: {value!r} is outside {EARLIEST.year}..{LATEST.year - 1}")
    delta = parsed - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _object(value: bytes, fields: tuple[str, ...], optional: tuple[str, ...]) -> dict:
    if len(value) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message is {len(value)} bytes; the limit is {MAX_MESSAGE_BYTES}")
    try:
        data = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MessageError(f"not valid UTF-8 JSON: {error}") from None
    if not isinstance(data, dict):
        raise MessageError(f"expected a JSON object, got {type(data).__name__}")
    missing = [f for f in fields if data.get(f) is None]
    if missing:
        raise MessageError(f"missing required field(s): {', '.join(missing)}")
    if len(data) > len(fields):  # the usual message has exactly the required fields
        unknown = sorted(set(data) - set(fields) - set(optional))
        if unknown:
            raise MessageError(
                f"unknown field(s): {', '.join(unknown)}; expected {', '.join(fields + optional)}"
            )
    return data


def _id(data: dict, field: str) -> str:
    value = data[field]
    if not isinstance(value, str) or not value.strip():
        raise MessageError(f"field {field!r}: expected a non-empty string, got {value!r}")
    return value


def decode_transaction(value: bytes) -> Transaction:
    data = _object(value, TRANSACTION_FIELDS, OPTIONAL_TRANSACTION_FIELDS)
    amount = data["amount"]
    if isinstance(amount, bool) or not isinstance(amount, int | float):
        raise MessageError(f"field 'amount': expected a number, got {amount!r}")
    if not math.isfinite(amount) or amount < 0:
        raise MessageError(f"field 'amount': {amount!r} is not a finite amount >= 0")
    optional = [data.get(field) for field in OPTIONAL_TRANSACTION_FIELDS]
    for field, value in zip(OPTIONAL_TRANSACTION_FIELDS, optional, strict=True):
        if value is not None and not isinstance(value, str):
            raise MessageError(f"field {field!r}: expected a string, got {value!r}")
    return Transaction(
        _id(data, "event_id"),
        _id(data, "account_id"),
        parse_ts(data["ts"], "ts"),
        float(amount),
        _id(data, "terminal_id"),
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


def encode_transaction(tx: Transaction) -> bytes:
    data = {
        "event_id": tx.event_id,
        "account_id": tx.account_id,
        "ts": format_ts(tx.ts_us),
        "amount": tx.amount,
        "terminal_id": tx.terminal_id,
    }
    for field in OPTIONAL_TRANSACTION_FIELDS:
        if getattr(tx, field) is not None:
            data[field] = getattr(tx, field)
    return json.dumps(data, separators=(",", ":")).encode("utf-8")


def decode_label(value: bytes) -> Label:
    data = _object(value, LABEL_FIELDS, ())
    if not isinstance(data["is_fraud"], bool):
        raise MessageError(f"field 'is_fraud': expected true or false, got {data['is_fraud']!r}")
    return Label(
        event_id=_id(data, "event_id"),
        account_id=_id(data, "account_id"),
        terminal_id=_id(data, "terminal_id"),
        is_fraud=data["is_fraud"],
        label_ts_us=parse_ts(data["label_ts"], "label_ts"),
    )


def encode_label(label: Label) -> bytes:
    data = {
        "event_id": label.event_id,
        "account_id": label.account_id,
        "terminal_id": label.terminal_id,
        "is_fraud": label.is_fraud,
        "label_ts": format_ts(label.label_ts_us),
    }
    return json.dumps(data, separators=(",", ":")).encode("utf-8")


def encode_score(record, model_version: str) -> bytes:
    """The `scores` message of one scorer ScoreRecord: the reference form of encode_scores."""
    data = {
        "event_id": record.event_id,
        "account_id": record.account_id,
        "ts": format_ts(record.ts_us),
        "score": float(record.score),
        "alert": bool(record.alert),
        "out_of_order": bool(record.out_of_order),
        "model_version": model_version,
    }
    return json.dumps(data, separators=(",", ":")).encode("utf-8")


_JSON_BOOL = {True: "true", False: "false"}


def encode_scores(records: Sequence, model_version: str) -> list[bytes]:
    """encode_score of each record, byte for byte, at ~1.7 µs a record instead of ~10 µs.

    The service writes one per event: the timestamps are formatted in one numpy call and the rest is an
    f-string around json's own C string escaper (ASCII, as json.dumps writes by default).
    """
    if not records:
        return []
    ts_us = np.fromiter((r.ts_us for r in records), dtype=np.int64, count=len(records))
    stamps = np.datetime_as_string(ts_us.astype("datetime64[us]"), unit="us").tolist()
    version = _json_string(model_version)
    return [
        (
            f'{{"event_id":{_json_string(r.event_id)},"account_id":{_json_string(r.account_id)},'
            f'"ts":"{ts}Z","score":{float(r.score)!r},"alert":{_JSON_BOOL[bool(r.alert)]},'
            f'"out_of_order":{_JSON_BOOL[bool(r.out_of_order)]},"model_version":{version}}}'
        ).encode()
        for r, ts in zip(records, stamps, strict=True)
    ]


def dead_letter_value(record, error: MessageError) -> bytes:
    # The original bytes travel base64-encoded: they may not be UTF-8, let alone JSON.
    return json.dumps(
        {
            "reason": str(error),
            "source_topic": record.topic,
            "source_partition": record.partition,
            "source_offset": record.offset,
            "value_base64": None if record.value is None else base64.b64encode(record.value).decode(),
        },
        separators=(",", ":"),
    ).encode()
