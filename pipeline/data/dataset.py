"""A dataset directory: `transactions.parquet` in event order plus `metadata.json`.

Every command that takes `--data DATASET_DIR` reads it through `scan_dataset` / `read_metadata`.
Ingest may also leave `quarantine.parquet` beside them: the rejected rows, each with its reason.

A dataset is written whole or not at all: its files go into a temporary sibling directory that then takes
the directory's place, so a command that fails leaves the old dataset (or nothing), never new transactions
beside old metadata.
"""

import json
import shutil
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl

from pipeline.data.output_paths import unwritable
from pipeline.data.rules import broken_rules, dataset_rules
from pipeline.data.schema import (
    EVENT_ORDER,
    REQUIRED_COLUMNS,
    SCHEMA_VERSION,
    TRANSACTION_SCHEMA,
    conform,
)

TRANSACTIONS_FILE = "transactions.parquet"
METADATA_FILE = "metadata.json"
QUARANTINE_FILE = "quarantine.parquet"
DATASET_FILES = (TRANSACTIONS_FILE, METADATA_FILE, QUARANTINE_FILE)


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


def write_dataset(
    frame: pl.DataFrame,
    out_dir: str | Path,
    source: dict[str, Any],
    quarantine: pl.DataFrame | None = None,
    rows_checked: bool = False,
) -> DatasetSummary:
    """Write `frame` (canonical columns) sorted in event order, with metadata describing where it came from,
    and `quarantine` (ingest's rejected rows) when given, in place of whatever dataset `out_dir` held.
    `rows_checked`: the caller has just held every row to pipeline/data/rules.py (ingest does, row by row,
    to quarantine what breaks them), so they are not checked again (~0.5 s at 1.8M rows)."""
    out = Path(out_dir).absolute()
    check_output_dir(out)
    frame = conform(frame).sort(EVENT_ORDER)
    if not rows_checked:
        _check_rows(frame, f"the transactions for {out}", "nothing was written")
    summary = summarize(frame)
    metadata = {
        "schema_version": SCHEMA_VERSION,
        "created_at": datetime.now(UTC).isoformat(),
        "columns": frame.columns,
        "summary": summary.as_dict(),
        "source": source,
    }
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = _sibling(out, "writing")
        try:
            frame.write_parquet(staging / TRANSACTIONS_FILE, statistics=True)
            (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2, default=str) + "\n")
            if quarantine is not None:
                quarantine.write_parquet(staging / QUARANTINE_FILE)
            _swap_into_place(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone already when the swap succeeded
    except OSError as error:
        # Named for the dataset asked for, not the staging directory beside it that no one asked for.
        raise OSError(
            error.errno, f"{error.strerror or error}; the dataset was not written", str(out)
        ) from error
    return summary


def _check_rows(frame: pl.DataFrame, where: str, remedy: str) -> None:
    """Refuse a frame whose rows break a rule of pipeline/data/rules.py, naming each rule broken, how many rows
    and the first; `where` names the frame, `remedy` says what to do."""
    broken = broken_rules(frame, dataset_rules(frame.columns))
    if broken:
        said = "; ".join(b.describe() for b in broken)
        raise ValueError(f"{where}: {said} (the rules in pipeline/data/rules.py); {remedy}")


def check_output_dir(out_dir: str | Path) -> None:
    """Refuse an `out_dir` that a dataset cannot take the place of: a file, a path under a file, a place this
    user cannot write, or a directory holding anything but a dataset's files (replacing it would delete
    them)."""
    out = Path(out_dir)
    for path in (out, *out.parents):
        if path.exists() and not path.is_dir():
            where = "is a file" if path == out else f"is under {path}, which is a file"
            raise ValueError(
                f"{out} {where}; expected a dataset directory to write (new, empty or a dataset)"
            )
    if problem := unwritable(out.parent):  # the dataset is written beside `out`, then takes its place
        raise ValueError(f"{out}: {problem}; choose a place this user can write")
    if out.is_dir():
        others = sorted(p.name for p in out.iterdir() if p.name not in DATASET_FILES)
        if others:
            shown = others[:5] + (["..."] if len(others) > 5 else [])
            raise ValueError(
                f"{out} holds {shown}, which are not a dataset's files; writing a dataset there would "
                "replace them. Give a new or empty directory, or one that holds only a dataset"
            )


def _sibling(out: Path, role: str) -> Path:
    # mkdir, not tempfile.mkdtemp: that makes the directory 0700, and the dataset would keep it.
    path = out.parent / f".{out.name}.{role}-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    return path


def _swap_into_place(staging: Path, out: Path) -> None:
    # Two renames within one directory: the old dataset steps aside, the new one takes its name. Should the
    # second fail, the old one comes back, so `out` never holds a half of each.
    if not out.exists() or not any(out.iterdir()):
        staging.replace(out)  # replaces an empty directory too
        return
    old = _sibling(out, "old")
    out.replace(old)
    try:
        staging.replace(out)
    except BaseException:
        old.replace(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _require_dataset(data_dir: str | Path) -> Path:
    path = Path(data_dir)
    if not (path / TRANSACTIONS_FILE).is_file():
        raise FileNotFoundError(
            f"{path} is not a dataset directory: no {TRANSACTIONS_FILE} in it. "
            "Make one with `txsentinel generate --out DIR` or `txsentinel ingest INPUT --mapping M --out DIR`."
        )
    return path


_REMAKE = "the dataset is damaged: make it again with `txsentinel generate` or `txsentinel ingest`"
_EDITED = (
    "the dataset was changed after it was made: re-run `txsentinel ingest` on its source (or "
    "`txsentinel generate`) to make it again, with every row checked"
)


def read_metadata(data_dir: str | Path) -> dict[str, Any]:
    path = _require_dataset(data_dir) / METADATA_FILE
    try:
        metadata = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file; {_REMAKE}") from None
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError both are
        raise ValueError(f"{path}: not valid JSON ({error}); {_REMAKE}") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(metadata).__name__}; {_REMAKE}")
    if metadata.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"{path}: schema_version {metadata.get('schema_version')!r}, "
            f"this txsentinel reads version {SCHEMA_VERSION}; re-run ingest or generate."
        )
    return metadata


