"""The file ingest reads: its format, columns and lazy scans, the errors that name it, where a row is, and
which CSV rows hold fewer fields than the header."""

from dataclasses import dataclass
from pathlib import Path

import polars as pl

from pipeline.data.ingest_report import IngestError, IngestReport, Problem
from pipeline.data.mapping import Mapping, SourceError
from pipeline.data.source_text import cut, data_lines, field_counts, listed, not_utf8, unreadable

ROW = "__txs_row"  # 0-based data row, from the scan's row index
ENDS_EMPTY = "__txs_ends_empty"  # whether the row's last field is empty or missing (CSV; see scan_rows)
FIELDS = "__txs_fields"  # how many fields a row shorter than the header holds (see short_rows)


@dataclass(frozen=True)
class IngestInput:
    path: Path
    format: str
    mapping: Mapping
    schema: dict[str, pl.DataType]  # source column -> type, in the file's order (NDJSON keys: String)
    present: dict[str, str]  # canonical -> source, for the columns this file fills

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def written(self) -> dict[str, str]:
        """canonical -> source column, for every column ingest writes: the present ones, and label_ts when it
        is ts + label_delay_days (its messages quote the ts)."""
        if "is_fraud" in self.present and "label_ts" not in self.present:
            return self.present | {"label_ts": self.present["ts"]}
        return self.present

    @property
    def sources(self) -> list[str]:
        return list(dict.fromkeys(self.present.values()))

    @property
    def header(self) -> str:
        """What sets how many fields a CSV row holds, as a message names it."""
        return "the header" if self.mapping.csv.has_header else "the first record"

    @classmethod
    def open(cls, path: Path, mapping: Mapping) -> "IngestInput":
        fmt = mapping.input_format(path)
        src = cls(path, fmt, mapping, {}, {})
        schema = src.read(lambda: mapping.source_columns(path, fmt))
        return cls(path, fmt, mapping, schema, _present_columns(src, schema))

    def scan(self, sources: list[str]) -> pl.LazyFrame:
        return self.mapping.scan(self.path, self.format, sources, ROW)

    def scan_rows(self) -> pl.LazyFrame:
        """ROW, the mapped source columns and ENDS_EMPTY. A CSV row short of fields ends empty: polars fills
        what it lacks with nulls, as it does an empty field, so short_rows tells the two apart."""
        if self.format != "csv":
            return self.scan(self.sources).with_columns(pl.lit(False).alias(ENDS_EMPTY))
        last = list(self.schema)[-1]
        ends_empty = pl.col(last).is_null().alias(ENDS_EMPTY)
        return self.scan(list(dict.fromkeys([*self.sources, last]))).select(ROW, *self.sources, ends_empty)

    def read(self, read):
        """Run `read`, turning errors of the file itself into an IngestError that names it."""
        try:
            return read()
        except (FileNotFoundError, SourceError) as exc:
            raise IngestError(f"{self.path}: {exc}", IngestReport(self.name, self.format)) from exc
        # Ragged lines, bad encoding, broken quotes or JSON; errors in the plan built from the file are bugs.
        except (pl.exceptions.ComputeError, pl.exceptions.NoDataError, OSError, UnicodeError) as exc:
            said = f"cannot be read as {self.format}: {exc}"
            if not isinstance(exc, OSError):  # OSError: the file, not its text (a directory, no permission)
                said = unreadable(self.path, self.mapping, self.format, str(exc))
            raise IngestError(f"{self.path}: {said}", IngestReport(self.name, self.format)) from exc

    def location(self, row0: pl.Expr, line: pl.Expr) -> pl.Expr:
        """'row R (line L)': R counts data rows from 1, L is the line of a CSV file the row starts on."""
        row = pl.format("row {}", row0.cast(pl.Int64) + 1)
        if self.format != "csv":
            return row
        return pl.coalesce(pl.format("{} (line {})", row, line), row)  # line is null where none was found

    def lines(self, rows: pl.Series, rows_read: int) -> pl.Series:
        """[N] the line of a CSV file each of `rows` (ascending) starts on; null where none was found."""
        lines = self.read(lambda: data_lines(self.path, self.mapping.csv, rows.to_list(), rows_read))
        return pl.Series(lines, dtype=pl.Int64)

    def short_rows(self, ends_empty: pl.Series, rows_read: int) -> pl.DataFrame:
        """ROW and FIELDS of the rows among `ends_empty` (ascending) that hold fewer fields than the header."""
        counts = self.read(lambda: field_counts(self.path, self.mapping.csv, ends_empty.to_list(), rows_read))
        found = pl.DataFrame({ROW: ends_empty, FIELDS: pl.Series(counts, dtype=pl.Int64)})
        return found.filter(pl.col(FIELDS) < len(self.schema))


def _present_columns(src: IngestInput, schema: dict[str, pl.DataType]) -> dict[str, str]:
    mapping = src.mapping
    missing = [(c, s) for c, s in mapping.columns.items() if s not in schema]
    if missing:
        examples = tuple(
            f'{src.path} has no column "{s}", which {mapping.path} maps to canonical column {c}'
            for c, s in missing
        )
        columns = ", ".join(f"{s} -> {c}" for c, s in missing)
        report = IngestReport(
            src.name, src.format, problems=(Problem("missing column", columns, len(missing), examples),)
        )
        found = [f"the file's columns are {listed(list(schema))}"]
        if any("\ufffd" in name for name in schema):  # polars reads a header that is not UTF-8 as best it can
            found += filter(None, [not_utf8(src.path, mapping, src.format)])
        raise IngestError("\n".join([*examples, *found]), report)
    present = dict(mapping.columns) | {c: s for c, s in mapping.optional_columns.items() if s in schema}
    report = IngestReport(src.name, src.format)
    if "label_ts" in present and "is_fraud" not in present:
        raise IngestError(
            f"{src.path} has label_ts ({present['label_ts']}) but no is_fraud column for it", report
        )
    for c, s in present.items():
        if schema[s].is_nested():
            nested = cut(str(schema[s]))
            raise IngestError(f'{src.path}: column "{s}" -> {c} holds nested values ({nested})', report)
    return present


__all__ = ["ENDS_EMPTY", "FIELDS", "ROW", "IngestInput"]
