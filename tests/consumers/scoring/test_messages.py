"""The JSON message formats of the transactions and labels topics."""

import json
import math

import pytest

from consumers.scoring.message_limits import (
    TIMESTAMP_FORMATS,
    MessageError,
    MessageLimits,
    format_ts,
    parse_ts,
)
from consumers.scoring.messages import (
    Label,
    Transaction,
    UnknownFields,
    decode_label,
    decode_transaction,
    encode_label,
    encode_transaction,
)
from consumers.scoring.outputs import encode_score, encode_scores

GOOD = {
    "event_id": "E1",
    "account_id": "A1",
    "ts": "2026-03-01T12:00:00.25Z",
    "amount": 12.5,
    "terminal_id": "T9",
}


def message(**changes) -> bytes:
    data = {**GOOD, **changes}
    return json.dumps({k: v for k, v in data.items() if v is not ...}).encode()


def test_transaction_round_trips_with_microsecond_timestamps():
    tx = Transaction("E1", "A1", parse_ts("2026-03-01T12:00:00.000001+00:00", "ts"), 0.0, "T9", channel="pos")
    assert decode_transaction(encode_transaction(tx)) == tx
    assert format_ts(tx.ts_us) == "2026-03-01T12:00:00.000001Z"
    assert parse_ts("2026-03-01T13:00:00+01:00", "ts") == parse_ts("2026-03-01T12:00:00Z", "ts")


def test_label_round_trips():
    label = Label("E1", "A1", "T9", True, parse_ts("2026-03-04T09:00:00Z", "label_ts"))
    assert decode_label(encode_label(label)) == label


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "not valid UTF-8 JSON"),
        (b"\xff\xfe", "not valid UTF-8 JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (message(amount=...), "missing required field(s): amount"),
        (message(amount="12"), "'amount': expected a number"),
        (message(amount=-1), "-1 is not a finite amount"),
        (
            b'{"event_id":"E1","account_id":"A1","ts":"2026-03-01T12:00:00Z","amount":NaN,"terminal_id":"T"}',
            "nan",
        ),
        (message(account_id=""), "'account_id': expected a non-empty string"),
        (message(ts="yesterday"), "'yesterday' is not an ISO-8601 timestamp"),
        (message(ts="2026-03-01T12:00:00"), "has no UTC offset"),
        (message(ts="1970-01-02T00:00:00Z"), "outside 2000..2099"),
        (message(ts=1767225600), "expected an ISO-8601 timestamp string, got int"),
        (message(channel=7), "'channel': expected a string"),
        (b'{"pad":"' + b"x" * 70_000 + b'"}', "limit is 65536"),
    ],
)
def test_bad_transactions_are_refused_with_a_reason(raw, reason):
    with pytest.raises(MessageError) as error:
        decode_transaction(raw)
    assert reason in str(error.value)


@pytest.mark.parametrize(
    "text",
    [
        "2026-03-01T12:00:00Z\u0000 and anything after a NUL",  # fromisoformat stops reading at the NUL
        "2026-03-01\u000012:00:00Z",  # any character as the separator
        "2026-03-01\U0001f4a312:00:00Z",
        "2026-03-01T12:00:00+00",  # an offset of hours only
        "2026-03-01T12:00:00.Z",
        "2026-03-01T12:00Z",  # no seconds
        "20260301T120000Z",  # the basic format: not RFC 3339, the schemas' date-time
        "2026-03-01T12:00:00\u0661Z",  # a digit of another script
    ],
)
def test_a_timestamp_is_the_documented_form_whole_or_is_refused(text):
    with pytest.raises(MessageError, match="is not an ISO-8601 timestamp with a UTC offset"):
        parse_ts(text, "ts", now=NOW_US)


@pytest.mark.parametrize("text", ["2026-02-30T00:00:00Z", "2026-03-01T25:00:00Z", "2026-06-30T23:59:60Z"])
def test_a_timestamp_of_the_right_form_but_no_such_time_is_refused(text):
    with pytest.raises(MessageError, match="is not an ISO-8601 timestamp: no such date or time"):
        parse_ts(text, "ts", now=NOW_US)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2026-03-01t12:00:00z", "2026-03-01T12:00:00.000000Z"),  # RFC 3339 allows lower case
        ("2026-03-01 12:00:00Z", "2026-03-01T12:00:00.000000Z"),
        ("2026-03-01T12:00:00,25+0100", "2026-03-01T11:00:00.250000Z"),
        ("2026-03-01T12:00:00.123456789Z", "2026-03-01T12:00:00.123456Z"),  # kept to the microsecond
    ],
)
def test_every_form_of_the_documented_timestamp_is_read(text, expected):
    assert format_ts(parse_ts(text, "ts", now=NOW_US)) == expected


