"""The decoders' contract is total: for ANY bytes, decode_transaction and decode_label return a valid event or
raise MessageError (the dead-letter reason), never another exception; and what they return keeps every bound
of MessageLimits. Shown over random bytes, random JSON values, random near-miss messages (the right fields,
any values) and deep nesting, with hypothesis."""

import json
import math
import string

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from consumers.scoring.messages import (
    LABEL_FIELDS,
    OPTIONAL_TRANSACTION_FIELDS,
    TRANSACTION_FIELDS,
    Label,
    MessageError,
    MessageLimits,
    Transaction,
    decode_label,
    decode_transaction,
    encode_label,
    encode_transaction,
    format_ts,
    json_depth,
)

NOW_US = 1_780_000_000_000_000  # 2026-05-28: the clock the future bound is read against
LIMITS = MessageLimits()
# No example database: the tests leave nothing behind in the checkout.
PROPERTY = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)

# Any JSON value Python's json can write: huge integers, NaN and infinities, any code point (lone
# surrogates included), nested.
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(st.characters(codec=None), max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
plausible = {
    "event_id": st.text(string.ascii_letters + string.digits + "-_", min_size=1, max_size=20),
    "account_id": st.text(string.ascii_letters + string.digits, min_size=1, max_size=12),
    "terminal_id": st.text(string.ascii_letters + string.digits + " -_./", min_size=1, max_size=12),
    # around both bounds: before earliest_ts, and past now + max_ts_skew_s
    "ts": st.integers(LIMITS.earliest_us - 10**12, NOW_US + 10**13).map(format_ts),
    "label_ts": st.integers(LIMITS.earliest_us - 10**12, NOW_US + 10**13).map(format_ts),
    "amount": st.floats(0.0, LIMITS.max_amount)
    | st.floats(-10.0, 2 * LIMITS.max_amount)
    | st.integers(-5, 10**20),
    "is_fraud": st.booleans(),
    "category": st.text(string.ascii_letters, max_size=10),
    "channel": st.text(string.ascii_letters, max_size=10),
    "country": st.text(string.ascii_uppercase, max_size=4),
}


def near_miss(fields: tuple[str, ...]):
    """Objects with the format's fields, plausible values (around every bound) with up to two of them
    replaced by any JSON value, now and then a field dropped or a stranger added: they reach every check
    past the parser, and pass some."""
    return st.builds(
        lambda values, replaced, drop, extra: (
            {k: v for k, v in (values | replaced).items() if k not in drop} | extra
        ),
        st.fixed_dictionaries({name: plausible[name] for name in fields}),
        st.dictionaries(st.sampled_from(fields), json_values, max_size=2),
        st.one_of(*[st.just(set())] * 4, st.sets(st.sampled_from(fields), max_size=2)),
        st.one_of(*[st.just({})] * 4, st.dictionaries(st.text(max_size=6), json_values, max_size=2)),
    )


def to_bytes(value, ascii_only: bool) -> bytes:
    # ensure_ascii=False with a lone surrogate writes bytes that are not UTF-8: the decoder must say so.
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def check_transaction(tx: Transaction) -> None:
    """Every bound a decoded transaction keeps."""
    for name in ("event_id", "account_id", "terminal_id"):
        text = getattr(tx, name)
        assert isinstance(text, str) and text.strip() and len(text) <= LIMITS.max_id_chars
        assert text.isprintable()
        text.encode("utf-8")  # a lone surrogate would raise here, and in every Kafka key serializer
    for name in OPTIONAL_TRANSACTION_FIELDS:
        text = getattr(tx, name)
        assert text is None or (isinstance(text, str) and text.isprintable())
    assert type(tx.amount) is float and math.isfinite(tx.amount) and 0.0 <= tx.amount <= LIMITS.max_amount
    assert type(tx.ts_us) is int
    assert LIMITS.earliest_us <= tx.ts_us <= NOW_US + LIMITS.max_ts_skew_s * 1e6


def check_label(label: Label) -> None:
    for name in ("event_id", "account_id", "terminal_id"):
        text = getattr(label, name)
        assert isinstance(text, str) and text.strip() and text.isprintable()
        assert len(text) <= LIMITS.max_id_chars
    assert type(label.is_fraud) is bool
    assert LIMITS.earliest_us <= label.label_ts_us <= NOW_US + LIMITS.max_ts_skew_s * 1e6


def decodes_or_refuses(value: bytes, decode, check) -> None:
    try:
        event = decode(value, LIMITS, NOW_US)
    except MessageError as error:
        assert str(error)  # a reason a person can read
        assert len(str(error)) < 1_000  # never the whole message
        return
    check(event)


DECODERS = {
    "transaction": (decode_transaction, check_transaction, TRANSACTION_FIELDS + OPTIONAL_TRANSACTION_FIELDS),
    "label": (decode_label, check_label, LABEL_FIELDS),
}


@pytest.mark.parametrize("kind", DECODERS)
@PROPERTY
@given(value=st.binary(max_size=300))
@example(value=b"[" * 5000)
@example(value=b'{"a":' * 3000)
@example(value=b"1" * 5000)
@example(value=b"\xff\xfe{\x00}\x00")
@example(value=b"")
def test_any_bytes_decode_or_are_refused(kind, value):
    decode, check, _ = DECODERS[kind]
    decodes_or_refuses(value, decode, check)


@pytest.mark.parametrize("kind", DECODERS)
@PROPERTY
@given(value=json_values, ascii_only=st.booleans())
def test_any_json_value_decodes_or_is_refused(kind, value, ascii_only):
    decode, check, _ = DECODERS[kind]
    decodes_or_refuses(to_bytes(value, ascii_only), decode, check)


@pytest.mark.parametrize("kind", DECODERS)
@PROPERTY
@given(data=st.data(), ascii_only=st.booleans())
def test_any_message_with_the_right_fields_decodes_or_is_refused(kind, data, ascii_only):
    decode, check, fields = DECODERS[kind]
    value = data.draw(near_miss(fields))
    decodes_or_refuses(to_bytes(value, ascii_only), decode, check)


@pytest.mark.parametrize("kind", DECODERS)
@PROPERTY
@given(
    depth=st.integers(1, 20_000),
    opener=st.sampled_from(["[", '{"k":']),
    field=st.sampled_from(["amount", "ts"]),
)
def test_deep_nesting_is_refused_before_the_parser_recurses(kind, depth, opener, field):
    decode = DECODERS[kind][0]
    closer = "]" if opener == "[" else "}"
    nested = opener * depth + "1" + closer * depth
    value = f'{{"{field}":{nested}}}'.encode()
    with pytest.raises(MessageError) as error:
        decode(value, LIMITS, NOW_US)
    if depth + 1 > LIMITS.max_json_depth and len(value) <= LIMITS.max_message_bytes:
        assert f"nested {depth + 1} deep" in str(error.value)


def reference_depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(reference_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(reference_depth, value.values()), default=0)
    return 0


@PROPERTY
@given(value=json_values, indent=st.none() | st.integers(0, 2))
def test_json_depth_counts_brackets_outside_strings_only(value, indent):
    # Keys and strings full of brackets, quotes and backslashes must not count.
    text = json.dumps(value, indent=indent).encode("utf-8", "surrogatepass")
    assert json_depth(text) == reference_depth(value)


@PROPERTY
@given(
    event_id=plausible["event_id"],
    account_id=plausible["account_id"],
    terminal_id=plausible["terminal_id"],
    ts_us=st.integers(LIMITS.earliest_us, NOW_US),
    amount=st.floats(0.0, LIMITS.max_amount),
    channel=st.none() | st.text(string.ascii_letters + " ", max_size=8),
    is_fraud=st.booleans(),
)
def test_valid_events_round_trip(event_id, account_id, terminal_id, ts_us, amount, channel, is_fraud):
    assume(terminal_id.strip())
    tx = Transaction(event_id, account_id, ts_us, amount, terminal_id, channel=channel)
    assert decode_transaction(encode_transaction(tx), LIMITS, NOW_US) == tx
    label = Label(event_id, account_id, terminal_id, is_fraud, ts_us)
    assert decode_label(encode_label(label), LIMITS, NOW_US) == label
