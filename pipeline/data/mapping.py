"""How a source file is read, and how its columns become canonical ones: the mapping YAML and its readers.

A mapping file looks like this (every key but `columns` is optional):

    description: Fraud Detection Handbook simulated transactions
    format: csv                       # csv | parquet | ndjson; default from the file extension
    csv: {separator: ",", quote_char: '"', has_header: true, skip_rows: 0, null_values: [], encoding: utf8}
    columns:                          # canonical column -> source column; must be in the file
      event_id: TRANSACTION_ID
      ts: TX_DATETIME
    optional_columns: {}              # canonical column -> source column; mapped only when the file has it
    timestamps:                       # per timestamp column; ISO-8601 in UTC when not given
      ts: {format: "%Y-%m-%d %H:%M:%S", timezone: Europe/Paris}   # or {epoch: s | ms | us}
    is_fraud_values: {fraud: ["1"], legit: ["0"]}                 # compared trimmed, case-insensitive

Source columns the mapping does not name are ignored.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import polars as pl

from models.checks import is_integer, read_yaml_file
from pipeline.data.schema import REQUIRED_COLUMNS, TIMESTAMP, TRANSACTION_SCHEMA

FORMATS = ("csv", "parquet", "ndjson")
EXTENSIONS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
EXTENSIONS |= {".ndjson": "ndjson", ".jsonl": "ndjson"}
EPOCH_US_PER_UNIT = {"s": 1_000_000, "ms": 1_000, "us": 1}
TIMESTAMP_COLUMNS = tuple(name for name, dtype in TRANSACTION_SCHEMA.items() if dtype == TIMESTAMP)
NDJSON_CHECKED_RECORDS = 1000  # NDJSON records parsed whole to check them; past these, see source_columns
DEFAULT_FRAUD_VALUES = ("1", "true", "t", "yes", "y")
DEFAULT_LEGIT_VALUES = ("0", "false", "f", "no", "n")

# ISO-8601 as it appears in the wild; "T" is turned into " " first, so each layout is listed once.
_ISO_WITH_OFFSET = ("%Y-%m-%d %H:%M:%S%.f%#z", "%Y-%m-%d %H:%M%#z")
_ISO_LOCAL = ("%Y-%m-%d %H:%M:%S%.f", "%Y-%m-%d %H:%M", "%Y-%m-%d")

_TOP_KEYS = ("description", "format", "csv", "columns", "optional_columns", "timestamps", "is_fraud_values")
_TIMESTAMP_KEYS = ("format", "epoch", "timezone")


class MappingError(ValueError):
    """A mapping file that cannot be used; the message names the file and the key."""


class SourceError(ValueError):
    """A source file that cannot be read as its mapping describes; the message names the line."""


@dataclass(frozen=True)
class CsvOptions:
    separator: str = ","
    quote_char: str | None = '"'
    has_header: bool = True
    skip_rows: int = 0  # rows before the header (or before the data when there is no header)
    null_values: tuple[str, ...] = ()  # besides the empty field, which is always null
    encoding: str = "utf8"  # utf8 | utf8-lossy


@dataclass(frozen=True)
class TimestampSpec:
    format: str | None = None  # strftime layout; None (and no epoch) means ISO-8601
    epoch: str | None = None  # s | ms | us
    timezone: str = "UTC"  # how to read date-times that carry no offset

    def expected(self) -> str:
        if self.epoch:
            unit = {"s": "seconds", "ms": "milliseconds", "us": "microseconds"}[self.epoch]
            return f"a number of {unit} since 1970-01-01 UTC"
        if self.format:
            return f'a date-time in format "{self.format}" (read in {self.timezone})'
        return (
            f'an ISO-8601 date-time such as "2024-01-31T13:45:00Z" (read in {self.timezone} without offset)'
        )

    def parse(self, raw: pl.Expr, dtype: pl.DataType) -> pl.Expr:
        """Read `raw` (of source type `dtype`) as a canonical UTC timestamp; null where it cannot be read."""
        if isinstance(dtype, pl.Datetime):
            local = raw.dt.cast_time_unit("us")
            return self._to_utc(local) if dtype.time_zone is None else local.dt.convert_time_zone("UTC")
        if isinstance(dtype, pl.Date):
            return self._to_utc(raw.cast(pl.Datetime("us")))
        if self.epoch:
            number = raw.str.strip_chars() if dtype == pl.String else raw
            micros = (number.cast(pl.Float64, strict=False) * EPOCH_US_PER_UNIT[self.epoch]).round(0)
            # strict=False turns NaN and out-of-range values into null, so they are reported, not raised.
            return micros.cast(pl.Int64, strict=False).cast(pl.Datetime("us")).dt.replace_time_zone("UTC")
        if dtype != pl.String:
            raise MappingError(
                f"holds {dtype} values, not date-times; set `epoch: s|ms|us` if they are epoch numbers"
            )
        text = raw.str.strip_chars()
        if self.format:
            return self._parse_layouts(text, (self.format,))
        return self._parse_layouts(text.str.replace("T", " ", literal=True), _ISO_WITH_OFFSET + _ISO_LOCAL)

    def _parse_layouts(self, text: pl.Expr, layouts: tuple[str, ...]) -> pl.Expr:
        parsed = []
        for layout in layouts:
            expr = text.str.to_datetime(layout, time_unit="us", strict=False)
            # A layout with an offset (%z) yields UTC already; one without is local time in self.timezone.
            parsed.append(expr if _layout_has_offset(layout) else self._to_utc(expr))
        return pl.coalesce(parsed)

    def _to_utc(self, local: pl.Expr) -> pl.Expr:
        # Times skipped by a DST change do not exist: null, so the row is reported rather than shifted.
        in_zone = local.dt.replace_time_zone(self.timezone, ambiguous="earliest", non_existent="null")
        return in_zone.dt.convert_time_zone("UTC")


def _layout_has_offset(layout: str) -> bool:
    # Ask polars rather than grep for %z: it knows every spelling of an offset directive.
    probe = pl.col("t").str.to_datetime(layout, time_unit="us", strict=False)
    dtype = pl.LazyFrame(schema={"t": pl.String}).select(probe).collect_schema()["t"]
    return isinstance(dtype, pl.Datetime) and dtype.time_zone is not None


@dataclass(frozen=True)
class Mapping:
    path: Path
    columns: dict[str, str]  # canonical -> source, required in the file
    optional_columns: dict[str, str] = field(default_factory=dict)  # canonical -> source, when present
    timestamps: dict[str, TimestampSpec] = field(default_factory=dict)
    format: str | None = None
    csv: CsvOptions = CsvOptions()
    fraud_values: tuple[str, ...] = DEFAULT_FRAUD_VALUES
    legit_values: tuple[str, ...] = DEFAULT_LEGIT_VALUES
    description: str = ""

    def timestamp(self, canonical: str) -> TimestampSpec:
        return self.timestamps.get(canonical, TimestampSpec())

    def expected_label(self) -> str:
        fraud = ", ".join(f'"{v}"' for v in self.fraud_values)
        legit = ", ".join(f'"{v}"' for v in self.legit_values)
        return f"one of {fraud} (fraud) or {legit} (legit)"

    def input_format(self, path: Path) -> str:
        fmt = self.format or EXTENSIONS.get(path.suffix.lower())
        if fmt is None:
            raise MappingError(
                f"cannot tell the format of {path} from its extension {path.suffix!r}; "
                f"set `format: csv|parquet|ndjson` in {self.path}"
            )
        return fmt

    def source_columns(self, path: Path, fmt: str) -> dict[str, pl.DataType]:
        """The file's columns and their types (NDJSON: its keys, typed String, every mapped one found)."""
        if not path.is_file():
            raise FileNotFoundError("no such file")
        if fmt != "ndjson":
            return dict(self.scan(path, fmt, None).collect_schema())
        # polars infers NDJSON types and fails on a key whose type changes; every mapped key is read as text,
        # so the keys are all we need. A mapped key may first appear in any record (an optional column often
        # does), so the file is read to the end unless every mapped key has been seen; past the first
        # records, only a line that may hold a key not seen yet is parsed: one with its name in quotes, or
        # one with an escape, which could spell the name another way.
        wanted = [*self.columns.values(), *self.optional_columns.values()]
        unseen = {key: json.dumps(key, ensure_ascii=False) for key in wanted}  # key -> as quoted in JSON
        keys: dict[str, pl.DataType] = {}
        with path.open(encoding="utf-8") as lines:
            records = ((number, line) for number, line in enumerate(lines, 1) if line.strip())
            for count, (number, line) in enumerate(records):
                if count >= NDJSON_CHECKED_RECORDS:
                    if not unseen:
                        break
                    if "\\" not in line and not any(quoted in line for quoted in unseen.values()):
                        continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SourceError(f"line {number} is not JSON: {exc}") from exc
                if not isinstance(record, dict):
                    raise SourceError(
                        f"line {number} is {line.strip()[:40]!r}; expected a JSON object {{...}}"
                    )
                keys |= dict.fromkeys(record, pl.String)
                for key in record:
                    unseen.pop(key, None)
        return keys

    def scan(
        self, path: Path, fmt: str, sources: list[str] | None, row_index: str | None = None
    ) -> pl.LazyFrame:
        """Lazily read `sources` (all columns when None), with a 0-based `row_index` column in front if named."""
        if fmt == "csv":
            o = self.csv
            lf = pl.scan_csv(
                path,
                infer_schema=False,  # every column as text: an unparsable value fails its row, not the read
                separator=o.separator,
                quote_char=o.quote_char,
                has_header=o.has_header,
                skip_rows=o.skip_rows,
                null_values=list(o.null_values) or None,
                encoding=o.encoding,
                row_index_name=row_index,
            )
        elif fmt == "parquet":
            lf = pl.scan_parquet(path, row_index_name=row_index)
        else:
            lf = pl.scan_ndjson(
                path, schema=dict.fromkeys(sources or [], pl.String), row_index_name=row_index
            )
        return lf if sources is None else lf.select(*([row_index] if row_index else []), *sources)

    def parse_label(self, raw: pl.Expr, dtype: pl.DataType) -> pl.Expr:
        """Read `raw` as is_fraud; null where the value is neither a fraud nor a legit value."""
        if dtype == pl.Boolean:
            return raw
        key = raw.cast(pl.String).str.strip_chars().str.to_lowercase()
        fraud = [v.lower() for v in self.fraud_values]
        legit = [v.lower() for v in self.legit_values]
        return pl.when(key.is_in(fraud)).then(True).when(key.is_in(legit)).then(False).otherwise(None)


