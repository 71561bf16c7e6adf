"""Hybrid detector: a sequence detector's score over the account's history, and gradient-boosted trees that
read it beside the event's own features.

Trees find the sharp per-event rules (an amount over a limit, a terminal's recent fraud count) in a few
splits; the sequence detector carries what only history shows (a change of habits, a burst of small
payments). The hybrid's score is the trees' raw score over [event features, base score]: one model, trained,
versioned and served as one. Its state is the base detector's, unchanged, so it keeps every promise of the
recurrent contract: `forward` and `step` agree because the base's do and the trees read one event at a time
(up to a leaf, where the two paths' base scores, equal to float error, fall either side of a split point).

Until its trees are fitted (`fit_head`, in pipeline/training/hybrid_head.py) the hybrid scores exactly as its
base: an unfitted head passes the base score through.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from models.contract import DetectorConfig, RecurrentDetector, State, StateFault
from models.tree_ensemble import TreeArrays, TreeEnsemble


@dataclass(frozen=True)
class HybridConfig(DetectorConfig):
    """The shared fields (d_model, num_layers, ...) are the base detector's; `base_extra` holds its own."""

    base: str = "linear_transformer"
    # (field, value) pairs of the base's own fields, sorted: a config must hash (dicts and lists do not)
    base_extra: tuple[tuple[str, Any], ...] = ()
    # The fitted head's size (1, 1, 1: not fitted yet); the artifact loader builds the buffers from these.
    trees: int = 1
    tree_nodes: int = 1
    tree_depth: int = 1

    TINY: ClassVar[dict[str, Any]] = {**DetectorConfig.TINY, "base": "lstm"}

    def __post_init__(self) -> None:
        super().__post_init__()
        extra = self.base_extra.items() if isinstance(self.base_extra, dict) else self.base_extra
        object.__setattr__(self, "base_extra", tuple(sorted((str(k), _frozen(v)) for k, v in extra)))

    def shared(self) -> dict[str, Any]:
        """The base detector's fields that every detector has."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(DetectorConfig)}


def _frozen(value: Any) -> Any:
    """Lists (as JSON gives them back) as tuples, all the way down."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list | tuple) else value


class HybridDetector(RecurrentDetector):
    name: ClassVar[str] = "hybrid"

    def __init__(self, config: HybridConfig, base: RecurrentDetector):
        super().__init__()
        if base.name != config.base or base.config.num_features != config.num_features:
            raise ValueError(
                f"hybrid: config names base {config.base!r} with {config.num_features} features, got a "
                f"{base.name!r} with {base.config.num_features}"
            )
        self.config = config
        self.base = base
        self.head = TreeEnsemble(config.trees, config.tree_nodes, config.tree_depth)
        self.register_buffer("fitted", torch.zeros((), dtype=torch.bool))

    def fit_head(self, arrays: TreeArrays) -> None:
        """Install fitted trees over [the F numeric features, the base score] (K = F + 1 columns)."""
        self.head.load_arrays(arrays)
        self.fitted.fill_(True)

    @property
    def score_has_gradient(self) -> bool:
        # fitted trees are piecewise constant, and run without autograd: no gradient to integrate
        return not bool(self.fitted)

    def head_score(self, x: Tensor, base_score: Tensor) -> Tensor:
        """The score [...] of events x [..., F + 1] (numeric features, terminal bucket) that the base scored
        base_score [...]: what the fitted trees make of both, base_score itself until they are fitted."""
        if not bool(self.fitted):
            return base_score
        rows = torch.cat([x[..., :-1], base_score[..., None]], -1)  # [..., K]
        return self.head(rows.reshape(-1, rows.shape[-1])).reshape(base_score.shape)

    def init_state(self, batch_size: int) -> State:
        return self.base.init_state(batch_size)

    def state_faults(self, state: State, most_events: Tensor | None = None) -> dict[str, StateFault]:
        return self.base.state_faults(state, most_events)

    def forward(
        self, x: Tensor, state: State | None = None, lengths: Tensor | None = None
    ) -> tuple[Tensor, State]:
        scores, final = self.base(x, state, lengths)  # [B, T]
        return self.head_score(x, scores), final

    def step(self, x_t: Tensor, state: State) -> tuple[Tensor, State]:
        scores, new_state = self.base.step(x_t, state)  # [B]
        return self.head_score(x_t, scores), new_state

    def step_in_place(self, x: Tensor, table: State, rows: Tensor) -> Tensor:
        return self.head_score(x, self.base.step_in_place(x, table, rows))
