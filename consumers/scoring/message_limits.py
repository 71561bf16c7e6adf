"""What a valid value in an input message is: the limits (settings), timestamps in either form, ids and
amounts; every check raises MessageError, whose text is the dead-letter reason (consumers/scoring/messages.py
applies them to whole messages)."""

import dataclasses
import math
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from models.checks import is_finite_number, is_integer, is_number
from pipeline.data.ids import MAX_ID_CHARS, unseen_character
from pipeline.data.schema import MAX_AMOUNT

MAX_MESSAGE_BYTES = 64 * 1024
# A timestamp before earliest_ts (by default this one) or from 2100 on is a typo or a unit mix-up (seconds
# read as milliseconds), not a transaction.
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
LATEST = datetime(2100, 1, 1, tzinfo=UTC)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
DAY_US = 86_400_000_000
LATEST_US = (LATEST - _EPOCH) // datetime.resolution
# A timestamp string, whole (the schemas anchor it; parse_ts matches it in full): RFC 3339's date-time (the
# schemas' "format"), a space allowed for the T, a decimal comma for the point, a fraction of up to 9 digits
# (kept to the microsecond) and an offset with or without its colon. What datetime.fromisoformat takes beyond
# that (any character as the separator, an offset of hours only, whatever follows a NUL) is not a time a
# producer means to send.
ISO_TS_PATTERN = (
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}([.,][0-9]{1,9})?([Zz]|[+-][0-9]{2}:?[0-9]{2})"
)
_ISO_TS = re.compile(ISO_TS_PATTERN)
_SHOWN_CHARS = 80  # of a bad value, in a reason: enough to find it, never the whole 64 KiB

UNKNOWN_FIELDS = ("ignore", "refuse")
# iso8601: "2026-03-01T12:00:00.250Z" (an offset is required); epoch_ms: 1772366400250 (a JSON integer)
TIMESTAMP_FORMATS = ("iso8601", "epoch_ms")


class MessageError(ValueError):
    """A message that cannot be scored; the text is the dead-letter reason."""


