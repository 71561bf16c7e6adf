"""Hostile records for the service's acceptance test (test_service_hostile.py): what an attacker, a broken
producer or a careless operator can put on `transactions` and `labels`, one kind a line, each with the words
its dead-letter reason must hold. Every record is a good one but for its one fault, so the fault is what
the service has to catch. Beside them, `valid_extremes`: records at the edge of what is valid, which must
be scored like any other event.

The rules they probe: docs/operations.md#what-is-rejected-and-why.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from consumers.scoring.messages import Label, Transaction, encode_label, encode_transaction, format_ts

HOUR_US = 3_600_000_000


class Poison(NamedTuple):
    kind: str
    what: str  # the kind in one line: what it is and what it did, or would do, to the service
    key: bytes | None
    value: bytes | None
    reason: str  # words its dead-letter reason holds
    follows: str | None = None  # the event_id of the good event it comes right behind (a replay)
    shift: int = 0  # sent this many partitions past its key's (0: by its key, as producers send)


def transaction_poison(
    base: Transaction, later: Transaction, other: Transaction, fault_terminal: str, now_us: int
) -> list[Poison]:
    """Poison for `transactions`, made from `base`, a good event; `later`: an event of the same account a few
    events on (within its window of recent event ids); `other`: another account's event; `fault_terminal`: a
    terminal no good event uses, at which the test's detector fails."""
    data = json.loads(encode_transaction(base))
    key = base.account_id.encode()

    def body(kind: str, **changes) -> bytes:
        return json.dumps({**data, "event_id": f"P-{kind}", **changes}).encode()

    def raw(kind: str, text: str) -> bytes:  # the body with `text` in place of the amount's JSON
        return body(kind, amount=12345.5).replace(b"12345.5", text.encode())

    def bad(kind: str, what: str, value: bytes | None, reason: str, record_key: bytes | None = key) -> Poison:
        return Poison(kind, what, record_key, value, reason)

    without_terminal = {k: v for k, v in json.loads(body("missing_field")).items() if k != "terminal_id"}
    first = f'"account_id": "{other.account_id}", "account_id"'.encode()  # then the body's own
    twice = body("duplicate_field").replace(b'"account_id"', first)
    fault = base._replace(event_id="P-detector_fault", terminal_id=fault_terminal)
    stranger = Transaction("P-detector_fault_new", "A-FAULT", base.ts_us, 5.0, fault_terminal)
    retry = encode_transaction(base)
    reused = encode_transaction(base._replace(amount=base.amount + 1, ts_us=base.ts_us + 1))
    return [
        # -- the shape of the message
        bad("deep_nesting", "3,000 nested objects: the parser recursed into RecursionError and the service stopped",
            b'{"event_id":' * 3_000 + b"1" + b"}" * 3_000, "JSON nested 3000 deep"),
        bad("nesting_in_a_field", "an amount 20 arrays deep, small enough to pass the size bound",
            raw("nesting_in_a_field", "[" * 20 + "1" + "]" * 20), "JSON nested 21 deep"),
        bad("oversize", "a 70 KB message: bounded so one record cannot hold a batch or memory",
            body("oversize", pad="x" * 70_000), "the limit is 65536"),
        bad("oversize_for_a_dead_letter", "a 900 KB message: its dead letter, all of it base64-encoded, passed "
            "the producer's 1 MB record limit, so the batch failed on every try and the service stopped",
            body("oversize_for_a_dead_letter", pad="x" * 900_000), "the limit is 65536"),
        bad("key_and_value_too_big_for_a_dead_letter", "a 700 KB key on a 300 KB message: each under the "
            "producer's 1 MB record limit, together (the value base64-encoded) over it",
            body("key_and_value_too_big_for_a_dead_letter", pad="x" * 300_000), "the limit is 65536",
            record_key=b"K" * 700_000),
        bad("null_value", "a tombstone on an event topic",
            None, "null value"),
        bad("empty_value", "zero bytes",
            b"", "not valid UTF-8 JSON"),
        bad("truncated_json", "a message cut in half by a broken producer",
            body("truncated_json")[:60], "not valid UTF-8 JSON"),
        bad("trailing_garbage", "a valid object followed by a NUL byte",
            body("trailing_garbage") + b"\x00", "not valid UTF-8 JSON: Extra data"),
        bad("utf16_body", "JSON in UTF-16, which Python's json.loads of bytes would take",
            json.dumps(json.loads(body("utf16_body"))).encode("utf-16"), "not valid UTF-8 JSON"),
        bad("byte_order_mark", "UTF-8 JSON behind a byte order mark",
            b"\xef\xbb\xbf" + body("byte_order_mark"), "byte order mark"),
        bad("non_utf8_in_id", "a raw 0xFF byte inside the account_id string",
            body("non_utf8_in_id").replace(key, key + b"\xff"), "not valid UTF-8 JSON"),
        bad("not_an_object", "a JSON array",
            b'["E1", "A1", 12.5]', "expected a JSON object"),
        bad("json_null", "the JSON literal null",
            b"null", "expected a JSON object"),
        bad("missing_field", "no terminal_id",
            json.dumps(without_terminal).encode(), "missing required field(s): terminal_id"),
        bad("null_field", "amount: null",
            body("null_field", amount=None), "missing required field(s): amount"),
        bad("duplicate_field", "account_id twice: Python's json keeps the last, other readers the first",
            twice, "'account_id' appears more than once"),
        # -- the amount
        bad("long_integer", "an amount of 5,000 digits: int() refuses past 4,300 with ValueError",
            raw("long_integer", "7" * 5_000), "Exceeds the limit (4300 digits)"),
        bad("integer_beyond_float", "10**400: float() of it raised OverflowError",
            body("integer_beyond_float", amount=10**400), "is above max_amount"),
        bad("exponent_beyond_float", "1e400, which parses to inf",
            raw("exponent_beyond_float", "1e400"), "not a finite amount"),
        bad("amount_near_float_max", "1.7e308: the batch's running sums overflowed into NaN for other accounts",
            body("amount_near_float_max", amount=1.7e308), "is above max_amount"),
        bad("amount_above_max", "just above max_amount",
            body("amount_above_max", amount=1.000001e9), "is above max_amount"),
        bad("amount_negative", "a negative amount",
            body("amount_negative", amount=-0.01), "not a finite amount"),
        bad("amount_nan", "the NaN literal Python's json accepts",
            raw("amount_nan", "NaN"), "not a finite amount"),
        bad("amount_minus_infinity", "the -Infinity literal",
            raw("amount_minus_infinity", "-Infinity"), "not a finite amount"),
        bad("amount_nan_as_text", "'NaN' as a string, which float() would take",
            body("amount_nan_as_text", amount="NaN"), "expected a number"),
        bad("amount_inf_as_text", "'inf' as a string",
            body("amount_inf_as_text", amount="inf"), "expected a number"),
        bad("amount_as_text", "'12.5' as a string",
            body("amount_as_text", amount="12.5"), "expected a number"),
        bad("amount_boolean", "true, which is an int to Python",
            body("amount_boolean", amount=True), "expected a number"),
        # -- the ids
        bad("lone_surrogate_id", "an escaped lone surrogate, which no UTF-8 key or output can carry",
            body("lone_surrogate_id", terminal_id="T\ud800"), "a lone surrogate"),
        bad("nul_in_id", "a NUL character",
            body("nul_in_id", event_id="E\x00"), "holds U+0000, not printable"),
        bad("newline_in_id", "a newline, which splits log lines",
            body("newline_in_id", terminal_id="T\n1"), "holds U+000A"),
        bad("ansi_escape_in_text", "a terminal escape sequence in an optional text",
            body("ansi_escape_in_text", category="\x1b[31mred"), "holds U+001B"),
        bad("bidi_override_in_id", "a right-to-left override, which makes an id read as another",
            body("bidi_override_in_id", terminal_id="T\u202e9"), "holds U+202E, not printable"),
        bad("zero_width_in_id", "a zero-width space, which makes two ids look the same",
            body("zero_width_in_id", terminal_id="T\u200b9"), "holds U+200B, not printable"),
        bad("invisible_id", "an account_id of one Hangul filler, printable to Python yet blank",
            body("invisible_id", account_id="\u3164"), "holds U+3164, which prints as nothing"),
        bad("combining_marks_id", "a terminal_id of a space and two acute accents: marks alone print as no character",
            body("combining_marks_id", terminal_id=" \u0301\u0301"), "U+0301 first, a combining mark"),
        bad("overlong_id", "a 300-character event_id",
            body("overlong_id", event_id="E" * 300), "300 characters; the limit is 256"),
        bad("blank_id", "an event_id of spaces",
            body("blank_id", event_id="   "), "expected a non-empty string"),
        bad("id_wrong_type", "a numeric event_id",
            body("id_wrong_type", event_id=123), "expected a non-empty string"),
        bad("id_as_object", "an account_id that is an object",
            body("id_as_object", account_id={"id": base.account_id}), "expected a non-empty string"),
        # -- the timestamp
        bad("far_future_ts", "2090: it moved its account's and terminal's day forward for good",
            body("far_future_ts", ts="2090-01-01T00:00:00Z"), "in the future"),
        bad("ts_past_skew", "two hours after the service's clock",
            body("ts_past_skew", ts=format_ts(now_us + 2 * HOUR_US)), "more than max_ts_skew_s"),
        bad("far_past_ts", "1999, before earliest_ts",
            body("far_past_ts", ts="1999-12-31T23:59:59Z"), "is outside 2000..2099"),
        bad("year_one_ts", "year 1 with an offset, below the epoch",
            body("year_one_ts", ts="0001-01-01T00:00:00+01:00"), "is outside 2000..2099"),
        bad("ts_without_offset", "a local time with no UTC offset",
            body("ts_without_offset", ts="2026-01-02T10:00:00"), "has no UTC offset"),
        bad("ts_as_number", "epoch seconds instead of ISO-8601",
            body("ts_as_number", ts=1_767_225_600), "expected an ISO-8601 timestamp string"),
        bad("impossible_date", "30 February",
            body("impossible_date", ts="2026-02-30T00:00:00Z"), "is not an ISO-8601 timestamp"),
        # -- the key
        bad("key_missing", "no record key: the account's events would split over partitions",
            encode_transaction(base._replace(event_id="P-key_missing")), "record key missing", None),
        bad("key_of_another_account", "another account's key: that account's partition would hold this one's state",
            encode_transaction(base._replace(event_id="P-key_other")), "is not the body's account_id",
            other.account_id.encode()),
        bad("key_not_utf8", "a key that is not UTF-8",
            encode_transaction(base._replace(event_id="P-key_bytes")), "is not the body's account_id", b"\xff\xfe"),
        Poison("off_its_partition", "the account's key, sent by hand to another partition: scored without its history there, its state split",
               key, encode_transaction(base._replace(event_id="P-off_partition")), "belongs on partition", shift=1),
        bad("key_with_a_nul", "the account's key and a NUL byte: prints the same, hashes elsewhere",
            encode_transaction(base._replace(event_id="P-key_nul")), "is not the body's account_id", key + b"\x00"),
        # -- replays: a producer's retry, at another offset
        Poison("retry", "the same record again right behind it: it was scored and applied twice",
               key, retry, "was applied already", base.event_id),
        Poison("late_retry", "the same record again, behind its account's next few events",
               key, retry, "was applied already", later.event_id),
        Poison("reused_event_id", "an applied event_id with another amount and ts",
               key, reused, "was applied already", base.event_id),
        # -- the last resort: valid, but the detector fails on it
        bad("detector_fault", "a detector bug nobody foresaw, on a known account",
            encode_transaction(fault), "scoring failed"),
        bad("detector_fault_new_account", "the same, on an account nobody has seen",
            encode_transaction(stranger), "scoring failed", b"A-FAULT"),
    ]  # fmt: skip


