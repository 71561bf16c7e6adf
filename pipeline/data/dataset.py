"""A dataset directory: `transactions.parquet` in event order plus `metadata.json`.

Every command that takes `--data DATASET_DIR` reads it through `scan_dataset` / `read_metadata`.
Ingest may also leave `quarantine.parquet` beside them: the rejected rows, each with its reason.
"""

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl

from pipeline.data.schema import EVENT_ORDER, SCHEMA_VERSION, TRANSACTION_SCHEMA, conform

TRANSACTIONS_FILE = "transactions.parquet"
METADATA_FILE = "metadata.json"
QUARANTINE_FILE = "quarantine.parquet"


@dataclass(frozen=True)
class DatasetSummary:
    transactions: int
    accounts: int
    terminals: int
    first_ts: datetime | None
    last_ts: datetime | None
    frauds: int | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "transactions": self.transactions,
            "accounts": self.accounts,
            "terminals": self.terminals,
            "first_ts": self.first_ts.isoformat() if self.first_ts else None,
            "last_ts": self.last_ts.isoformat() if self.last_ts else None,
            "frauds": self.frauds,
        }


def summarize(frame: pl.DataFrame) -> DatasetSummary:
    has_labels = "is_fraud" in frame.columns
    return DatasetSummary(
        transactions=frame.height,
        accounts=frame["account_id"].n_unique(),
        terminals=frame["terminal_id"].n_unique(),
        first_ts=frame["ts"].min(),
        last_ts=frame["ts"].max(),
        frauds=int(frame["is_fraud"].sum()) if has_labels else None,
    )


def write_dataset(frame: pl.DataFrame, out_dir: str | Path, source: dict[str, Any]) -> DatasetSummary:
    """Write `frame` (canonical columns) sorted in event order, with metadata describing where it came from."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frame = conform(frame).sort(EVENT_ORDER)
    frame.write_parquet(out / TRANSACTIONS_FILE, statistics=True)
    summary = summarize(frame)
    metadata = {
        "schema_version": SCHEMA_VERSION,
        "created_at": datetime.now(UTC).isoformat(),
        "columns": frame.columns,
        "summary": summary.as_dict(),
        "source": source,
    }
    (out / METADATA_FILE).write_text(json.dumps(metadata, indent=2, default=str) + "\n")
    return summary


def _require_dataset(data_dir: str | Path) -> Path:
    path = Path(data_dir)
    if not (path / TRANSACTIONS_FILE).is_file():
        raise FileNotFoundError(
            f"{path} is not a dataset directory: no {TRANSACTIONS_FILE} in it. "
            "Make one with `txsentinel generate --out DIR` or `txsentinel ingest INPUT --mapping M --out DIR`."
        )
    return path


def read_metadata(data_dir: str | Path) -> dict[str, Any]:
    path = _require_dataset(data_dir)
    metadata = json.loads((path / METADATA_FILE).read_text())
    if metadata.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"{path / METADATA_FILE}: schema_version {metadata.get('schema_version')!r}, "
            f"this txsentinel reads version {SCHEMA_VERSION}; re-run ingest or generate."
        )
    return metadata


def scan_dataset(data_dir: str | Path) -> pl.LazyFrame:
    """Lazily read a dataset's transactions (canonical columns, event order)."""
    path = _require_dataset(data_dir)
    read_metadata(path)
    return pl.scan_parquet(path / TRANSACTIONS_FILE)


def read_dataset(data_dir: str | Path) -> pl.DataFrame:
    return scan_dataset(data_dir).collect()


def require_labels(data_dir: str | Path, needed_for: str) -> None:
    """Refuses a dataset without fraud labels (ingested with no is_fraud column) for what needs them, before
    any work: reads the schema only."""
    if "is_fraud" not in scan_dataset(data_dir).collect_schema().names():
        raise ValueError(
            f"dataset {data_dir} has no labels (no is_fraud column): {needed_for}. Ingest the data with its "
            "fraud labels (is_fraud in the mapping), or generate a labelled dataset"
        )


__all__ = [
    "METADATA_FILE",
    "QUARANTINE_FILE",
    "TRANSACTIONS_FILE",
    "TRANSACTION_SCHEMA",
    "DatasetSummary",
    "read_dataset",
    "read_metadata",
    "require_labels",
    "scan_dataset",
    "summarize",
    "write_dataset",
]