def test_label_needs_a_boolean_verdict():
    data = {
        "event_id": "E1",
        "account_id": "A1",
        "terminal_id": "T",
        "is_fraud": 1,
        "label_ts": "2026-03-04T09:00:00Z",
    }
    with pytest.raises(MessageError, match="'is_fraud': expected true or false"):
        decode_label(json.dumps(data).encode())


def test_fast_score_encoding_equals_the_json_dumps_reference_byte_for_byte():
    from consumers.scoring.results import ScoreRecord

    awkward_ids = ["plain", 'quote " and \\ backslash', "ünïcödé €", "tab\tnew\nline", "\x00nul"]
    stamps = [946_684_800_000_000, 1_772_366_400_250_000, 4_102_444_799_999_999, 1_772_366_400_000_001]
    scores = [0.0, 1.0, 1e-300, 0.1 + 0.2, 0.5, 0.999999999999]
    records = [
        ScoreRecord(
            event_id=awkward_ids[i % len(awkward_ids)],
            account_id=awkward_ids[(i + 2) % len(awkward_ids)],
            ts_us=stamps[i % len(stamps)],
            score=scores[i % len(scores)],
            logit=0.0,
            alert=i % 3 == 0,
            out_of_order=i % 4 == 1,
        )
        for i in range(60)
    ]
    for version in ("3", 'models:/txsentinel@"champion"'):
        fast = encode_scores(records, version)
        assert fast == [encode_score(r, version) for r in records]
        assert json.loads(fast[1])["ts"] == "2026-03-01T12:00:00.250000Z"
    assert encode_scores([], "3") == []


NOW_US = parse_ts("2026-03-01T12:00:00Z", "now")


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"event_id":' * 2000 + b"1" + b"}" * 2000, "JSON nested 2000 deep; the limit is 8"),
        (message(amount=10**400), "is above max_amount = 1e+09"),
        (
            message(amount=12.5).replace(b"12.5", b"9" * 5000),
            "not valid UTF-8 JSON: Exceeds the limit (4300 digits)",
        ),
        (message(amount=2e9), "above max_amount"),
        (message(amount=1e308 * 10), "inf is not a finite amount"),
        (message(account_id="A\ud800"), "holds U+D800, a lone surrogate, which UTF-8 cannot encode"),
        (message(terminal_id="T\x00"), "holds U+0000, not printable"),
        (message(event_id="E\u202e1"), "holds U+202E, not printable"),  # right-to-left override
        (message(account_id="A1\ufe0f"), "holds U+FE0F, which prints as nothing"),  # variation selector
        (message(terminal_id="\u3164"), "holds U+3164, which prints as nothing"),  # Hangul filler: blank
        (message(event_id="E\u034f1"), "holds U+034F, which prints as nothing"),  # grapheme joiner
        (message(account_id="\u2800"), "holds U+2800, which prints as nothing"),  # Braille blank
        (message(account_id="\u0301"), "holds U+0301 first, a combining mark with no character before it"),
        (message(terminal_id=" \u0301\u0301"), "holds U+0301 first, a combining mark"),  # spaces, marks
        (message(country="F\nR"), "'country': 'F\\nR' holds U+000A"),
        (message(event_id="E" * 257), "257 characters; the limit is 256"),
        (message(ts="2026-03-01T13:00:01Z"), "3601 s in the future: more than max_ts_skew_s = 3600"),
        (message(ts="2099-12-31T00:00:00Z"), "in the future"),
        (message(ts="0001-01-01T00:00:00+01:00"), "is outside 2000..2099"),
        ('{"amount": 1}'.encode("utf-16"), "not valid UTF-8 JSON"),
        (
            message().replace(b'"account_id"', b'"account_id": "A2", "account_id"'),
            "'account_id' appears more",
        ),
        (b"\xef\xbb\xbf" + message(), "not valid UTF-8 JSON: it starts with a byte order mark"),
        (b"", "not valid UTF-8 JSON: Expecting value"),
    ],
)
def test_hostile_transactions_are_refused_with_a_reason(raw, reason):
    with pytest.raises(MessageError) as error:
        decode_transaction(raw, MessageLimits(), NOW_US)
    assert reason in str(error.value)
    assert len(str(error.value)) < 400  # the value is shown cut, never whole


