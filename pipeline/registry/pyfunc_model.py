"""The MLflow model: raw transactions in, per-event scores out, loadable wherever MLflow and the pinned
packages are installed.

`mlflow.pyfunc.load_model(uri).predict(df)` takes a DataFrame of canonical transactions (pipeline/data/
schema.py: event_id, account_id, ts, amount, terminal_id; optional category, channel, country, and the labels
is_fraud with label_ts), any order, any accounts, and returns one row per input row, in input order:
event_id, score (probability), logit and alert (score >= the model's threshold). It computes the batch
features over the whole frame and runs the detector's parallel forward over each account's history in
(ts, event_id) order, in chunks with the state carried across them; so an event's score depends on the
events of its account before it in the frame, and on the fraud labels known at its ts (terminal risk),
exactly as the backtest's replay scores it (equal to float tolerance: tests/pipeline/registry).

The logged model is the artifact directory (artifact.py, the `model_dir` artifact the service's load_model
reads too) plus the txsentinel code that wrote it, as code_paths rather than a pip requirement on a built
wheel: the model then carries the very feature definitions and detector classes its weights and feature spec
were made with, training needs no build step and nothing has to host a wheel; the packages that code imports
are pinned pip requirements. The python_model is a file MLflow runs on load (pyfunc_entry.py, "models from
code"), so nothing is pickled; the signature and input example are declared, so nothing is inferred by
importing the model in a subprocess.
"""

from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import polars as pl
import torch
from mlflow.models import ModelSignature
from mlflow.types.schema import ColSpec, Schema

import models
import pipeline
from models.contract import RecurrentDetector
from pipeline.data.rules import Rule, broken_rules, value_rules
from pipeline.data.schema import LABEL_COLUMNS, OPTIONAL_COLUMNS, REQUIRED_COLUMNS, conform
from pipeline.features import TERMINAL_BUCKET_COLUMN, compute_features
from pipeline.registry.artifact import DEFAULT_THRESHOLD, MODEL_DIR_ARTIFACT, LoadedModel, load_model_dir
from pipeline.registry.tracking import pinned_requirements

# What the code in the model imports, pinned to this environment's versions when the model is logged.
REQUIREMENTS = ("torch", "mlflow", "numpy", "pandas", "polars", "pyarrow", "numba", "pyyaml")
INPUT_COLUMNS = REQUIRED_COLUMNS + OPTIONAL_COLUMNS + LABEL_COLUMNS
GROUP_ACCOUNTS = 256  # accounts per forward call
CHUNK_EVENTS = 512  # events per account per forward call; the state carries across chunks

_DTYPES = {"ts": "datetime", "label_ts": "datetime", "amount": "double", "is_fraud": "boolean"}
SIGNATURE = ModelSignature(
    inputs=Schema(
        [
            ColSpec(_DTYPES.get(name, "string"), name, required=name in REQUIRED_COLUMNS)
            for name in INPUT_COLUMNS
        ]
    ),
    outputs=Schema(
        [
            ColSpec("string", "event_id"),
            ColSpec("double", "score"),
            ColSpec("double", "logit"),
            ColSpec("boolean", "alert"),
        ]
    ),
)


def input_example() -> pd.DataFrame:
    """Made-up transactions of two accounts: what the model's page shows, never a real customer's rows."""
    # MLflow's datetime type has no zone: UTC times without one, as the signature asks.
    ts = pd.to_datetime(["2024-03-01 09:15", "2024-03-01 12:40", "2024-03-02 08:05", "2024-03-02 23:50"])
    return pd.DataFrame(
        {
            "event_id": ["e-1", "e-2", "e-3", "e-4"],
            "account_id": ["acct-A", "acct-B", "acct-A", "acct-A"],
            "ts": ts,
            "amount": [42.5, 18.0, 39.9, 480.0],
            "terminal_id": ["term-7", "term-3", "term-7", "term-9"],
        }
    )


