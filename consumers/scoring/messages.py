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

The decoders are total: for ANY bytes, decode_transaction and decode_label return a valid event or raise
MessageError, whose text is the reason a person can act on; the service sends such a message to
`dead-letter` with that reason instead of stopping. What a valid event is, within MessageLimits:
- at most `max_message_bytes` of UTF-8 JSON (NaN and Infinity are not JSON), nested at most
  `max_json_depth` deep (checked before parsing: the parser recurses), one object with the required fields
  and no unknown ones, each named once (readers disagree on which of two values counts);
- ids (event, account, terminal) and the optional texts of at most `max_id_chars` printable characters:
  no control, format or surrogate characters (a lone surrogate does not encode to UTF-8), no separators
  but the space;
- an amount that is a finite number, >= 0 and <= `max_amount`: an amount near the float maximum overflows
  the sums of the features;
- timestamps (ts, label_ts) with a UTC offset, not before `earliest_ts` and not after now +
  `max_ts_skew_s`: one far-future event would move its account's and its terminal's day forward for good.
"""

import base64
import dataclasses
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from json.encoder import encode_basestring_ascii as _json_string
from typing import NamedTuple

import numpy as np

from consumers.scoring.json_text import json_depth, parse_json

MAX_MESSAGE_BYTES = 64 * 1024
# A timestamp before earliest_ts (by default this one) or from 2100 on is a typo or a unit mix-up (seconds
# read as milliseconds), not a transaction.
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
LATEST = datetime(2100, 1, 1, tzinfo=UTC)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_DAY_US = 86_400_000_000
_SHOWN_CHARS = 80  # of a bad value, in a reason: enough to find it, never the whole 64 KiB

TRANSACTION_FIELDS = ("event_id", "account_id", "ts", "amount", "terminal_id")
OPTIONAL_TRANSACTION_FIELDS = ("category", "channel", "country")
LABEL_FIELDS = ("event_id", "account_id", "terminal_id", "is_fraud", "label_ts")


class MessageError(ValueError):
    """A message that cannot be scored; the text is the dead-letter reason."""


@dataclass(frozen=True)
class MessageLimits:
    """What a valid message is (module docstring). The service builds one from its settings (ServeConfig
    holds the same names, with these defaults: a test holds the two to each other)."""

    max_message_bytes: int = MAX_MESSAGE_BYTES
    # The formats are flat objects (depth 1); nesting beyond this is refused before the parser sees it.
    max_json_depth: int = 8
    max_id_chars: int = 256
    max_amount: float = 1e9
    earliest_ts: str = "2000-01-01T00:00:00+00:00"  # ISO-8601 with an offset
    max_ts_skew_s: float = 3600.0  # how far after the decoder's clock a ts or label_ts may be
    earliest_us: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for name, least, most in (
            ("max_message_bytes", 64, 16 * 1024 * 1024),
            ("max_json_depth", 1, 64),  # the parser recurses once a level: kept far from the stack's limit
            ("max_id_chars", 1, 65_536),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= most:
                raise ValueError(f"{name} = {value!r}: expected an integer in {least}..{most}")
        for name, value in (("max_amount", self.max_amount), ("max_ts_skew_s", self.max_ts_skew_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"{name} = {value!r}: expected a finite number > 0")
        if self.max_amount > 1e15:
            # 2**31 events a day at this amount still sum far from the float maximum, and log1p keeps its
            # precision: the features of any history stay finite.
            raise ValueError(f"max_amount = {self.max_amount!r}: expected at most 1e15")
        try:
            earliest = parse_ts(self.earliest_ts, "earliest_ts", _UNBOUNDED)
        except MessageError as error:
            raise ValueError(str(error)) from None
        object.__setattr__(self, "earliest_us", earliest)

    @classmethod
    def of(cls, settings) -> "MessageLimits":
        """The limits held by an object with the same setting names (ServeConfig)."""
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls) if f.init})

    def days(self, now_us: int) -> tuple[int, int]:
        """The first and last epoch day a ts or label_ts may fall on, read at `now_us`."""
        return self.earliest_us // _DAY_US, int(now_us + self.max_ts_skew_s * 1_000_000) // _DAY_US


class _Unbounded:
    # The bounds parse_ts applies to the limits' own earliest_ts: only the fixed range 2000..2099.
    earliest_us = (EARLIEST - _EPOCH) // datetime.resolution
    max_ts_skew_s = math.inf


_UNBOUNDED = _Unbounded()


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


def _now_us() -> int:
    """The clock the future bound is read against: microseconds since the epoch."""
    return time.time_ns() // 1000


def format_ts(ts_us: int) -> str:
    seconds, micros = divmod(int(ts_us), 1_000_000)
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{micros:06d}Z"


def _show(value: object) -> str:
    """repr of a bad value for a reason, cut to _SHOWN_CHARS."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} characters)"