def load_mapping(path: str | Path) -> Mapping:
    """Read and check a mapping YAML; every mistake raises MappingError naming the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise MappingError(f"mapping file {path} does not exist")
    try:
        doc = read_yaml_file(path, "keys to values")  # names the file when it is not UTF-8 or not YAML
    except ValueError as exc:
        raise MappingError(str(exc)) from None
    where = str(path)
    doc = _table(doc, where, _TOP_KEYS)

    columns = _column_table(doc.get("columns"), f"{where}: columns")
    optional = _column_table(doc.get("optional_columns", {}), f"{where}: optional_columns")
    both = sorted(set(columns) & set(optional))
    if both:
        raise MappingError(f"{where}: {both} appear in both columns and optional_columns; keep one")
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        raise MappingError(
            f"{where}: columns has no source column for required canonical columns {missing}; "
            f"add e.g. `{missing[0]}: SOURCE_COLUMN` under columns"
        )
    if "label_ts" in columns and "is_fraud" not in columns:
        raise MappingError(f"{where}: columns maps label_ts but not is_fraud; a label time needs a label")

    fmt = doc.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise MappingError(f"{where}: format {fmt!r} is not one of {list(FORMATS)}")
    csv = _csv_options(doc["csv"], f"{where}: csv") if "csv" in doc else CsvOptions()
    if "csv" in doc and fmt not in (None, "csv"):
        raise MappingError(f"{where}: csv options given but format is {fmt}")

    timestamps = {}
    for canonical, spec in _table(
        doc.get("timestamps", {}), f"{where}: timestamps", TIMESTAMP_COLUMNS
    ).items():
        if canonical not in columns and canonical not in optional:
            raise MappingError(f"{where}: timestamps.{canonical} is given but {canonical} is not mapped")
        timestamps[canonical] = _timestamp_spec(spec, f"{where}: timestamps.{canonical}")

    labels = _table(doc.get("is_fraud_values", {}), f"{where}: is_fraud_values", ("fraud", "legit"))
    fraud = _values(labels.get("fraud", DEFAULT_FRAUD_VALUES), f"{where}: is_fraud_values.fraud")
    legit = _values(labels.get("legit", DEFAULT_LEGIT_VALUES), f"{where}: is_fraud_values.legit")
    overlap = sorted({v.lower() for v in fraud} & {v.lower() for v in legit})
    if overlap:
        raise MappingError(f"{where}: is_fraud_values lists {overlap} as both fraud and legit")

    return Mapping(
        path=path,
        columns=columns,
        optional_columns=optional,
        timestamps=timestamps,
        format=fmt,
        csv=csv,
        fraud_values=fraud,
        legit_values=legit,
        description=str(doc.get("description", "")),
    )


def _table(value: Any, where: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise MappingError(f"{where}: expected a mapping of keys to values, got {type(value).__name__}")
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise MappingError(f"{where}: unknown keys {unknown}; allowed keys are {list(allowed)}")
    return value


def _column_table(value: Any, where: str) -> dict[str, str]:
    if value is None:
        raise MappingError(f"{where}: missing; map each canonical column to its source column")
    table = _table(value, where, tuple(TRANSACTION_SCHEMA))
    for canonical, source in table.items():
        if not isinstance(source, str) or not source:
            raise MappingError(f"{where}.{canonical}: expected a source column name, got {source!r}")
    return dict(table)


def _csv_options(value: Any, where: str) -> CsvOptions:
    table = dict(_table(value, where, tuple(CsvOptions.__dataclass_fields__)))
    if "null_values" in table:
        nulls = table["null_values"]
        table["null_values"] = _values(
            [nulls] if isinstance(nulls, str) else nulls, f"{where}.null_values", 0
        )
    options = CsvOptions(**table)
    # polars takes one byte for each: "é" is one character but two bytes.
    if not isinstance(options.separator, str) or len(options.separator.encode()) != 1:
        raise MappingError(f"{where}.separator: expected one ASCII character, got {options.separator!r}")
    quote = options.quote_char
    if quote is not None and (not isinstance(quote, str) or len(quote.encode()) != 1):
        raise MappingError(
            f"{where}.quote_char: expected one ASCII character, or null for none, got {quote!r}"
        )
    if not isinstance(options.has_header, bool):
        raise MappingError(f"{where}.has_header: expected true or false, got {options.has_header!r}")
    if not is_integer(options.skip_rows) or options.skip_rows < 0:
        raise MappingError(f"{where}.skip_rows: expected a whole number >= 0, got {options.skip_rows!r}")
    if options.encoding not in ("utf8", "utf8-lossy"):
        raise MappingError(f"{where}.encoding: expected utf8 or utf8-lossy, got {options.encoding!r}")
    return options


def _timestamp_spec(value: Any, where: str) -> TimestampSpec:
    spec = TimestampSpec(**_table(value, where, _TIMESTAMP_KEYS))
    if spec.format is not None and spec.epoch is not None:
        raise MappingError(f"{where}: give either format or epoch, not both")
    if spec.epoch is not None and (not isinstance(spec.epoch, str) or spec.epoch not in EPOCH_US_PER_UNIT):
        raise MappingError(f"{where}.epoch: {spec.epoch!r} is not one of {list(EPOCH_US_PER_UNIT)}")
    if spec.format is not None and (not isinstance(spec.format, str) or "%" not in spec.format):
        raise MappingError(
            f'{where}.format: {spec.format!r} is not a strftime layout like "%Y-%m-%d %H:%M:%S"'
        )
    if spec.format is not None:
        try:  # a layout polars refuses (e.g. "%H" without "%M") would otherwise fail while reading the data
            pl.Series([""]).str.to_datetime(spec.format, time_unit="us", strict=False)
        except pl.exceptions.PolarsError as exc:
            said = str(exc).splitlines()[0]
            raise MappingError(
                f"{where}.format: {spec.format!r} is not a layout polars can read: {said}"
            ) from None
    try:
        ZoneInfo(spec.timezone)
    except (ZoneInfoNotFoundError, ValueError, TypeError) as exc:
        raise MappingError(f"{where}.timezone: unknown time zone {spec.timezone!r}") from exc
    return spec


def _values(value: Any, where: str, least: int = 1) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or len(value) < least:
        raise MappingError(
            f"{where}: expected a {'non-empty ' if least else ''}list of values, got {value!r}"
        )
    out = []
    for v in value:
        # YAML reads unquoted yes/no/true/false as booleans; which spelling the file uses is then lost.
        if isinstance(v, bool):
            raise MappingError(f'{where}: {v!r} is a YAML boolean; quote it, e.g. "true" or "yes"')
        if not isinstance(v, str | int | float):
            raise MappingError(f"{where}: {v!r} is not a plain value; expected text or a number")
        out.append(str(v))
    return tuple(out)


__all__ = ["FORMATS", "CsvOptions", "Mapping", "MappingError", "SourceError", "TimestampSpec", "load_mapping"]
