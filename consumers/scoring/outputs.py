"""What the service writes: the `scores` and `alerts` messages (one per scored event; alerts are the scores at
or above the threshold) and the `dead-letter` records. Their JSON Schemas: consumers/scoring/topic_schemas.py.

scores and alerts (key = account_id):
    {"event_id": "E1", "account_id": "A1", "ts": "2026-03-01T12:00:00.250000Z", "score": 0.0213,
     "alert": false, "out_of_order": false, "model_version": "models:/txsentinel/3"}
    (ts as epoch milliseconds, 1772366400250, with timestamp_format = epoch_ms)
dead-letter (key = the input record's key):
    {"reason": "...", "source_topic": "transactions", "source_partition": 0, "source_offset": 41,
     "value_base64": "eyJldmVudF9pZCI6..."}
    (a record over DEAD_LETTER_VALUE_BYTES: its start, and "value_truncated": true, "value_bytes",
    "value_sha256"; a key over DEAD_LETTER_KEY_BYTES: cut, and "key_truncated", "key_bytes", "key_sha256")
"""

import base64
import hashlib
import json
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii as _json_string

import numpy as np

from consumers.scoring.message_limits import MessageError, format_ts


def encode_score(record, model_version: str, timestamp_format: str = "iso8601") -> bytes:
    """The `scores` message of one scorer ScoreRecord: the reference form of encode_scores."""
    data = {
        "event_id": record.event_id,
        "account_id": record.account_id,
        "ts": record.ts_us // 1000 if timestamp_format == "epoch_ms" else format_ts(record.ts_us),
        "score": float(record.score),
        "alert": bool(record.alert),
        "out_of_order": bool(record.out_of_order),
        "model_version": model_version,
    }
    return json.dumps(data, separators=(",", ":")).encode("utf-8")


_JSON_BOOL = {True: "true", False: "false"}


def encode_scores(records: Sequence, model_version: str, timestamp_format: str = "iso8601") -> list[bytes]:
    """encode_score of each record, byte for byte, at ~1.7 µs a record instead of ~10 µs.

    The service writes one per event: the timestamps are formatted in one numpy call and the rest is an
    f-string around json's own C string escaper (ASCII, as json.dumps writes by default).
    """
    if not records:
        return []
    ts_us = np.fromiter((r.ts_us for r in records), dtype=np.int64, count=len(records))
    if timestamp_format == "epoch_ms":
        stamps = (ts_us // 1000).tolist()
    else:
        stamps = [
            f'"{s}Z"' for s in np.datetime_as_string(ts_us.astype("datetime64[us]"), unit="us").tolist()
        ]
    version = _json_string(model_version)
    return [
        (
            f'{{"event_id":{_json_string(r.event_id)},"account_id":{_json_string(r.account_id)},'
            f'"ts":{ts},"score":{float(r.score)!r},"alert":{_JSON_BOOL[bool(r.alert)]},'
            f'"out_of_order":{_JSON_BOOL[bool(r.out_of_order)]},"model_version":{version}}}'
        ).encode()
        for r, ts in zip(records, stamps, strict=True)
    ]


# The most of an input record's value, key and reason a dead letter carries: base64 makes 699,052 characters
# of the value, the key is at most 16 KiB, the reason at most 8,192 characters (98,304 bytes of JSON, 12 an
# astral character), so a dead letter stays under Kafka's default record limit of 1 MB (the producer's
# max_request_size and the topic's max.message.bytes) whatever came in, even where a topic takes bigger
# records. A record the producer refuses to send would fail its batch, and the batch after it, until the
# service stopped. A key that is an account id (at most max_id_chars, 4,096, of at most 4 bytes) is never cut.
DEAD_LETTER_VALUE_BYTES = 512 * 1024
DEAD_LETTER_KEY_BYTES = 16 * 1024
DEAD_LETTER_REASON_CHARS = 8_192


def dead_letter(record, error: MessageError) -> tuple[bytes | None, bytes]:
    """(key, value) of the dead letter of an input `record` refused for `error`: the record's key, and its
    value base64-encoded (it may not be UTF-8, let alone JSON) with where it came from and why. A value or
    key over its bound above travels cut to it, marked so, with its whole length and SHA-256 (a reason is
    cut, saying its length); the record itself stays at its source offset, for the topic's retention."""
    value, key, reason = record.value, record.key, str(error)
    if len(reason) > DEAD_LETTER_REASON_CHARS:  # a reason quotes ids and values, which settings may make long
        reason = f"{reason[: DEAD_LETTER_REASON_CHARS - 40]}... ({len(reason):,} characters in all)"
    letter = {
        "reason": reason,
        "source_topic": record.topic,
        "source_partition": record.partition,
        "source_offset": record.offset,
        "value_base64": None if value is None else base64.b64encode(value[:DEAD_LETTER_VALUE_BYTES]).decode(),
    }
    if value is not None and len(value) > DEAD_LETTER_VALUE_BYTES:
        letter |= _cut("value", value)
    if key is not None and len(key) > DEAD_LETTER_KEY_BYTES:
        letter |= _cut("key", key)
        key = key[:DEAD_LETTER_KEY_BYTES]
    return key, json.dumps(letter, separators=(",", ":")).encode()


def _cut(what: str, data: bytes) -> dict:
    return {
        f"{what}_truncated": True,
        f"{what}_bytes": len(data),
        f"{what}_sha256": hashlib.sha256(data).hexdigest(),
    }
