"""Delta records: one scored batch's terminal event counts, for every other instance and the table writer.

A scorer writes one per batch that featurized events, to `terminal-deltas` in the batch's transaction, keyed
by its SESSION: the instance and how many times it has restored its terminal state. Its own session's deltas
are already in its state (it folded those events as it scored them), so it skips them when it reads the
topic; every other record, its own older sessions' included, it folds in. A restore starts a new session.
The table writer folds them all (consumers/terminals/table.py has the whole flow).

Value: the table's header (magic TXD1, state and feature versions), then JSON [terminal ids, epoch days],
one entry per event, in the order they were folded (the order does not matter: the fold is order-free).
A batch whose value would pass DELTA_VALUE_BYTES writes several, each folded on its own.
"""

import json

import numpy as np

from consumers.scoring.message_limits import DEFAULT_LIMITS, MessageError, MessageLimits, text
from consumers.terminals.table import HEADER_SIZE, check_header, pack_header
from pipeline.features.state import MAX_EPOCH_DAY
from pipeline.features.stream_batches import TerminalOp

_MAGIC = b"TXD1"
_EVENTS = "events"
# Half of the broker's and the producer's default largest record (1 MiB): a batch's deltas split beyond it.
DELTA_VALUE_BYTES = 512 * 1024


def encode_deltas(ops: list[TerminalOp]) -> list[bytes]:
    """The events ops of a batch's terminal journal as delta values, each at most DELTA_VALUE_BYTES (none
    when it counted no event). Report ops (labels) are left out: every instance reads the labels itself."""
    terminals: list[str] = []
    days: list[int] = []
    for op in ops:
        if op.kind == _EVENTS:
            terminals += op.terminals
            days += op.days.tolist()
    return _values(terminals, days) if terminals else []


def _values(terminals: list[str], days: list[int]) -> list[bytes]:
    """[terminals, days] as one value, or halved until each part fits DELTA_VALUE_BYTES: a batch of valid
    events with long non-ASCII terminal ids (12 bytes a character, escaped) can run past what the broker
    takes in one record, and a record it refuses fails the batch's transaction every time it is tried."""
    value = pack_header(_MAGIC) + json.dumps([terminals, days], separators=(",", ":")).encode()
    if len(value) <= DELTA_VALUE_BYTES or len(terminals) == 1:
        return [value]
    half = len(terminals) // 2
    return _values(terminals[:half], days[:half]) + _values(terminals[half:], days[half:])


def decode_deltas(
    where: str, data: bytes, days: tuple[int, int] = (0, MAX_EPOCH_DAY), limits: MessageLimits | None = None
) -> TerminalOp:
    """One delta value as an events op: a list of terminal ids as the transaction decoder accepts them under
    `limits` (default MessageLimits()), and a list of as many integer epoch days within `days` (first,
    last). A value that is not one: MessageError naming `where` (its readers skip it, the table writer
    dead-letters it), one of another version too: that stops no reader, and its text says what to do."""
    try:
        check_header(f"terminal delta record at {where}", data, _MAGIC, "terminal_deltas_topic")
    except MessageError:
        raise
    except ValueError as error:  # another version's: one such record must not stop every scorer's feed
        raise MessageError(f"{error} (skipped: its events are missing from the terminal counts)") from None
    limits = DEFAULT_LIMITS if limits is None else limits
    try:
        terminals, day_list = json.loads(data[HEADER_SIZE:])
        if not isinstance(terminals, list) or not isinstance(day_list, list):
            raise TypeError("expected [[terminal ids], [epoch days]]")
        if not all(isinstance(terminal, str) for terminal in terminals):
            raise TypeError("a terminal id that is not a string")
        for terminal in set(terminals):  # no event could carry an id the decoder refuses
            text(terminal, "terminal_id", limits)
        if not all(type(day) is int for day in day_list):  # not a float, a bool or a string of digits
            raise TypeError("an epoch day that is not an integer")
        op = TerminalOp(_EVENTS, terminals, np.asarray(day_list, dtype=np.int64))
    # RecursionError: nested deeper than the parser goes; OverflowError: a day beyond int64
    except (ValueError, TypeError, RecursionError, OverflowError) as error:
        raise MessageError(f"terminal delta record at {where} does not decode: {error}"[:300]) from None
    if op.days.shape != (len(op.terminals),):
        raise MessageError(
            f"terminal delta record at {where} has {len(op.terminals)} terminals, {op.days.shape} days"
        )
    first, last = days
    if len(op.days) and not (first <= int(op.days.min()) and int(op.days.max()) <= last):
        raise MessageError(
            f"terminal delta record at {where} has days {int(op.days.min())}..{int(op.days.max())}, outside "
            f"{first}..{last}: no event could have them"
        )
    return op