def parse_ts(value: object, field: str, limits=None, now_us: int | None = None) -> int:
    """ISO-8601 text with a UTC offset (or Z) -> microseconds since the epoch, not before the limits'
    earliest_ts (2000 by default), before 2100, nor after now_us (default: the clock) + max_ts_skew_s."""
    limits = _DEFAULT_LIMITS if limits is None else limits
    if not isinstance(value, str):
        raise MessageError(
            f"field {field!r}: expected an ISO-8601 timestamp string, got {type(value).__name__}"
        )
    try:
        parsed = datetime.fromisoformat(value)
        if parsed.tzinfo is None:
            raise MessageError(f"field {field!r}: {_show(value)} has no UTC offset; add 'Z' or '+00:00'")
        delta = parsed - _EPOCH  # aware: any offset, in UTC
    except (ValueError, OverflowError) as error:
        if isinstance(error, MessageError):
            raise
        raise MessageError(f"field {field!r}: {_show(value)} is not an ISO-8601 timestamp") from None
    ts_us = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    if not limits.earliest_us <= ts_us < _LATEST_US:
        earliest = format_ts(limits.earliest_us)
        raise MessageError(
            f"field {field!r}: {_show(value)} is outside {earliest[:4]}..{LATEST.year - 1}: earliest "
            f"accepted {earliest} (setting earliest_ts)"
        )
    if math.isfinite(limits.max_ts_skew_s):
        now_us = _now_us() if now_us is None else now_us
        if ts_us > now_us + limits.max_ts_skew_s * 1_000_000:
            raise MessageError(
                f"field {field!r}: {_show(value)} is {(ts_us - now_us) / 1e6:.0f} s in the future: more "
                f"than max_ts_skew_s = {limits.max_ts_skew_s:g} after this instance's clock "
                f"({format_ts(now_us)}); a future event would move its account's and terminal's day forward"
            )
    return ts_us


_LATEST_US = (LATEST - _EPOCH) // datetime.resolution
_DEFAULT_LIMITS = MessageLimits()


def _object(value: bytes, fields: tuple[str, ...], optional: tuple[str, ...], limits) -> dict:
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
        raise MessageError(f"not valid UTF-8 JSON: {_cut(str(error))}") from None
    if not isinstance(data, dict):
        raise MessageError(f"expected a JSON object, got {type(data).__name__}")
    missing = [f for f in fields if data.get(f) is None]
    if missing:
        raise MessageError(f"missing required field(s): {', '.join(missing)}")
    if len(data) > len(fields):  # the usual message has exactly the required fields
        unknown = sorted(set(data) - set(fields) - set(optional))
        if unknown:
            shown = _cut(", ".join(name if name.isprintable() else repr(name) for name in unknown))
            raise MessageError(f"unknown field(s): {shown}; expected {', '.join(fields + optional)}")
    return data


def _cut(text: str) -> str:
    return text if len(text) <= 2 * _SHOWN_CHARS else f"{text[: 2 * _SHOWN_CHARS]}..."


def _text(value: object, field: str, limits, required: bool = True) -> str:
    """An id or optional text: a string of at most max_id_chars printable characters (module docstring)."""
    if not isinstance(value, str) or (required and not value.strip()):
        what = "a non-empty string" if required else "a string"
        raise MessageError(f"field {field!r}: expected {what}, got {_show(value)}")
    if len(value) > limits.max_id_chars:
        raise MessageError(
            f"field {field!r}: {len(value)} characters; the limit is {limits.max_id_chars} (setting max_id_chars)"
        )
    if not value.isprintable():  # C speed; only a refused value pays for the search below
        bad = next(c for c in value if not c.isprintable())
        kind = (
            "a lone surrogate, which UTF-8 cannot encode" if 0xD800 <= ord(bad) <= 0xDFFF else "not printable"
        )
        raise MessageError(f"field {field!r}: {_show(value)} holds U+{ord(bad):04X}, {kind}")
    return value


def _amount(amount: object, limits) -> float:
    if isinstance(amount, bool) or not isinstance(amount, int | float):
        raise MessageError(f"field 'amount': expected a number, got {_show(amount)}")
    # Compared before float(): an integer beyond the float range compares exactly, float() would raise.
    if (isinstance(amount, float) and not math.isfinite(amount)) or amount < 0:
        raise MessageError(f"field 'amount': {_show(amount)} is not a finite amount >= 0")
    if amount > limits.max_amount:
        raise MessageError(
            f"field 'amount': {_show(amount)} is above max_amount = {limits.max_amount:g} (setting max_amount)"
        )
    return float(amount) + 0.0  # -0.0 -> 0.0


def decode_transaction(
    value: bytes, limits: MessageLimits | None = None, now_us: int | None = None
) -> Transaction:
    """A valid transaction, or MessageError with the reason (module docstring: what is valid). `now_us`:
    the clock the future bound is read against, microseconds since the epoch (default: time.time)."""
    limits = _DEFAULT_LIMITS if limits is None else limits
    data = _object(value, TRANSACTION_FIELDS, OPTIONAL_TRANSACTION_FIELDS, limits)
    amount = _amount(data["amount"], limits)
    optional = [data.get(field) for field in OPTIONAL_TRANSACTION_FIELDS]
    for field, text in zip(OPTIONAL_TRANSACTION_FIELDS, optional, strict=True):
        if text is not None:
            _text(text, field, limits, required=False)
    return Transaction(
        _text(data["event_id"], "event_id", limits),
        _text(data["account_id"], "account_id", limits),
        parse_ts(data["ts"], "ts", limits, now_us),
        amount,
        _text(data["terminal_id"], "terminal_id", limits),
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


def decode_label(value: bytes, limits: MessageLimits | None = None, now_us: int | None = None) -> Label:
    """A valid label, or MessageError with the reason: decode_transaction's rules for its ids and label_ts."""
    limits = _DEFAULT_LIMITS if limits is None else limits
    data = _object(value, LABEL_FIELDS, (), limits)
    if not isinstance(data["is_fraud"], bool):
        raise MessageError(f"field 'is_fraud': expected true or false, got {_show(data['is_fraud'])}")
    return Label(
        event_id=_text(data["event_id"], "event_id", limits),
        account_id=_text(data["account_id"], "account_id", limits),
        terminal_id=_text(data["terminal_id"], "terminal_id", limits),
        is_fraud=data["is_fraud"],
        label_ts_us=parse_ts(data["label_ts"], "label_ts", limits, now_us),
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
