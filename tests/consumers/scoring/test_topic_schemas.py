"""The topics' JSON Schemas: the shipped files are what the code generates, every message the decoders accept
is valid under them (for any near-miss message, in either timestamp format), and what the service writes for
a batch of good and hostile input is valid under them. The service against the real broker, from the
installed wheel: tests/test_packaging.py."""

import base64
import hashlib
import json
import time

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers.scoring.message_limits import MessageError, MessageLimits, format_ts
from consumers.scoring.messages import (
    Label,
    Transaction,
    decode_label,
    decode_transaction,
    encode_label,
    encode_transaction,
)
from consumers.scoring.outputs import DEAD_LETTER_KEY_BYTES, DEAD_LETTER_VALUE_BYTES
from consumers.scoring.topic_schemas import SHIPPED_DIR, TOPICS, shipped_schemas, topic_schemas, write_schemas
from pipeline.cli.main import main
from tests.consumers.scoring.test_message_properties import NOW_US, near_miss, to_bytes
from tests.consumers.service.test_batch_scoring import HOUR_US, hostile_batch_scorer, polled, tiny_scorer

EPOCH_MS = MessageLimits(timestamp_format="epoch_ms")


def validator(schema: dict) -> jsonschema.Draft202012Validator:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


def test_the_shipped_schemas_are_the_generated_ones(tmp_path):
    assert sorted(p.name for p in SHIPPED_DIR.iterdir()) == sorted(f"{t}.schema.json" for t in TOPICS)
    assert shipped_schemas() == topic_schemas(), (
        "consumers/scoring/schemas/ is out of step with the code: run "
        "`txsentinel schemas --out consumers/scoring/schemas` and commit the files"
    )
    assert main(["schemas", "--out", str(tmp_path)]) == 0
    for topic in TOPICS:
        name = f"{topic}.schema.json"
        assert (tmp_path / name).read_text() == (SHIPPED_DIR / name).read_text()


def test_the_schemas_follow_the_settings(tmp_path):
    assert main(["schemas", "--out", str(tmp_path), "--set", "timestamp_format=epoch_ms"]) == 0
    ts = json.loads((tmp_path / "transactions.schema.json").read_text())["properties"]["ts"]
    assert ts["type"] == "integer" and ts["minimum"] == 946_684_800_000  # 2000-01-01 in milliseconds
    strict = topic_schemas(MessageLimits(unknown_fields="refuse", max_id_chars=16))
    assert strict["labels"]["additionalProperties"] is False
    assert strict["transactions"]["properties"]["account_id"]["maxLength"] == 16
    assert topic_schemas()["transactions"]["additionalProperties"] is True
    assert main(["schemas", "--out", str(tmp_path), "--set", "timestamp_format=seconds"]) == 2