@dataclass(frozen=True)
class MessageLimits:
    """What a valid message is (consumers/scoring/messages.py's docstring). The service builds one from its
    settings (ServeConfig holds the same names, with these defaults: a test holds the two to each other)."""

    max_message_bytes: int = MAX_MESSAGE_BYTES
    # The formats are flat objects (depth 1); nesting beyond this is refused before the parser sees it.
    max_json_depth: int = 8
    max_id_chars: int = MAX_ID_CHARS
    max_amount: float = 1e9
    earliest_ts: str = "2000-01-01T00:00:00+00:00"  # ISO-8601 with an offset
    # how far a ts may be after the decoder's clock, and a label_ts after its record's timestamp
    max_ts_skew_s: float = 3600.0
    unknown_fields: str = "ignore"  # fields of no known name: "ignore" (counted) or "refuse" (dead letter)
    timestamp_format: str = "iso8601"  # of ts and label_ts in, and of ts out: "iso8601" or "epoch_ms"
    earliest_us: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for name, least, most in (
            # What the service writes must pass Kafka's default 1 MB record limit (the producer's
            # max_request_size, a topic's max.message.bytes): a record written again whole (key_mismatch:
            # rekey), and a score, an alert or a dead letter holding ids, up to 12 bytes a character in JSON.
            ("max_message_bytes", 64, 1_000_000),
            ("max_json_depth", 1, 64),  # the parser recurses once a level: kept far from the stack's limit
            ("max_id_chars", 1, 4_096),
        ):
            value = getattr(self, name)
            if not is_integer(value) or not least <= value <= most:
                raise ValueError(f"{name} = {value!r}: expected an integer in {least}..{most}")
        for name, value in (("max_amount", self.max_amount), ("max_ts_skew_s", self.max_ts_skew_s)):
            if not is_finite_number(value) or not value > 0:
                raise ValueError(f"{name} = {value!r}: expected a finite number > 0")
        if self.max_amount > MAX_AMOUNT:
            # The features of any history stay finite, and a state record's sums within the bounds its restore
            # checks (pipeline/data/schema.py).
            raise ValueError(f"max_amount = {self.max_amount!r}: expected at most {MAX_AMOUNT:g}")
        for name, choices in (("unknown_fields", UNKNOWN_FIELDS), ("timestamp_format", TIMESTAMP_FORMATS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} = {getattr(self, name)!r}: expected one of {', '.join(choices)}")
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
        return self.earliest_us // DAY_US, int(now_us + self.max_ts_skew_s * 1_000_000) // DAY_US


class _Unbounded:
    # The bounds parse_ts applies to the limits' own earliest_ts: only the fixed range 2000..2099.
    earliest_us = (EARLIEST - _EPOCH) // datetime.resolution
    max_ts_skew_s = math.inf


_UNBOUNDED = _Unbounded()


def now_us() -> int:
    """The clock the future bound is read against: microseconds since the epoch."""
    return time.time_ns() // 1000


def format_ts(ts_us: int) -> str:
    seconds, micros = divmod(int(ts_us), 1_000_000)
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{micros:06d}Z"


def show(value: object) -> str:
    """repr of a bad value for a reason, cut to _SHOWN_CHARS."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} characters)"


def cut(text: str) -> str:
    return text if len(text) <= 2 * _SHOWN_CHARS else f"{text[: 2 * _SHOWN_CHARS]}..."


def read_ts(
    value: object, field: str, limits: MessageLimits, now: int | None = None, sent_us: int | None = None
) -> int:
    """A ts or label_ts in the limits' timestamp_format -> microseconds since the epoch, within bounds."""
    if limits.timestamp_format == "epoch_ms":
        return parse_epoch_ms(value, field, limits, now, sent_us)
    return parse_ts(value, field, limits, now, sent_us)


def parse_epoch_ms(
    value: object, field: str, limits=None, now: int | None = None, sent_us: int | None = None
) -> int:
    """Milliseconds since the epoch, a JSON integer -> microseconds, within parse_ts's bounds."""
    if not is_integer(value):
        raise MessageError(
            f"field {field!r}: expected epoch milliseconds (an integer; setting timestamp_format = epoch_ms), "
            f"got {show(value)}"
        )
    if not -(2**62) < value < 2**62:  # an integer beyond int64: out of range whatever the bounds
        raise MessageError(f"field {field!r}: {show(value)} is not epoch milliseconds in 2000..2099")
    return _bounded(value * 1000, value, field, DEFAULT_LIMITS if limits is None else limits, now, sent_us)


def parse_ts(
    value: object, field: str, limits=None, now: int | None = None, sent_us: int | None = None
) -> int:
    """ISO-8601 text with a UTC offset (or Z) -> microseconds since the epoch, not before the limits'
    earliest_ts (2000 by default), before 2100, nor after `now` (default: the clock) + max_ts_skew_s.

    `sent_us`: the timestamp of the Kafka record the value came in, microseconds since the epoch. Given, the
    future bound is read against it instead of a clock: the same for every reader of the record."""
    limits = DEFAULT_LIMITS if limits is None else limits
    if not isinstance(value, str):
        raise MessageError(
            f"field {field!r}: expected an ISO-8601 timestamp string, got {type(value).__name__} (epoch "
            "milliseconds are read with the setting timestamp_format = epoch_ms)"
        )
    if not _ISO_TS.fullmatch(value):
        if _ISO_TS.fullmatch(value + "Z"):
            raise MessageError(f"field {field!r}: {show(value)} has no UTC offset; add 'Z' or '+00:00'")
        raise MessageError(
            f"field {field!r}: {show(value)} is not an ISO-8601 timestamp with a UTC offset (expected "
            "YYYY-MM-DDTHH:MM:SS, an optional fraction, then Z or +HH:MM, e.g. 2026-03-01T12:00:00.250Z)"
        )
    try:
        delta = datetime.fromisoformat(value.upper()) - _EPOCH  # aware: any offset, in UTC; 't', 'z' allowed
    except (ValueError, OverflowError):  # a month 13, a 25th hour, a leap second
        raise MessageError(
            f"field {field!r}: {show(value)} is not an ISO-8601 timestamp: no such date or time"
        ) from None
    return _bounded(
        (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds,
        value,
        field,
        limits,
        now,
        sent_us,
    )


def _bounded(ts_us: int, value: object, field: str, limits, now: int | None, sent_us: int | None) -> int:
    if not limits.earliest_us <= ts_us < LATEST_US:
        earliest = format_ts(limits.earliest_us)
        raise MessageError(
            f"field {field!r}: {show(value)} is outside {earliest[:4]}..{LATEST.year - 1}: earliest "
            f"accepted {earliest} (setting earliest_ts)"
        )
    if not math.isfinite(limits.max_ts_skew_s):
        return ts_us
    skew_us = limits.max_ts_skew_s * 1_000_000
    if sent_us is not None:
        if ts_us > sent_us + skew_us:
            raise MessageError(
                f"field {field!r}: {show(value)} is {(ts_us - sent_us) / 1e6:.0f} s after the timestamp of its "
                f"record ({format_ts(sent_us)}): more than max_ts_skew_s = {limits.max_ts_skew_s:g}. A record "
                "is sent once what it says is known; judged by its record, every reader refuses it alike"
            )
        return ts_us
    now = now_us() if now is None else now
    if ts_us > now + skew_us:
        raise MessageError(
            f"field {field!r}: {show(value)} is {(ts_us - now) / 1e6:.0f} s in the future: more "
            f"than max_ts_skew_s = {limits.max_ts_skew_s:g} after this instance's clock "
            f"({format_ts(now)}); a future event would move its account's and terminal's day forward"
        )
    return ts_us


def text(value: object, field: str, limits, required: bool = True) -> str:
    """An id or optional text: a string of at most max_id_chars printable, visible characters."""
    if not isinstance(value, str) or (required and not value.strip()):
        what = "a non-empty string" if required else "a string"
        raise MessageError(f"field {field!r}: expected {what}, got {show(value)}")
    if len(value) > limits.max_id_chars:
        raise MessageError(
            f"field {field!r}: {len(value)} characters; the limit is {limits.max_id_chars} (setting max_id_chars)"
        )
    if unseen := unseen_character(value):  # pipeline/data/ids.py: the rule ingest keeps too
        raise MessageError(f"field {field!r}: {show(value)} holds {unseen}")
    return value


def amount(value: object, limits) -> float:
    if not is_number(value):
        raise MessageError(f"field 'amount': expected a number, got {show(value)}")
    # Compared before float(): an integer beyond the float range compares exactly, float() would raise.
    if (isinstance(value, float) and not math.isfinite(value)) or value < 0:
        raise MessageError(f"field 'amount': {show(value)} is not a finite amount >= 0")
    if value > limits.max_amount:
        raise MessageError(
            f"field 'amount': {show(value)} is above max_amount = {limits.max_amount:g} (setting max_amount)"
        )
    return float(value) + 0.0  # -0.0 -> 0.0


DEFAULT_LIMITS = MessageLimits()  # what a decoder given no limits checks against