def label_poison(base: Label, now_us: int) -> list[Poison]:
    """Poison for `labels`, made from `base`, a good label: the scorers skip these, the table writer
    dead-letters them once."""
    data = json.loads(encode_label(base))
    key = base.account_id.encode()

    def body(**changes) -> bytes:
        return json.dumps({**data, **changes}).encode()

    def bad(kind: str, what: str, value: bytes | None, reason: str) -> Poison:
        return Poison(f"label_{kind}", what, key, value, reason)

    no_verdict = {k: v for k, v in data.items() if k != "is_fraud"}
    latin = json.dumps({**data, "terminal_id": "T\xe9"}, ensure_ascii=False).encode("latin-1")
    return [
        bad("deep_nesting", "3,000 nested objects: one such label stopped every instance and the table writer",
            b'{"label_ts":' * 3_000, "JSON nested 3000 deep"),
        bad("oversize", "a 70 KB label",
            body(pad="x" * 70_000), "the limit is 65536"),
        bad("oversize_for_a_dead_letter", "a 900 KB label: its whole dead letter passed the producer's 1 MB "
            "record limit and failed every flush of the table writer",
            body(pad="y" * 900_000), "the limit is 65536"),
        bad("null_value", "a tombstone",
            None, "null value"),
        bad("empty_value", "zero bytes",
            b"", "not valid UTF-8 JSON"),
        bad("truncated_json", "a label cut short",
            body()[:40], "not valid UTF-8 JSON"),
        bad("byte_order_mark", "a label behind a byte order mark",
            b"\xef\xbb\xbf" + body(), "byte order mark"),
        bad("non_utf8", "Latin-1 bytes",
            latin, "not valid UTF-8 JSON"),
        bad("not_an_object", "a JSON array",
            b"[true]", "expected a JSON object"),
        bad("duplicate_field", "is_fraud false then true",
            body().replace(b'"is_fraud"', b'"is_fraud": false, "is_fraud"'), "'is_fraud' appears more than once"),
        bad("missing_field", "no is_fraud",
            json.dumps(no_verdict).encode(), "missing required field(s): is_fraud"),
        bad("verdict_as_text", "is_fraud 'yes'",
            body(is_fraud="yes"), "expected true or false"),
        bad("verdict_as_number", "is_fraud 1",
            body(is_fraud=1), "expected true or false"),
        bad("long_integer", "is_fraud of 5,000 digits",
            body(is_fraud=0).replace(b": 0", b": " + b"1" * 5_000), "Exceeds the limit (4300 digits)"),
        bad("future_label_ts", "a verdict from two days after it was sent",
            encode_label(_label_at(base, now_us + 48 * HOUR_US)), "after the timestamp of its record"),
        bad("far_past_label_ts", "a verdict from 1999",
            body(label_ts="1999-01-01T00:00:00Z"), "is outside 2000..2099"),
        bad("label_ts_without_offset", "a local time",
            body(label_ts="2026-01-05T00:00:00"), "has no UTC offset"),
        bad("lone_surrogate_terminal", "a terminal id no UTF-8 can carry",
            body(terminal_id="T\udfff"), "a lone surrogate"),
        bad("control_in_terminal", "a terminal id with a carriage return",
            body(terminal_id="T\r1"), "holds U+000D"),
        bad("overlong_terminal", "a 257-character terminal id",
            body(terminal_id="T" * 257), "257 characters; the limit is 256"),
    ]  # fmt: skip