@pytest.mark.parametrize(
    "account_id",
    ["Ñandú-7", "N\u0303andu\u0301-7", "账户-7", "حساب-7", "कार्ड-7", "Ⓐ-7"],
    ids=["latin", "decomposed marks", "han", "arabic", "devanagari", "symbol"],
)
def test_ids_in_any_script_are_accepted_marks_included(account_id):
    # Combining marks and joiners that shape a script are visible: only what prints as nothing is refused.
    assert (
        decode_transaction(message(account_id=account_id), MessageLimits(), NOW_US).account_id == account_id
    )


def test_limits_are_settings():
    tight = MessageLimits(
        max_amount=100.0, max_id_chars=2, earliest_ts="2026-01-01T00:00:00Z", max_ts_skew_s=1
    )
    with pytest.raises(MessageError, match="above max_amount = 100"):
        decode_transaction(message(amount=100.5), tight, NOW_US)
    with pytest.raises(MessageError, match="3 characters; the limit is 2"):
        decode_transaction(message(event_id="E12"), tight, NOW_US)
    with pytest.raises(MessageError, match=r"outside 2026\.\.2099: earliest accepted 2026-01-01T00:00:00"):
        decode_transaction(message(ts="2025-12-31T23:59:59Z"), tight, NOW_US)
    with pytest.raises(MessageError, match="in the future"):
        decode_transaction(message(ts="2026-03-01T12:00:01.000001Z"), tight, NOW_US)
    assert decode_transaction(message(ts="2026-03-01T12:00:01Z"), tight, NOW_US).amount == 12.5
    assert decode_transaction(message(amount=-0.0), tight, NOW_US).amount == 0.0  # not -0.0
    for bad in ({"max_amount": math.inf}, {"max_amount": 1e300}, {"max_json_depth": 0}, {"earliest_ts": "x"}):
        with pytest.raises(ValueError):
            MessageLimits(**bad)


def test_a_label_from_the_future_is_refused():
    data = {"event_id": "E1", "account_id": "A1", "terminal_id": "T", "is_fraud": True}
    late = json.dumps({**data, "label_ts": "2030-01-01T00:00:00Z"}).encode()
    with pytest.raises(MessageError, match=r"'label_ts': '2030-01-01T00:00:00Z' is \d+ s in the future"):
        decode_label(late, MessageLimits(), NOW_US)
    assert decode_label(json.dumps({**data, "label_ts": "2026-03-01T12:00:00Z"}).encode(), now_us=NOW_US)


@pytest.mark.parametrize("timestamp_format", TIMESTAMP_FORMATS)
def test_a_label_given_its_records_timestamp_is_judged_by_it_whatever_the_clock(timestamp_format):
    limits = MessageLimits(timestamp_format=timestamp_format)
    sent = NOW_US
    data = {"event_id": "E1", "account_id": "A1", "terminal_id": "T", "is_fraud": True}
    for clock in (sent - 86_400_000_000, sent, sent + 86_400_000_000):  # a day behind, on time, a day ahead
        at_bound = Label("E1", "A1", "T", True, sent + 3_600_000_000)
        assert decode_label(encode_label(at_bound, timestamp_format), limits, clock, sent_us=sent) == at_bound
        past = encode_label(Label(**{**data, "label_ts_us": sent + 3_601_000_000}), timestamp_format)
        with pytest.raises(
            MessageError, match=r"is 3601 s after the timestamp of its record \(2026-03-01T12"
        ):
            decode_label(past, limits, clock, sent_us=sent)


REFUSE = MessageLimits(unknown_fields="refuse")


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (message(colour="red"), "unknown field(s): colour"),
        (message(**{"\x07bell": 1}), "unknown field(s): '\\x07bell'"),
    ],
)
def test_unknown_fields_are_refused_when_the_setting_says_so(raw, reason):
    with pytest.raises(MessageError) as error:
        decode_transaction(raw, REFUSE, NOW_US)
    assert reason in str(error.value)
    assert "setting unknown_fields = refuse" in str(error.value)