class TransactionScorer(mlflow.pyfunc.PythonModel):
    """pyfunc face of the artifact: raw transactions -> per-event scores (module docstring)."""

    def load_context(self, context):
        self.model = load_model_dir(Path(context.artifacts[MODEL_DIR_ARTIFACT]))

    def predict(
        self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        return score_transactions(self.model, pl.from_pandas(model_input)).to_pandas()


def score_transactions(
    model: LoadedModel,
    transactions: pl.DataFrame,
    group_accounts: int = GROUP_ACCOUNTS,
    chunk_events: int = CHUNK_EVENTS,
) -> pl.DataFrame:
    """event_id, score, logit and alert for each row of `transactions` (canonical columns; others ignored),
    in its row order (module docstring; account_logits for the two sizes)."""
    frame = _canonical(transactions)
    if frame.height == 0:
        return pl.DataFrame(
            schema={"event_id": pl.String, "score": pl.Float64, "logit": pl.Float64, "alert": pl.Boolean}
        )
    features = compute_features(frame).sort("account_id", "ts", "event_id")  # accounts end to end
    x = np.concatenate(
        [
            model.spec.matrix(features),
            features[TERMINAL_BUCKET_COLUMN].to_numpy()[:, None].astype(np.float32),
        ],
        axis=1,
    )  # [N, F + 1]
    lengths = features.group_by("account_id", maintain_order=True).len()["len"].to_numpy()
    logit = account_logits(model.detector, x, lengths, group_accounts, chunk_events)
    score = torch.sigmoid(torch.from_numpy(logit)).numpy()  # float64: no overflow for any logit
    threshold = float(model.meta.get("threshold", DEFAULT_THRESHOLD))
    scored = pl.DataFrame(
        {"event_id": features["event_id"], "score": score, "logit": logit, "alert": score >= threshold}
    )
    return frame.select("event_id").join(scored, on="event_id", how="left", maintain_order="left")


@torch.inference_mode()
def account_logits(
    detector: RecurrentDetector,
    x: np.ndarray,
    lengths: np.ndarray,
    group_accounts: int = GROUP_ACCOUNTS,
    chunk_events: int = CHUNK_EVENTS,
) -> np.ndarray:
    """[N] float64 logits of accounts laid end to end in x [N, F + 1] (account a has lengths[a] rows, in
    order): groups of similar-length accounts, each through the parallel forward chunk by chunk."""
    detector.eval()
    dtype = next(detector.parameters()).dtype
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])  # [A + 1]
    order = np.argsort(-lengths, kind="stable")  # longest first: little padding within a group
    out = np.empty(len(x), dtype=np.float64)
    for g in range(0, len(order), group_accounts):
        accounts = order[g : g + group_accounts]
        state = None
        for start in range(0, int(lengths[accounts[0]]), chunk_events):
            n = np.clip(lengths[accounts] - start, 0, chunk_events)  # [B] events of this chunk
            rows = offsets[accounts, None] + start + np.arange(chunk_events)[None, :]  # [B, T]
            valid = np.arange(chunk_events)[None, :] < n[:, None]  # [B, T]
            chunk = torch.from_numpy(np.where(valid[..., None], x[np.where(valid, rows, 0)], 0.0))
            logits, state = detector(chunk.to(dtype), state, torch.from_numpy(n))  # [B, T]
            out[rows[valid]] = logits.double().numpy()[valid]
    return out


def _canonical(transactions: pl.DataFrame) -> pl.DataFrame:
    """The canonical input columns, cast to their types, or an error naming the first bad row and value."""
    missing = [c for c in REQUIRED_COLUMNS if c not in transactions.columns]
    if missing:
        raise ValueError(
            f"transactions lack column(s) {missing}; expected {list(REQUIRED_COLUMNS)}, optionally "
            f"{list(OPTIONAL_COLUMNS + LABEL_COLUMNS)}"
        )
    # Timestamps without a zone are taken as UTC, the canonical zone.
    frame = conform(transactions.select(c for c in INPUT_COLUMNS if c in transactions.columns))
    # The rules ingest and every dataset read hold rows to (the service's decoder holds them too, within
    # bounds of its own that may be tighter): an empty account id, say, would merge histories.
    repeated = pl.col("event_id").is_duplicated()
    rules = [
        *value_rules(frame.columns),
        Rule("event_id", "repeated", "repeated", repeated, "unique event ids"),
    ]
    broken = broken_rules(frame, rules)
    if broken:
        first = min(broken, key=lambda b: b.first_row)
        rule, row = first.rule, first.first_row
        others = f"; and {len(broken) - 1} other rule(s) broken" if len(broken) > 1 else ""
        raise ValueError(
            f"transactions row {row} (event_id {first.first_event_id!r}): {rule.column} = "
            f"{frame[rule.column][row]!r}: {rule.title}; expected {rule.expected} ({first.rows} row(s) like "
            f"it){others}"
        )
    return frame


def log_and_register(model_dir: Path, registered_name: str) -> tuple[str, int]:
    """Log the artifact directory as this run's MLflow model and register it; returns (model URI, version)."""
    info = mlflow.pyfunc.log_model(
        name="model",
        python_model=str(Path(__file__).with_name("pyfunc_entry.py")),
        artifacts={MODEL_DIR_ARTIFACT: str(model_dir)},
        code_paths=[str(Path(package.__file__).parent) for package in (models, pipeline)],
        signature=SIGNATURE,
        input_example=input_example(),
        registered_model_name=registered_name,
        pip_requirements=pinned_requirements(*REQUIREMENTS),
    )
    version = info.registered_model_version
    return info.model_uri, int(version) if version is not None else -1
