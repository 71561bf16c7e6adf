"""The topics' contracts as JSON Schema (draft 2020-12), generated from the decoders' and encoders' own field
lists and limits, so the files cannot drift from the code: `txsentinel schemas --out DIR` writes them for a
deployment's settings, and the package ships those of the defaults in consumers/scoring/schemas/ (a test
holds the two equal).

A schema says what JSON Schema can: fields, types, lengths and ranges. The decoder checks a little more,
each documented in the field's description: ids of printable, visible characters, a ts within max_ts_skew_s
of the instance's clock, a label_ts within max_ts_skew_s of its record's timestamp.
"""

import json
from pathlib import Path

from consumers.scoring.message_limits import ISO_TS_PATTERN, LATEST_US, MessageLimits
from consumers.scoring.messages import LABEL_FIELDS, OPTIONAL_TRANSACTION_FIELDS, TRANSACTION_FIELDS
from consumers.scoring.outputs import DEAD_LETTER_KEY_BYTES, DEAD_LETTER_VALUE_BYTES

SHIPPED_DIR = Path(__file__).resolve().parent / "schemas"
TOPICS = ("transactions", "labels", "scores", "alerts", "dead-letter")
DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _id(limits: MessageLimits, description: str) -> dict:
    return {
        "type": "string",
        "minLength": 1,
        "maxLength": limits.max_id_chars,
        "pattern": r"\S",
        "description": f"{description}; printable, visible characters only (no control or format characters, "
        f"none that prints as nothing), at most max_id_chars = {limits.max_id_chars}",
    }


