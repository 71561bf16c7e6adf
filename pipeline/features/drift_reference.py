"""A training-period distribution to measure drift against: quantile bins and their proportions, and the
population stability index (PSI) of live counts in the same bins.

A reference is `{"edges": [...], "proportions": [...]}`: the interior bin edges (the training values'
deciles, repeated ones merged, so a flag that is 0 on most events gets two bins, not ten) and the share of
training values in each of the len(edges) + 1 bins. `bin_index` is the one rule both sides bin by, so the
training proportions and the live counts always mean the same bins.

PSI = sum over bins of (live - reference) * ln(live / reference), shares floored at PSI_FLOOR so an empty bin
is a large term, not an infinite one. The usual reading: < 0.1 stable, 0.1-0.25 moving, > 0.25 shifted.
"""

from typing import Any

import numpy as np

BINS = 10  # deciles of the training values
PSI_FLOOR = 1e-4  # a bin's share is at least this in the PSI sum (an empty bin would be ln 0)


def bin_index(edges: np.ndarray, values: np.ndarray) -> np.ndarray:
    """[N] values -> [N] bin in 0 .. len(edges); bins are (edge i-1, edge i], NaN goes to the last bin."""
    return np.searchsorted(edges, values, side="left")


def fit_reference(values: np.ndarray, bins: int = BINS) -> dict[str, list[float]]:
    """The reference of [N] finite training values: quantile edges and each bin's share."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    values = values[np.isfinite(values)]
    if len(values) == 0:
        raise ValueError("no finite values to fit a drift reference on")
    edges = np.unique(np.quantile(values, np.arange(1, bins) / bins, method="inverted_cdf"))
    counts = np.bincount(bin_index(edges, values), minlength=len(edges) + 1)
    return {"edges": edges.tolist(), "proportions": (counts / counts.sum()).tolist()}


def fit_references(values: np.ndarray, names: tuple[str, ...]) -> dict[str, dict[str, list[float]]]:
    """{name: reference} of each column of [N, F] training values."""
    if values.shape[1] != len(names):
        raise ValueError(f"{values.shape[1]} columns of values for {len(names)} feature names")
    return {name: fit_reference(values[:, f]) for f, name in enumerate(names)}


def check_reference(name: str, reference: Any) -> tuple[np.ndarray, np.ndarray]:
    """(edges [B - 1], proportions [B]) of a stored reference, or a ValueError naming what is wrong."""
    try:
        edges = np.asarray(reference["edges"], dtype=np.float64)
        proportions = np.asarray(reference["proportions"], dtype=np.float64)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"drift reference of {name}: expected {{'edges': [...], 'proportions': [...]}}, got {reference!r:.80}"
        ) from error
    if (
        edges.ndim != 1
        or len(proportions) != len(edges) + 1
        or (np.diff(edges) <= 0).any()
        or not np.isclose(proportions.sum(), 1.0)
    ):
        raise ValueError(
            f"drift reference of {name}: {len(edges)} edges (increasing) need {len(edges) + 1} proportions "
            f"summing to 1; got {len(proportions)} summing to {proportions.sum():.4f}"
        )
    return edges, proportions


def psi(reference: np.ndarray, counts: np.ndarray) -> float:
    """PSI of live bin counts [B] against reference proportions [B]; NaN when nothing was counted."""
    total = counts.sum()
    if total == 0:
        return float("nan")
    live = np.maximum(counts / total, PSI_FLOOR)
    expected = np.maximum(reference, PSI_FLOOR)
    return float(((live - expected) * np.log(live / expected)).sum())
