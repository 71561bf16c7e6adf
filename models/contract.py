"""The recurrent contract every detector keeps, and the per-account state it carries.

A detector trains in parallel (`forward` over [B, T, F]) and serves one event at a time (`step` over
[B, F]) with the same weights; `State` is what carries history from one call to the next. Shape letters:
B accounts, T events, F input columns (numeric features, then the terminal bucket index as a float); N
events of a micro-batch, several of them possibly of one account. The state's byte records are
models/state_codec.py's.
"""

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
from torch import Tensor, nn

from models.checks import is_integer, is_number, read_number

State = dict[str, Tensor]


@dataclass(frozen=True)
class StateFault:
    """Where a batch of states holds, in one of its tensors, what no sequence of steps writes there."""

    wrong: Tensor  # [B, ...] bool, the tensor's shape
    expected: str  # what a step writes there, in words
    bound: Tensor | None = None  # broadcastable to `wrong`: the most |value| a step writes, where it has one


def event_count_fault(events: Tensor, most_events: Tensor | None) -> StateFault:
    """A state's count of events [B]: >= 0, and at most most_events [B] where the caller knows it."""
    if most_events is None:
        return StateFault(events < 0, "a count >= 0")
    most = most_events.to(events)
    return StateFault(
        (events < 0) | (events > most), "a count >= 0, at most the events its account had", most
    )


def beyond(value: Tensor, bound: Tensor | float) -> Tensor:
    """value's shape, bool: |value| > bound, or not a number (NaN fails every comparison). A bound tensor
    (float64, from the weights) is compared in value's dtype and on its device, rounded up."""
    if isinstance(bound, Tensor):
        bound = rounded_up(bound, value)
    return ~(value.abs() <= bound)


def rounded_up(bound: Tensor, like: Tensor) -> Tensor:
    """bound in like's dtype and on its device, never below what it was."""
    narrow = bound.to(device=like.device, dtype=like.dtype)
    return torch.nextafter(narrow, narrow.new_tensor(math.inf)) if bound.dtype != like.dtype else narrow