# Python's JSON reads NaN, which no schema validator takes for a number; the decoder refuses it too.
PROPERTY = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
EPOCH_PLAUSIBLE = {
    "ts": st.integers(EPOCH_MS.earliest_us // 1000 - 10**9, NOW_US // 1000 + 10**10),
    "label_ts": st.integers(EPOCH_MS.earliest_us // 1000 - 10**9, NOW_US // 1000 + 10**10),
}


@pytest.mark.parametrize("timestamp_format", ["iso8601", "epoch_ms"])
@pytest.mark.parametrize("kind", ["transactions", "labels"])
@PROPERTY
@given(data=st.data())
def test_every_message_the_decoder_accepts_is_valid_under_its_schema(kind, timestamp_format, data):
    limits = MessageLimits(timestamp_format=timestamp_format)
    fields, decode = (
        (
            ("event_id", "account_id", "ts", "amount", "terminal_id", "category", "channel", "country"),
            decode_transaction,
        )
        if kind == "transactions"
        else (("event_id", "account_id", "terminal_id", "is_fraud", "label_ts"), decode_label)
    )
    value = data.draw(near_miss(fields))
    if timestamp_format == "epoch_ms":  # the same near misses, their timestamps as integers
        stamp = "ts" if kind == "transactions" else "label_ts"
        if isinstance(value.get(stamp), str):
            value[stamp] = data.draw(EPOCH_PLAUSIBLE[stamp])
    raw = to_bytes(value, ascii_only=True)
    try:
        decode(raw, limits, NOW_US)
    except MessageError:
        return
    validator(topic_schemas(limits)[kind]).validate(json.loads(raw))


def test_the_encoders_write_messages_valid_under_the_schemas():
    tx = Transaction("E1", "A1", NOW_US - HOUR_US, 12.5, "T9", channel="pos")
    label = Label("E1", "A1", "T9", True, NOW_US)
    for fmt in ("iso8601", "epoch_ms"):
        schemas = topic_schemas(MessageLimits(timestamp_format=fmt))
        validator(schemas["transactions"]).validate(json.loads(encode_transaction(tx, fmt)))
        validator(schemas["labels"]).validate(json.loads(encode_label(label, fmt)))


@pytest.mark.parametrize("timestamp_format", ["iso8601", "epoch_ms"])
def test_what_the_service_writes_is_valid_under_the_schemas(timestamp_format):
    limits = MessageLimits(timestamp_format=timestamp_format)
    schemas = {topic: validator(schema) for topic, schema in topic_schemas(limits).items()}
    now = time.time_ns() // 1000
    start = now - 10 * HOUR_US

    def tx(event_id, account, ts_us, amount=10.0, **extra):
        ts = ts_us // 1000 if timestamp_format == "epoch_ms" else format_ts(ts_us)
        body = {"event_id": event_id, "account_id": account, "amount": amount, "terminal_id": "T1", **extra}
        return json.dumps(body | {"ts": ts}).encode()

    values = [
        (b"A1", tx("E1", "A1", start)),
        (b"A2", tx("E2", "A2", start + 1, merchant="M1")),  # an unknown field: read, counted
        (b"A1", tx("E3", "A1", start + 2, amount=10_000.0)),
        (b"A9", tx("E4", "A1", start + 3)),  # key of another account: dead letter
        (b"A1", tx("E5", "A1", now + 2 * HOUR_US)),  # from the future: dead letter
        (b"A1", b"\xff not json"),
        (b"\xff\xfe", None),  # a tombstone
        (b"A1", tx("E6", "A1", start + 4, pad="x" * 900_000)),  # oversize, and too big to dead-letter whole
        (b"K" * 600_000, tx("E7", "A1", start + 5)),  # a key no account has, and too long to carry whole
    ]
    batches = hostile_batch_scorer(tiny_scorer(), timestamp_format=timestamp_format, threshold=0.0)
    out = batches.score(polled(values))
    written = {"p-scores": "scores", "p-alerts": "alerts", "p-dead-letter": "dead-letter"}
    seen = {topic: 0 for topic in written.values()}
    for topic, _, value, _ in out.records:
        if topic in written:
            schemas[written[topic]].validate(json.loads(value))
            seen[written[topic]] += 1
    assert seen == {"scores": 3, "alerts": 3, "dead-letter": 6}  # threshold 0: every score is an alert
    assert out.unknown_fields == 1
    dead = [v for t, _, v, _ in out.records if t == "p-dead-letter"]
    letters = [json.loads(v) for v in dead]
    assert (
        base64.b64decode(letters[2]["value_base64"]) == b"\xff not json"
        and letters[3]["value_base64"] is None
        and "value_truncated" not in letters[2]
    )
    # Kafka's default record limit is 1 MB (the producer refuses a bigger record): the letter of a 900 KB
    # record carries its start, and its length and hash, and stays under it.
    big, letter = values[-2][1], letters[4]
    assert len(dead[4]) < 1_000_000 and "the limit is 65536" in letter["reason"]
    assert letter["value_truncated"] is True and letter["value_bytes"] == len(big)
    assert letter["value_sha256"] == hashlib.sha256(big).hexdigest()
    assert base64.b64decode(letter["value_base64"]) == big[:DEAD_LETTER_VALUE_BYTES]
    (key, value), letter = [(k, v) for t, k, v, _ in out.records if t == "p-dead-letter"][5], letters[5]
    assert key == b"K" * DEAD_LETTER_KEY_BYTES and len(key) + len(value) < DEAD_LETTER_KEY_BYTES + 1_000
    assert (letter["key_truncated"], letter["key_bytes"]) == (
        True,
        600_000,
    ) and "value_truncated" not in letter
    assert letter["key_sha256"] == hashlib.sha256(b"K" * 600_000).hexdigest()
    assert base64.b64decode(letter["value_base64"]) == values[-1][1]


def test_at_the_widest_limits_every_record_the_service_writes_passes_kafka_s_default_1_mb():
    # max_id_chars 4,096 of astral characters (12 bytes each in JSON) and messages of up to 1,000,000 bytes:
    # an event replayed under such ids, a key of such an id on another account's event, and the key of a
    # refused record as long as a record may be. A letter the producer refuses would stop the service.
    widest = {"max_id_chars": 4_096, "max_message_bytes": 1_000_000}
    now = time.time_ns() // 1000
    long_id = "\U0001f600" * 4_096

    def tx(event_id: str, account: str) -> bytes:
        ts = format_ts(now - HOUR_US)
        return json.dumps({"event_id": event_id, "account_id": account, "ts": ts, "amount": 1.0,
                           "terminal_id": long_id}).encode()  # fmt: skip

    values = [
        (long_id.encode(), tx(long_id, long_id)),  # scored
        (long_id.encode(), tx(long_id, long_id)),  # its replay: dead-lettered, naming the ids
        (("\U0001f601" * 4_096).encode(), tx("E2", long_id)),  # the key of another account
        (b"K" * 990_000, b"x" * 999_000),  # a refused record as big as one may be
    ]
    batches = hostile_batch_scorer(tiny_scorer(), **widest)
    out = batches.score(polled(values))
    sizes = {
        t: max(len(k or b"") + len(v) for t2, k, v, _ in out.records if t2 == t) for t, *_ in out.records
    }
    assert out.dead_lettered == 3 and max(sizes.values()) < 1_000_000, sizes


def test_write_schemas_writes_one_file_a_topic(tmp_path):
    assert [p.name for p in write_schemas(tmp_path / "out")] == [f"{t}.schema.json" for t in TOPICS]