def scan_dataset(data_dir: str | Path) -> pl.LazyFrame:
    """Lazily read a dataset's transactions (canonical columns, event order), after checking that its files
    read and its columns have the canonical types."""
    path = _require_dataset(data_dir)
    read_metadata(path)
    transactions = path / TRANSACTIONS_FILE
    try:
        schema = pl.read_parquet_schema(transactions)  # the footer only
    except (pl.exceptions.PolarsError, OSError) as error:
        raise ValueError(f"{transactions}: not a readable Parquet file ({error}); {_REMAKE}") from None
    problems = [_column_problem(name, dtype) for name, dtype in schema.items()]
    problems += [f"column {name} is missing" for name in REQUIRED_COLUMNS if name not in schema]
    problems += [_label_problem(schema)]
    if any(problems):
        said = "; ".join(p for p in problems if p)
        raise ValueError(f"{transactions}: {said}, by the schema in pipeline/data/schema.py; {_REMAKE}")
    return pl.scan_parquet(transactions)


def read_dataset(data_dir: str | Path) -> pl.DataFrame:
    """A dataset's transactions, after checking that its files read, its columns have the canonical types and
    its rows keep the rules ingest holds rows to (pipeline/data/rules.py): a file edited after it was made is
    refused, naming the rule, the rows and the first of them, before anything learns from it."""
    transactions = Path(data_dir) / TRANSACTIONS_FILE
    lazy = scan_dataset(data_dir)
    try:
        frame = lazy.collect()
    except pl.exceptions.ComputeError as error:  # a footer that reads over damaged data
        raise ValueError(
            f"{transactions}: cannot be read ({str(error).splitlines()[0]}); {_REMAKE}"
        ) from None
    _check_rows(frame, str(transactions), _EDITED)
    return frame


def _column_problem(name: str, dtype: pl.DataType) -> str:
    if name not in TRANSACTION_SCHEMA:
        return f"column {name} is not a canonical column"
    return (
        ""
        if dtype == TRANSACTION_SCHEMA[name]
        else f"column {name} is {dtype}, expected {TRANSACTION_SCHEMA[name]}"
    )


def _label_problem(schema: pl.Schema) -> str:
    # Labels come with the time each became known (ingest defaults it), or not at all: training reads both.
    if ("is_fraud" in schema) == ("label_ts" in schema):
        return ""
    there, missing = ("is_fraud", "label_ts") if "is_fraud" in schema else ("label_ts", "is_fraud")
    return f"column {missing} is missing, which {there} comes with"


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
    "check_output_dir",
    "read_dataset",
    "read_metadata",
    "require_labels",
    "scan_dataset",
    "summarize",
    "write_dataset",
]