@dataclass(frozen=True)
class DetectorConfig:
    """Fields every detector shares; subclasses add their own. Travels with the weights via to_dict()."""

    num_features: int = 27  # numeric inputs, pipeline/features' FEATURE_NAMES; the terminal bucket after them
    terminal_buckets: int = 4096
    d_model: int = 64
    num_layers: int = 2
    dropout: float = 0.1
    # Normalised numeric inputs are clamped to [-input_clip, input_clip], so that an extreme value (a hostile
    # amount of 1e308) cannot blow up activations or the state. Wide enough to keep every value the features
    # take: at 10 the terminal-risk features of half the compromised terminals' frauds were cut to one value,
    # with the legit events of merely risky terminals; 100 lifted every detector by about 0.02 test AP
    # (docs/benchmarks.md, "Inputs beyond the clip").
    input_clip: float = 100.0
    # A learnt embedding of the hashed terminal id. Off by default: it learns which terminals were
    # compromised in the training period, which says nothing about next week's, and costs 0.2 test AP
    # (docs/benchmarks.md, "Detection quality"); terminal risk reaches the model through its features.
    terminal_embedding: bool = False
    # A position-wise MLP on each event's encoding (residual, as a Transformer block's FFN) before the sequence
    # layers: what they accumulate over history can then be a nonlinear function of one event (a tiny amount,
    # an amount over a limit) rather than a linear projection of its features. +0.009 to +0.019 test AP for
    # every detector at the Handbook's scale (docs/benchmarks.md, "Detection quality").
    encoder_ffn: bool = True

    # Fields added after state records were first written, each with the value that rebuilds the detector as
    # it was before: a config saved without the field gets that value, and at that value the field is left
    # out of the fingerprint, so the states those detectors wrote still load.
    ADDED_FIELDS: ClassVar[dict[str, Any]] = {"encoder_ffn": False}

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
            if field.type is float:  # YAML 1.1 reads 5e-4 as a string
                value = read_number(value)
                if not is_number(value):  # a list or null would fail below as a TypeError
                    raise ValueError(f"{type(self).__name__}.{field.name} = {value!r}: expected a number")
                object.__setattr__(self, field.name, value)
            if field.type is int and (not is_integer(value) or value < 1):
                raise ValueError(f"{type(self).__name__}.{field.name} = {value!r}: expected an integer >= 1")
            # A switch must be a bool: the string "false" (a hand-written JSON config) would be truthy.
            if field.type is bool and not isinstance(value, bool):
                raise ValueError(f"{type(self).__name__}.{field.name} = {value!r}: expected true or false")
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
        return cls(**{**cls.ADDED_FIELDS, **values})

    def fingerprint(self) -> bytes:
        """8 bytes identifying this exact config: a state written under another config must not load."""
        values = {
            name: value
            for name, value in self.to_dict().items()
            if name not in self.ADDED_FIELDS or value != self.ADDED_FIELDS[name]
        }
        text = json.dumps({"type": type(self).__name__, **values}, sort_keys=True)
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
    - `step_in_place(x [N,F], table, rows [N]) -> scores [N]`: N events, event i of the account at row
      rows[i] of a batched state table; an account may have several, applied in their order; the new
      states are written over the old ones. Equal to `step` one event at a time. Every detector has it:
      the default here steps in rounds (gather, step, scatter, one event of each account a round); a
      detector with a faster path for some inputs overrides it and calls this one for the rest.
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

    def step_in_place(self, x: Tensor, table: State, rows: Tensor) -> Tensor:
        """Apply events x [N, F] to the accounts at `rows` [N] of `table` ({key: [capacity, ...]}), in order
        (a row may repeat: its events apply one after the other), writing the new states into `table`;
        returns the scores [N]. Equal to `step` one event at a time, to float rounding.

        Here in rounds: round r gathers the states of the accounts with an r-th event in the batch, takes
        one batched `step` over them and scatters the new states back, so a batch costs one `step` per
        event of its busiest account, however many accounts it holds."""
        scores = torch.empty(len(rows), dtype=x.dtype, device=x.device)
        for positions in rounds_of(rows):  # [b] one event of each of b accounts
            index = rows[positions]
            scores[positions], state = self.step(x[positions], gather_states(table, index))
            scatter_states(table, index, state)
        return scores

    def state_faults(self, state: State, most_events: Tensor | None = None) -> dict[str, StateFault]:
        """What no sequence of steps writes into a batch of states [B, ...] (records restored from bytes), by
        key; most_events [B] int64, where the caller knows it: the most events each state can have stepped.
        Here what any state keeps: finite floats, counts >= 0. A detector whose layout and weights bound
        its state tighter says so (its own file): the codec refuses a record that breaks a bound."""
        return {
            key: StateFault(~torch.isfinite(value), "a finite value")
            if value.is_floating_point()
            else StateFault(value < 0, "a count >= 0")
            for key, value in state.items()
        }

    @property
    def score_has_gradient(self) -> bool:
        """Whether a score's gradient with respect to the inputs means something: models/attribution.py
        then splits it by integrated gradients, else by moving one input at a time. True for a network; a
        detector whose score is piecewise constant in its inputs (trees) says False."""
        return True

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


def rounds_of(rows: Tensor) -> list[Tensor]:
    """Positions of `rows` [N] in rounds: round r holds each account's (r+1)-th event, in arrival order."""
    if len(rows) == 0:
        return []
    rank = earlier_occurrences(rows)  # [N] the event's round
    by_round = torch.argsort(rank, stable=True)  # round 0 first, arrival order within a round
    return list(by_round.split(torch.bincount(rank).tolist()))


def gather_states(store: State, index: Tensor) -> State:
    """States of accounts `index` [b] out of a batched store, as a new batch of b (copies)."""
    return {key: value.index_select(0, index) for key, value in store.items()}


def scatter_states(store: State, index: Tensor, part: State) -> None:
    """Write `part` (batch of b) back into `store` at rows `index` [b], in place."""
    for key, value in store.items():
        value.index_copy_(0, index, part[key].to(value.dtype))


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
