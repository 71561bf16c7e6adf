"""Gradient-boosted trees as tensors: a fitted ensemble evaluated by torch, in a batch, on any device.

A tree is a table of nodes: the feature a node splits on, its threshold, its two children, whether it is a
leaf and the leaf's value. Every tree of the ensemble is padded to the same number of nodes M (padding nodes
are leaves worth 0), so T trees are [T, M] tensors and a batch of N rows descends all of them at once:
`depth` rounds of gather-compare-select, one node per (row, tree) each round, then one gather of leaf values.

The reference is the library that fitted the trees (a row goes left when its value is <= the threshold, or
when it is NaN and the node sends missing values left): tests/models/test_tree_ensemble.py holds the two
equal. Thresholds are kept in float32 rounded *down*, so a float32 input compares with the float32
threshold exactly as it compares with the float64 one it was fitted with.
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class TreeArrays:
    """A fitted ensemble as numpy arrays, every tree padded to M nodes; node 0 is each tree's root."""

    feature: np.ndarray  # [T, M] int64, the input column a node splits on
    threshold: np.ndarray  # [T, M] float64, go left when x <= threshold
    left: np.ndarray  # [T, M] int64, child node index
    right: np.ndarray  # [T, M] int64
    missing_left: np.ndarray  # [T, M] bool, where NaN goes
    is_leaf: np.ndarray  # [T, M] bool
    value: np.ndarray  # [T, M] float64, a leaf's contribution to the raw score
    baseline: float  # the raw score before any tree
    depth: int  # the deepest leaf's depth (the root is at depth 0)


class TreeEnsemble(nn.Module):
    """rows [N, K] -> raw scores [N] = baseline + the sum over trees of the leaf each row reaches."""

    def __init__(self, trees: int, nodes: int, depth: int):
        super().__init__()
        self.depth = depth
        self.register_buffer("feature", torch.zeros(trees, nodes, dtype=torch.long))
        self.register_buffer("threshold", torch.zeros(trees, nodes))
        self.register_buffer("left", torch.zeros(trees, nodes, dtype=torch.long))
        self.register_buffer("right", torch.zeros(trees, nodes, dtype=torch.long))
        self.register_buffer("missing_left", torch.zeros(trees, nodes, dtype=torch.bool))
        self.register_buffer("is_leaf", torch.ones(trees, nodes, dtype=torch.bool))
        self.register_buffer("value", torch.zeros(trees, nodes))
        self.register_buffer("baseline", torch.zeros(()))

    @torch.no_grad()
    def load_arrays(self, arrays: TreeArrays) -> None:
        """Copy a fitted ensemble in; its shape must be this module's [T, M] and depth."""
        if arrays.feature.shape != tuple(self.feature.shape) or arrays.depth != self.depth:
            raise ValueError(
                f"tree ensemble of shape {arrays.feature.shape}, depth {arrays.depth}, does not fit a module "
                f"built for {tuple(self.feature.shape)}, depth {self.depth}"
            )
        threshold = arrays.threshold.astype(np.float32)
        too_high = threshold.astype(np.float64) > arrays.threshold
        threshold[too_high] = np.nextafter(threshold[too_high], np.float32(-np.inf))
        for name, values in (
            ("feature", arrays.feature),
            ("threshold", threshold),
            ("left", arrays.left),
            ("right", arrays.right),
            ("missing_left", arrays.missing_left),
            ("is_leaf", arrays.is_leaf),
            ("value", arrays.value),
        ):
            buffer = getattr(self, name)
            buffer.copy_(torch.from_numpy(np.ascontiguousarray(values)).to(buffer.dtype))
        self.baseline.fill_(arrays.baseline)

    def forward(self, rows: Tensor) -> Tensor:
        N, T = rows.shape[0], self.feature.shape[0]
        tree = torch.arange(T, device=rows.device).expand(N, T)  # [N, T]
        node = torch.zeros(N, T, dtype=torch.long, device=rows.device)  # [N, T] every row at every root
        for _ in range(self.depth):
            x = rows.gather(1, self.feature[tree, node])  # [N, T] the value each node looks at
            go_left = (x <= self.threshold[tree, node].to(x.dtype)) | (
                x.isnan() & self.missing_left[tree, node]
            )
            child = torch.where(go_left, self.left[tree, node], self.right[tree, node])
            node = torch.where(self.is_leaf[tree, node], node, child)
        return self.baseline.to(rows.dtype) + self.value[tree, node].to(rows.dtype).sum(1)