def _ts(limits: MessageLimits, what: str, after: str = "the reading instance's clock") -> dict:
    if limits.timestamp_format == "epoch_ms":
        return {
            "type": "integer",
            "minimum": -(-limits.earliest_us // 1000),
            "exclusiveMaximum": LATEST_US // 1000,
            "description": f"{what}: milliseconds since 1970-01-01T00:00:00Z (timestamp_format = epoch_ms), "
            f"not before earliest_ts = {limits.earliest_ts}, before 2100 and at most max_ts_skew_s = "
            f"{limits.max_ts_skew_s:g} s after {after}",
        }
    return {
        "type": "string",
        "format": "date-time",
        "pattern": f"^{ISO_TS_PATTERN}$",
        "description": f"{what}: ISO-8601 with a UTC offset or Z (timestamp_format = iso8601), not before "
        f"earliest_ts = {limits.earliest_ts}, before 2100 and at most max_ts_skew_s = "
        f"{limits.max_ts_skew_s:g} s after {after}",
    }


def _input(title: str, properties: dict, required: tuple[str, ...], limits: MessageLimits) -> dict:
    ignored = limits.unknown_fields == "ignore"
    return {
        "$schema": DIALECT,
        "title": title,
        "description": "Key: the account_id, UTF-8. At most max_message_bytes = "
        f"{limits.max_message_bytes} bytes of UTF-8 JSON. Other fields are "
        + (
            "ignored and counted (unknown_fields = ignore)."
            if ignored
            else "refused (unknown_fields = refuse)."
        ),
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": ignored,
    }


def transactions_schema(limits: MessageLimits) -> dict:
    properties = {
        "event_id": _id(limits, "unique per event; an event_id its account has seen is not applied again"),
        "account_id": _id(limits, "the account; the record key must equal it (key_mismatch)"),
        "ts": _ts(limits, "when the transaction happened"),
        "amount": {
            "type": "number",
            "minimum": 0,
            "maximum": limits.max_amount,
            "description": f"a finite amount, 0 to max_amount = {limits.max_amount:g}",
        },
        "terminal_id": _id(limits, "the terminal or merchant"),
    }
    for name in OPTIONAL_TRANSACTION_FIELDS:
        properties[name] = {
            "type": ["string", "null"],
            "maxLength": limits.max_id_chars,
            "description": f"optional {name}; printable, visible characters only",
        }
    assert tuple(properties) == TRANSACTION_FIELDS + OPTIONAL_TRANSACTION_FIELDS
    return _input("txsentinel transactions", properties, TRANSACTION_FIELDS, limits)


def labels_schema(limits: MessageLimits) -> dict:
    properties = {
        "event_id": _id(limits, "the labelled transaction's event_id"),
        "account_id": _id(limits, "the labelled transaction's account"),
        "terminal_id": _id(limits, "the labelled transaction's terminal"),
        "is_fraud": {"type": "boolean", "description": "the verdict"},
        "label_ts": _ts(
            limits,
            "when the verdict became known (chargebacks arrive late)",
            "the timestamp of its Kafka record",
        ),
    }
    assert tuple(properties) == LABEL_FIELDS
    return _input("txsentinel labels", properties, LABEL_FIELDS, limits)


def scores_schema(limits: MessageLimits, alerts: bool = False) -> dict:
    score = {
        "event_id": {"type": "string", "description": "the scored transaction's event_id"},
        "account_id": {"type": "string", "description": "the scored transaction's account"},
        "ts": _ts(limits, "the scored transaction's ts") | {"description": "the scored transaction's ts"},
        "score": {"type": "number", "minimum": 0, "maximum": 1, "description": "the probability of fraud"},
        "alert": {
            "type": "boolean",
            "description": "score >= the alert threshold (the model's, or threshold)",
        },
        "out_of_order": {
            "type": "boolean",
            "description": "ts older than the newest ts its account had already seen; scored all the same",
        },
        "model_version": {"type": "string", "description": "the version of the model that scored it"},
    }
    required = list(score)
    if alerts:
        score["alert"] = {"const": True, "description": "alerts are the scores at or above the threshold"}
        score.update(_reasons())
    what = "alerts: the scores at or above the alert threshold, as on scores" if alerts else "scores"
    return {
        "$schema": DIALECT,
        "title": f"txsentinel {'alerts' if alerts else 'scores'}",
        "description": f"Written by the service ({what}), one per scored transaction, in one Kafka "
        "transaction with the input offsets: read with isolation.level=read_committed. Key: the account_id.",
        "type": "object",
        "properties": score,
        "required": required,
        "additionalProperties": False,
    }


def _reasons() -> dict:
    """An alert's explanation (pipeline/features/reasons.py), present unless alert_reasons = 0."""
    term = {
        "type": "object",
        "properties": {
            "input": {
                "type": "string",
                "description": "the input: amount, gap, new_terminal, ... or history",
            },
            "text": {"type": "string", "description": "the reason in words an analyst reads"},
            "logit": {"type": "number", "description": "what it adds to the event's logit"},
        },
        "required": ["input", "text", "logit"],
        "additionalProperties": False,
    }
    return {
        "reasons": {
            "type": "array",
            "items": term,
            "description": "the inputs that raised the score most, largest first (at most alert_reasons)",
        },
        "history": term | {"description": "what the account's history (its recurrent state) adds"},
        "base_logit": {
            "type": "number",
            "description": "the logit of an average event of an account with no history, which the terms add to",
        },
    }


def _cut_fields(what: str, holder: str) -> dict:
    # The fields a dead letter adds for an input value or key too long to carry whole.
    return {
        f"{what}_truncated": {
            "const": True,
            "description": f"present when the record's {what} was longer than a dead letter carries: {holder} "
            f"holds its start, {what}_bytes and {what}_sha256 describe the whole",
        },
        f"{what}_bytes": {"type": "integer", "minimum": 0, "description": f"the whole {what}'s length"},
        f"{what}_sha256": {
            "type": "string",
            "pattern": "^[0-9a-f]{64}$",
            "description": f"the whole {what}'s SHA-256, hex",
        },
    }


def dead_letter_schema() -> dict:
    return {
        "$schema": DIALECT,
        "title": "txsentinel dead-letter",
        "description": "An input record the service could not score, and why. Key: the input record's key "
        f"(its first {DEAD_LETTER_KEY_BYTES:,} bytes when key_truncated).",
        "type": "object",
        "properties": {
            "reason": {"type": "string", "minLength": 1, "description": "what was wrong, and where"},
            "source_topic": {"type": "string", "description": "the input topic (transactions or labels)"},
            "source_partition": {"type": "integer", "minimum": 0},
            "source_offset": {"type": "integer", "minimum": 0},
            "value_base64": {
                "type": ["string", "null"],
                "contentEncoding": "base64",
                "description": f"the input record's value, byte for byte (its first {DEAD_LETTER_VALUE_BYTES:,} "
                "bytes when value_truncated); null for a tombstone",
            },
            **_cut_fields("value", "value_base64"),
            **_cut_fields("key", f"the record's key (cut to its first {DEAD_LETTER_KEY_BYTES:,} bytes)"),
        },
        "required": ["reason", "source_topic", "source_partition", "source_offset", "value_base64"],
        "dependentRequired": {
            "value_truncated": ["value_bytes", "value_sha256"],
            "key_truncated": ["key_bytes", "key_sha256"],
        },
        "additionalProperties": False,
    }


def topic_schemas(limits: MessageLimits | None = None) -> dict[str, dict]:
    """{topic: its JSON Schema} under `limits` (the serve settings' message limits; default: the defaults)."""
    limits = MessageLimits() if limits is None else limits
    return {
        "transactions": transactions_schema(limits),
        "labels": labels_schema(limits),
        "scores": scores_schema(limits),
        "alerts": scores_schema(limits, alerts=True),
        "dead-letter": dead_letter_schema(),
    }


def schema_text(schema: dict) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def write_schemas(out: Path, limits: MessageLimits | None = None) -> list[Path]:
    """Write `<topic>.schema.json` for every topic into `out`; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for topic, schema in topic_schemas(limits).items():
        path = out / f"{topic}.schema.json"
        path.write_text(schema_text(schema))
        written.append(path)
    return written


def shipped_schemas() -> dict[str, dict]:
    """The schemas that ship with the package (the defaults'), read from consumers/scoring/schemas/."""
    return {topic: json.loads((SHIPPED_DIR / f"{topic}.schema.json").read_text()) for topic in TOPICS}
