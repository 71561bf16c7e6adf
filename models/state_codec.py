"""The byte codec of detector states: one versioned, fixed-size record per account.

Record layout (little-endian):

    MAGIC (4 bytes) | STATE_VERSION (u16) | name length (u8) | detector name (utf-8)
    | config fingerprint (8 bytes) | dtype code (u8) | payload: the state tensors, keys in sorted order,
      each as raw bytes of its dtype, batch axis dropped

Bump STATE_VERSION whenever the payload layout of any detector changes. A record that does not match the
detector reading it is refused with what differs and what to do about it.
"""

import struct
import sys

import numpy as np
import torch
from torch import Tensor

from models.contract import RecurrentDetector, State

MAGIC = b"TXSS"
STATE_VERSION = 1
_FLOAT_CODES = {torch.float32: 1, torch.float64: 2}
_CODE_FLOATS = {code: dtype for dtype, code in _FLOAT_CODES.items()}
if sys.byteorder != "little":  # the records are raw little-endian bytes
    raise ImportError("models.state_codec writes state records as little-endian; this machine is big-endian")


def _layout(detector: RecurrentDetector) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    with torch.no_grad():
        template = detector.init_state(1)
    return [(key, tuple(template[key].shape[1:]), template[key].dtype) for key in sorted(template)]


def _header(detector: RecurrentDetector) -> bytes:
    name = detector.name.encode()
    return (
        MAGIC
        + struct.pack("<HB", STATE_VERSION, len(name))
        + name
        + detector.config.fingerprint()
        + struct.pack("<B", _FLOAT_CODES[detector.state_dtype])
    )


# (detector name, config, state dtype) -> (layout, header): both are fixed for a config and dtype, and the
# service encodes thousands of account records per poll, so they are worked out once.
_CODECS: dict[tuple, tuple[list[tuple[str, tuple[int, ...], torch.dtype]], bytes]] = {}


def _codec(detector: RecurrentDetector) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], bytes]:
    key = (detector.name, detector.config, detector.state_dtype)
    if key not in _CODECS:
        _CODECS[key] = (_layout(detector), _header(detector))
    return _CODECS[key]