def test_unknown_fields_are_ignored_and_counted_by_default():
    unknown = UnknownFields()
    plain = decode_transaction(message(), MessageLimits(), NOW_US, unknown)
    assert unknown.take() == (0, [])
    extra = message(colour="red", merchant={"name": "M", "mcc": 5411}, channel="pos")
    tx = decode_transaction(extra, MessageLimits(), NOW_US, unknown)
    assert tx == plain._replace(channel="pos")  # the known optional field is read, the strangers are not
    decode_transaction(message(colour="blue"), MessageLimits(), NOW_US, unknown)
    assert unknown.take() == (2, ["colour", "merchant"])  # two messages; each name once
    label = json.dumps(
        {
            "event_id": "E1",
            "account_id": "A1",
            "terminal_id": "T",
            "is_fraud": True,
            "label_ts": GOOD["ts"],
            "x": 1,
        }
    )
    assert decode_label(label.encode(), MessageLimits(), NOW_US, unknown).is_fraud
    assert unknown.take() == (1, ["x"])
    long_names = {f"{'n' * 20_000}{i}": i for i in range(3)}  # together as long as a message allows
    decode_transaction(message(**long_names), MessageLimits(), NOW_US, unknown)
    count, names = unknown.take()
    assert (
        count == 1 and len(names) == 1 and len(names[0]) < 200
    )  # one cut name for the three, not 60k characters
    with pytest.raises(MessageError, match="unknown field"):
        decode_label(label.encode(), REFUSE, NOW_US)


EPOCH_MS = MessageLimits(timestamp_format="epoch_ms")


def test_epoch_millisecond_timestamps_with_the_setting():
    ms = parse_ts(GOOD["ts"], "ts") // 1000
    tx = decode_transaction(message(ts=ms), EPOCH_MS, NOW_US)
    assert tx == decode_transaction(message(), MessageLimits(), NOW_US)
    assert decode_transaction(encode_transaction(tx, "epoch_ms"), EPOCH_MS, NOW_US) == tx
    assert json.loads(encode_transaction(tx, "epoch_ms"))["ts"] == 1772366400250
    label = Label("E1", "A1", "T9", True, tx.ts_us)
    assert decode_label(encode_label(label, "epoch_ms"), EPOCH_MS, NOW_US) == label


@pytest.mark.parametrize(
    ("ts", "reason"),
    [
        (
            "2026-03-01T12:00:00Z",
            "expected epoch milliseconds (an integer; setting timestamp_format = epoch_ms)",
        ),
        (1772366400250.5, "expected epoch milliseconds"),
        (True, "expected epoch milliseconds"),
        (1772366400, "outside 2000..2099"),  # seconds, not milliseconds: 1970
        (10**30, "is not epoch milliseconds"),
        (1772366400250 + 3_601_000, "3601 s in the future"),
    ],
)
def test_epoch_milliseconds_are_bounded_like_iso_timestamps(ts, reason):
    with pytest.raises(MessageError) as error:
        decode_transaction(message(ts=ts), EPOCH_MS, NOW_US)
    assert reason in str(error.value)


def test_an_epoch_timestamp_under_iso8601_names_the_setting():
    with pytest.raises(MessageError, match="timestamp_format = epoch_ms"):
        decode_transaction(message(ts=1772366400250), MessageLimits(), NOW_US)


def test_the_message_settings_are_checked():
    for bad in ({"unknown_fields": "drop"}, {"timestamp_format": "epoch_s"}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} = .*expected one of"):
            MessageLimits(**bad)


def test_scores_in_epoch_milliseconds_equal_the_reference():
    from consumers.scoring.results import ScoreRecord

    records = [ScoreRecord("E1", "A1", 1_772_366_400_250_000, 0.25, 0.0, True, False)]
    fast = encode_scores(records, "3", "epoch_ms")
    assert fast == [encode_score(records[0], "3", "epoch_ms")]
    assert json.loads(fast[0])["ts"] == 1772366400250


def test_a_field_named_twice_is_refused_whichever_value_a_reader_would_take():
    # Python's json takes the last value, other readers the first: the message means two events at once.
    label = b'{"event_id":"E1","account_id":"A1","terminal_id":"T","terminal_id":"T2","is_fraud":true,'
    with pytest.raises(MessageError, match="field 'terminal_id' appears more than once"):
        decode_label(label + b'"label_ts":"2026-03-01T12:00:00Z"}', MessageLimits(), NOW_US)
    same = message().replace(b'"event_id": "E1"', b'"event_id": "E1", "event_id": "E1"')
    with pytest.raises(MessageError, match="field 'event_id' appears more than once"):
        decode_transaction(same, MessageLimits(), NOW_US)  # even with equal values: no reader need guess
    assert decode_transaction(message(), MessageLimits(), NOW_US).account_id == "A1"