def _label_at(label: Label, label_ts_us: int) -> Label:
    return Label(label.event_id, label.account_id, label.terminal_id, label.is_fraud, label_ts_us)


def valid_extremes(base: Transaction, now_us: int) -> list[tuple[bytes, bytes]]:
    """(key, value) of transactions at the edge of valid, each on an account and terminal of its own, so
    the rest of the stream is as it was: each must be scored once, with a finite score."""

    def event(kind: str, **changes) -> dict:
        return {"event_id": f"X-{kind}", "account_id": f"A-X-{kind}", "ts": format_ts(base.ts_us),
                "amount": 10.0, "terminal_id": f"T-X-{kind}", **changes}  # fmt: skip

    cjk = "账" * 254
    events = [
        event("max_amount", amount=1e9),  # the largest amount accepted
        event("zero_amount", amount=0),  # an integer zero
        event("subnormal_amount", amount=5e-324),  # the smallest positive float
        event("earliest_ts", ts="2000-01-01T00:00:00Z"),  # earliest_ts itself
        event("within_skew", ts=format_ts(now_us + HOUR_US // 2)),  # ahead of the clock, within the skew
        event("far_offset", ts="2026-01-02T03:00:00+14:00"),  # the largest offset in use
        event("long_ids", account_id=f"A-{cjk}", terminal_id=f"T-{cjk}"),  # 256 characters, 766 bytes
        event("emoji_ids", account_id="A-😀-ünïcode", category="café ☕", channel="pos", country="FR"),
    ]
    values = [(e["account_id"].encode(), json.dumps(e, ensure_ascii=False).encode()) for e in events]
    # pretty-printed, the id's é escaped as \u00e9 in the body and UTF-8 in the key: still one valid object
    spaced = event("whitespace", account_id="A-X-whitespace-é")
    values.append((spaced["account_id"].encode(), json.dumps(spaced, indent=4).encode()))
    return values
