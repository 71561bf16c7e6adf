"""The recurrent contract every detector keeps, the per-account state it carries, and that state's byte codec.

A detector trains in parallel (`forward` over [B, T, F]) and serves one event at a time (`step` over
[B, F]) with the same weights; `State` is what carries history from one call to the next. Shape letters:
B accounts, T events, F input columns (numeric features, then the terminal bucket index as a float).

State record layout (one per account, little-endian):

    MAGIC (4 bytes) | STATE_VERSION (u16) | name length (u8) | detector name (utf-8)
    | config fingerprint (8 bytes) | dtype code (u8) | payload: the state tensors, keys in sorted order,
      each as raw bytes of its dtype, batch axis dropped

Bump STATE_VERSION whenever the payload layout of any detector changes.
"""

import dataclasses
import hashlib
import json
import struct
import sys
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import numpy as np
import torch
from torch import Tensor, nn

State = dict[str, Tensor]

MAGIC = b"TXSS"
STATE_VERSION = 1
_FLOAT_CODES = {torch.float32: 1, torch.float64: 2}
_CODE_FLOATS = {code: dtype for dtype, code in _FLOAT_CODES.items()}
if sys.byteorder != "little":  # the records are raw little-endian bytes
    raise ImportError("models.contract writes state records as little-endian; this machine is big-endian")