def _payload_bytes(layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> int:
    return sum(int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size() for _, shape, dtype in layout)


class StateRecordError(ValueError):
    """A state record this detector cannot load: `row`, its place in the batch decoded, and `reason`; the
    text reads "state record ROW: REASON". `corrupt`: the record is this detector's, but holds values no
    step writes (otherwise it was written by another detector, config or version); `rows`: every row of
    the batch with such a fault, `row` first."""

    def __init__(self, row: int, reason: str, corrupt: bool = False, rows: tuple[int, ...] = ()):
        super().__init__(f"state record {row}: {reason}")
        self.row, self.reason, self.corrupt, self.rows = row, reason, corrupt, rows or (row,)


def encode_state(detector: RecurrentDetector, state: State) -> list[bytes]:
    """One versioned record per account of a batched state."""
    return [row.tobytes() for row in encode_state_rows(detector, state)]


def encode_state_rows(detector: RecurrentDetector, state: State) -> np.ndarray:
    """encode_state as one array [B, record bytes] uint8, row b account b's record: for callers that join
    it to more columns before cutting records (consumers/scoring/account_state.py)."""
    layout, header = _codec(detector)
    if sorted(state) != [key for key, _, _ in layout]:
        raise ValueError(
            f"{detector.name}: state has keys {sorted(state)}, expected {[k for k, _, _ in layout]}"
        )
    batch = next(iter(state.values())).shape[0]
    columns = []
    for key, shape, dtype in layout:
        value = state[key]
        if tuple(value.shape) != (batch, *shape) or value.dtype != dtype:
            raise ValueError(
                f"{detector.name}: state[{key!r}] is {value.dtype} {list(value.shape)}, "
                f"expected {dtype} {[batch, *shape]}"
            )
        array = value.detach().to("cpu").contiguous().numpy().reshape(batch, -1)
        columns.append(array.view(np.uint8))  # [B, bytes of this tensor per account]
    prefix = np.broadcast_to(np.frombuffer(header, dtype=np.uint8), (batch, len(header)))
    return np.concatenate([prefix, *columns], axis=1)


def decode_state(
    detector: RecurrentDetector, records: list[bytes], most_events: Tensor | None = None
) -> State:
    """Inverse of encode_state: a batch of len(records) accounts, on the detector's device; most_events [B],
    where the caller knows it: the most events each state can have stepped (decode_state_rows).

    Raises ValueError naming the first record that does not match this detector and what to do about it.
    """
    layout, header = _codec(detector)
    expected = len(header) + _payload_bytes(layout)
    for i, record in enumerate(records):
        if len(record) != expected or not record.startswith(header):
            raise StateRecordError(i, _mismatch(detector, record, header, expected))
    rows = np.frombuffer(b"".join(records), dtype=np.uint8).reshape(len(records), expected)
    return decode_state_rows(detector, rows, most_events)


def decode_state_rows(
    detector: RecurrentDetector, rows: np.ndarray, most_events: Tensor | None = None
) -> State:
    """decode_state of records laid out as one array [B, record bytes] uint8 (the inverse of
    encode_state_rows): the header check is one comparison for the whole batch, not one per record.

    Raises ValueError naming the first row that does not match this detector and what to do about it;
    StateRecordError (corrupt) for rows holding what no steps write (detector.state_faults, given
    most_events [B]: the most events each state can have stepped, where the caller knows it).
    """
    layout, header = _codec(detector)
    expected = len(header) + _payload_bytes(layout)
    if rows.ndim != 2 or rows.shape[1] != expected:
        first = bytes(rows[0]) if rows.ndim == 2 and len(rows) else b""
        raise StateRecordError(0, _mismatch(detector, first, header, expected))
    bad = np.flatnonzero((rows[:, : len(header)] != np.frombuffer(header, dtype=np.uint8)).any(axis=1))
    if len(bad):
        raise StateRecordError(int(bad[0]), _mismatch(detector, bytes(rows[bad[0]]), header, expected))
    state, offset = {}, len(header)
    for key, shape, dtype in layout:
        width = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        chunk = rows[:, offset : offset + width].copy()  # contiguous rows, writable, aligned
        state[key] = torch.from_numpy(chunk).view(dtype).reshape(len(rows), *shape)
        offset += width
    _refuse_what_no_step_writes(detector, state, most_events)
    return {key: value.to(detector.device) for key, value in state.items()}


def _refuse_what_no_step_writes(
    detector: RecurrentDetector, state: State, most_events: Tensor | None
) -> None:
    """Raise StateRecordError (corrupt) for the rows of a decoded batch that hold what no sequence of steps
    writes (the detector's state_faults: a NaN, a negative count, a value beyond the bound its weights
    give), naming the first row's first such value. Restored, one would make every later score of its
    account NaN, raise, or stay pinned where no events lead."""
    with torch.no_grad():
        faults = detector.state_faults(state, most_events)
        rows = {key: _rows(fault.wrong) for key, fault in faults.items()}
        bad = torch.stack(list(rows.values())).any(0) if rows else torch.zeros(0, dtype=torch.bool)
        if not bad.any():
            return
        every = torch.nonzero(bad).flatten().tolist()
        row = every[0]
        key = next(key for key, wrong in rows.items() if wrong[row])
        fault = faults[key]
        at = tuple(torch.nonzero(fault.wrong[row])[0].tolist())  # the first such value within the record
        shown = f"{key!r} holds {state[key][row][at].item():.6g}" + (f" at {list(at)}" if at else "")
        if fault.bound is not None:
            bound = torch.broadcast_to(fault.bound, fault.wrong.shape)[row][at].item()
            shown += f", expected {fault.expected} (here {bound:.6g})"
        else:
            shown += f", expected {fault.expected}"
    raise StateRecordError(
        row,
        f"{detector.name!r} state {shown}, which no step writes: the record is corrupt; rebuild the state by "
        "replaying the account's history",
        corrupt=True,
        rows=tuple(every),
    )


def _rows(wrong: Tensor) -> Tensor:
    """[B] whether each row of wrong [B, ...] holds a wrong value."""
    return wrong if wrong.dim() == 1 else wrong.flatten(1).any(1)


def encode_account_state(detector: RecurrentDetector, state: State) -> bytes:
    """The record of a single account (a state of batch 1)."""
    batch = next(iter(state.values())).shape[0]
    if batch != 1:
        raise ValueError(f"encode_account_state takes a state of one account, got a batch of {batch}")
    return encode_state(detector, state)[0]


def decode_account_state(
    detector: RecurrentDetector, record: bytes, most_events: Tensor | None = None
) -> State:
    """A state of batch 1 from one account's record; most_events [1]: the most events it can have stepped."""
    return decode_state(detector, [record], most_events)


def _mismatch(detector: RecurrentDetector, record: bytes, header: bytes, expected: int) -> str:
    rebuild = "restore with the model artifact that wrote it, or rebuild the state by replaying the account's history"
    if not record.startswith(MAGIC):
        return f"not a txsentinel detector state (starts with {record[:4]!r}, expected {MAGIC!r})"
    if len(record) < 7:
        return f"truncated: {len(record)} bytes"
    version, name_len = struct.unpack_from("<HB", record, 4)
    if version != STATE_VERSION:
        return (
            f"state version {version}, this build reads version {STATE_VERSION}: the state layout changed; "
            f"{rebuild} through this model"
        )
    name = record[7 : 7 + name_len].decode(errors="replace")
    if name != detector.name:
        return f"state of detector {name!r}, but this model is {detector.name!r}; {rebuild}"
    at = 7 + name_len
    fingerprint = record[at : at + 8]
    if fingerprint != detector.config.fingerprint():
        return (
            f"written by a {name!r} with config fingerprint {fingerprint.hex()}, this model's is "
            f"{detector.config.fingerprint().hex()} ({detector.config.to_dict()}); {rebuild}"
        )
    code = record[at + 8] if len(record) > at + 8 else None
    if code != _FLOAT_CODES[detector.state_dtype]:
        return (
            f"state stored as {_CODE_FLOATS.get(code, f'unknown dtype code {code}')}, this model serves "
            f"{detector.state_dtype}: cast the model (detector.to(dtype)) to the state's dtype, or rebuild the state"
        )
    if record[: len(header)] != header:
        return "header does not match this detector"
    return f"{len(record)} bytes, expected {expected} for {detector.name!r} with this config: the record is corrupt"