@dataclass(frozen=True)
class DetectorConfig:
    """Fields every detector shares; subclasses add their own. Travels with the weights via to_dict()."""

    num_features: int = 26  # numeric input columns; the terminal bucket column comes after them
    terminal_buckets: int = 4096
    d_model: int = 64
    num_layers: int = 2
    dropout: float = 0.1
    input_clip: float = 10.0  # normalised numeric inputs are clamped to [-input_clip, input_clip]

    TINY: ClassVar[dict[str, Any]] = {
        "num_features": 5,
        "terminal_buckets": 16,
        "d_model": 8,
        "num_layers": 2,
        "dropout": 0.0,
    }

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type is int and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{type(self).__name__}.{field.name} = {value!r}: expected an integer >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{type(self).__name__}.dropout = {self.dropout!r}: expected 0 <= dropout < 1")
        if not self.input_clip > 0:
            raise ValueError(f"{type(self).__name__}.input_clip = {self.input_clip!r}: expected > 0")

    @classmethod
    def tiny(cls, **overrides: Any) -> Self:
        """A few-hundred-parameter config for tests."""
        return cls(**{**cls.TINY, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Self:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"{cls.__name__} has no field(s) {unknown}; known fields: {sorted(known)}. "
                "Was the config written for another detector or a newer txsentinel?"
            )
        return cls(**values)

    def fingerprint(self) -> bytes:
        """8 bytes identifying this exact config: a state written under another config must not load."""
        text = json.dumps({"type": type(self).__name__, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(text.encode()).digest()[:8]


class RecurrentDetector(nn.Module):
    """Base of every detector: parallel `forward` for training, `step` for serving, one set of weights.

    Subclasses implement `init_state`, `forward` and `step` with these semantics:
    - `init_state(B)`: the state of B accounts with no history; batch-first tensors of fixed size.
    - `forward(x [B,T,F], state=None, lengths=None) -> (scores [B,T], final_state)`: causal (score t sees
      events <= t), starting from `state` (init_state when None). `lengths` [B] marks right-padding:
      positions >= lengths[b] are padding, their scores are don't-care and they never touch the state, so
      final_state is each account's state after its own last valid event (an account with length 0 keeps
      its state). Gradients flow into `state` unless the caller detaches it (truncated BPTT).
    - `step(x_t [B,F], state) -> (scores [B], new_state)`: one event per account; the input state is never
      modified.
    - optionally `step_in_place(x [N,F], table, rows [N]) -> scores [N] or None`: N events, event i of the
      account at row rows[i] of a batched state table; an account may have several, applied in their
      order; the new states are written over the old ones. Equal to `step` one event at a time. None
      where the detector has no such path for these inputs (the caller steps in rounds instead: gather,
      step, scatter, one event of each account a round).
    Scores are logits: sigmoid gives a probability, higher is more suspicious.
    """

    name: ClassVar[str]
    config: DetectorConfig

    def init_state(self, batch_size: int) -> State:
        raise NotImplementedError

    def forward(
        self, x: Tensor, state: State | None = None, lengths: Tensor | None = None
    ) -> tuple[Tensor, State]:
        raise NotImplementedError

    def step(self, x_t: Tensor, state: State) -> tuple[Tensor, State]:
        raise NotImplementedError

    def step_in_place(self, x: Tensor, table: State, rows: Tensor) -> Tensor | None:
        """Serving fast path, where a detector has one: apply events x [N, F] to the accounts at `rows` [N]
        of `table` ({key: [capacity, ...]}), in order (a row may repeat: its events apply one after the
        other), writing the new states into `table`; returns the scores [N]. Equal to `step` one event at
        a time, to float rounding. None: no fast path here."""
        return None

    @property
    def state_dtype(self) -> torch.dtype:
        """Float dtype of the serving state: the weights' dtype, never below float32."""
        dtype = next(self.parameters()).dtype
        return torch.promote_types(dtype, torch.float32)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def _check_input(self, x: Tensor, dims: int) -> None:
        columns = self.config.num_features + 1
        if x.dim() != dims or x.shape[-1] != columns:
            shape = "[B, T, F]" if dims == 3 else "[B, F]"
            raise ValueError(
                f"{self.name}: expected input of shape {shape} with F = {columns} "
                f"({self.config.num_features} numeric features + the terminal bucket column), "
                f"got {list(x.shape)}"
            )

    def _padding(self, x: Tensor, lengths: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        # -> x with padded events zeroed (so any filler is harmless), lengths [B] int64, valid [B, T] bool
        B, T, _ = x.shape
        if lengths is None:
            lengths = torch.full((B,), T, dtype=torch.long, device=x.device)
            return x, lengths, torch.ones(B, T, dtype=torch.bool, device=x.device)
        lengths = lengths.to(device=x.device, dtype=torch.long)
        if lengths.shape != (B,) or bool(((lengths < 0) | (lengths > T)).any()):
            raise ValueError(
                f"{self.name}: lengths must be [B] = [{B}] integers in [0, T = {T}], got {lengths.tolist()}"
            )
        valid = torch.arange(T, device=x.device)[None, :] < lengths[:, None]  # [B, T]
        return x.masked_fill(~valid[..., None], 0.0), lengths, valid


# --- moving states around: the service gathers a micro-batch's states, steps, scatters them back ---


def earlier_occurrences(rows: Tensor) -> Tensor:
    """[N] how many earlier entries of `rows` [N] equal each one: an event's round when rows are accounts."""
    n = len(rows)
    order = torch.argsort(rows, stable=True)  # grouped by value, original order within
    grouped = rows[order]
    first = torch.ones(n, dtype=torch.bool, device=rows.device)
    first[1:] = grouped[1:] != grouped[:-1]
    position = torch.arange(n, device=rows.device)
    group_start = torch.cummax(torch.where(first, position, 0), 0).values
    rank = torch.empty_like(position)
    rank[order] = position - group_start
    return rank


def gather_states(store: State, index: Tensor) -> State:
    """States of accounts `index` [b] out of a batched store, as a new batch of b (copies)."""
    return {key: value.index_select(0, index) for key, value in store.items()}


def scatter_states(store: State, index: Tensor, part: State) -> None:
    """Write `part` (batch of b) back into `store` at rows `index` [b], in place."""
    for key, value in store.items():
        value.index_copy_(0, index, part[key].to(value.dtype))


def concat_states(states: list[State]) -> State:
    """One batch out of several (e.g. single accounts decoded one by one)."""
    return {key: torch.cat([s[key] for s in states]) for key in states[0]}


def where_state(keep_new: Tensor, new: State, old: State) -> State:
    """Per account [B] bool: `new` where True, else `old`."""
    out = {}
    for key, value in new.items():
        mask = keep_new.view(-1, *([1] * (value.dim() - 1)))
        out[key] = torch.where(mask, value, old[key])
    return out


def detach_state(state: State) -> State:
    """Cut the graph at a chunk boundary (truncated BPTT)."""
    return {key: value.detach() for key, value in state.items()}


# --- byte codec ---


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


def decode_state(detector: RecurrentDetector, records: list[bytes]) -> State:
    """Inverse of encode_state: a batch of len(records) accounts, on the detector's device.

    Raises ValueError naming the first record that does not match this detector and what to do about it.
    """
    layout, header = _codec(detector)
    expected = len(header) + _payload_bytes(layout)
    for i, record in enumerate(records):
        if len(record) != expected or not record.startswith(header):
            raise ValueError(f"state record {i}: {_mismatch(detector, record, header, expected)}")
    if not records:
        return {
            key: torch.empty(0, *shape, dtype=dtype, device=detector.device) for key, shape, dtype in layout
        }
    rows = np.frombuffer(b"".join(records), dtype=np.uint8).reshape(len(records), expected)
    rows = rows[:, len(header) :]
    state, offset = {}, 0
    for key, shape, dtype in layout:
        width = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        chunk = rows[:, offset : offset + width].copy()  # contiguous rows, writable, aligned
        tensor = torch.from_numpy(chunk).view(dtype).reshape(len(records), *shape)
        state[key] = tensor.to(detector.device)
        offset += width
    return state


def encode_account_state(detector: RecurrentDetector, state: State) -> bytes:
    """The record of a single account (a state of batch 1)."""
    batch = next(iter(state.values())).shape[0]
    if batch != 1:
        raise ValueError(f"encode_account_state takes a state of one account, got a batch of {batch}")
    return encode_state(detector, state)[0]


def decode_account_state(detector: RecurrentDetector, record: bytes) -> State:
    """A state of batch 1 from one account's record."""
    return decode_state(detector, [record])


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
