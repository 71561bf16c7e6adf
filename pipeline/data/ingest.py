"""Ingest: a CSV, Parquet or NDJSON file, through a mapping (pipeline/data/mapping.py), into a dataset directory.

Two lazy, streamed passes over the input:
1. parse every mapped column and evaluate every check; collect only the canonical columns and one boolean
   per check (CSV is read as text, so a bad value fails its row, not the whole read). A CSV row whose last
   field is empty is then counted in the file's text, as polars cannot tell it from a row short of fields;
2. only when some rows failed: read those rows again as the source's own text, to quote them in the messages
   and to write them to quarantine.parquet.
A clean file is therefore read once (and its rows that end empty once more, as text), and the source text of
good rows is never held in memory.
Source columns the mapping does not name are ignored.
"""

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import polars as pl

from pipeline.data.dataset import QUARANTINE_FILE, write_dataset
from pipeline.data.ids import id_problem
from pipeline.data.ingest_input import ENDS_EMPTY, FIELDS, ROW, IngestInput
from pipeline.data.ingest_report import IngestError, IngestReport, Problem
from pipeline.data.mapping import MappingError, load_mapping
from pipeline.data.rules import ID_EXPECTED, TIMESTAMP_COLUMNS, Rule, value_rules
from pipeline.data.schema import MAX_AMOUNT, MAX_LABEL_DELAY_DAYS, TRANSACTION_SCHEMA, TS_RANGE
from pipeline.data.source_text import cut_column

ON_INVALID = ("fail", "quarantine")
EXAMPLES_PER_PROBLEM = 3
DUP_OF = "__txs_dup_of"  # ROW of the row whose event_id this one repeats (see _flag_duplicates)
DUP_OF_VALID = "__txs_dup_of_valid"  # whether that row is otherwise valid, so the one kept
LINE = "__txs_line"  # the line of a CSV file the row starts on (pass 2 only, see _with_lines)
DUP_LINE = "__txs_dup_line"  # the line of row DUP_OF
SHORT = "__bad_row_short"  # the flag of a CSV row with fewer fields than the header
DUPLICATE = "__bad_event_id_duplicate"  # the flag of a row that repeats an event_id (see _flag_duplicates)


@dataclass(frozen=True)
class IngestConfig:
    input: Path
    mapping: Path
    out: Path
    on_invalid: str = "fail"  # fail: write nothing if any row is bad | quarantine: set bad rows aside
    label_delay_days: float = 7.0  # label_ts = ts + this when the input has is_fraud but no label_ts

    def __post_init__(self) -> None:
        if self.on_invalid not in ON_INVALID:
            raise ValueError(f"on_invalid must be one of {list(ON_INVALID)}, got {self.on_invalid!r}")
        if not 0 <= self.label_delay_days <= MAX_LABEL_DELAY_DAYS:
            raise ValueError(
                f"label_delay_days (--label-delay-days) must be a number of days in 0..{MAX_LABEL_DELAY_DAYS}, "
                f"got {self.label_delay_days!r}"
            )


@dataclass(frozen=True)
class _Check:
    flag: str  # boolean column: True where the row fails
    title: str
    column: str  # e.g. "TX_AMOUNT -> amount"
    failed: pl.Expr | None  # over raw and parsed columns in pass 1; None: computed on the collected frame
    message: pl.Expr  # over the raw text in pass 2: where, what is wrong and what was expected


def ingest(cfg: IngestConfig) -> IngestReport:
    """Read cfg.input through cfg.mapping and write a dataset to cfg.out; raise IngestError on bad input."""
    src = IngestInput.open(Path(cfg.input), load_mapping(cfg.mapping))
    checks = _checks(src, cfg.label_delay_days)
    frame = src.read(lambda: _parse(src, checks, cfg.label_delay_days))  # pass 1
    frame = _flag_rows(src, frame, checks)
    flags = [c.flag for c in checks]
    bad = pl.any_horizontal(flags)
    counts = frame.select(*(pl.col(f).sum() for f in flags), bad.sum().alias("__any")).row(0, named=True)
    invalid = counts["__any"]

    if invalid and cfg.on_invalid == "fail":
        # Only the example rows are read back: nothing is written, so the others need no text.
        rows = pl.concat([frame.filter(pl.col(f)).head(EXAMPLES_PER_PROBLEM)[ROW] for f in flags])
        explained = _explain(src, checks, frame.filter(pl.col(ROW).is_in(rows.implode())), frame.height)
        report = IngestReport(
            src.name,
            src.format,
            frame.height,
            rows_invalid=invalid,
            problems=_problems(src, checks, explained, counts),
        )
        raise IngestError(
            f"{src.name}: {invalid} of {frame.height} rows are invalid, so nothing was written. Fix them, or "
            "run with --on-invalid quarantine to write the valid rows and set the others aside in "
            f"{Path(cfg.out) / QUARANTINE_FILE}.\n" + "\n".join(report.problem_lines()),
            report,
        )

    good = frame.filter(~bad).select(c for c in frame.columns if c in TRANSACTION_SCHEMA)
    quarantined, problems = None, ()
    if cfg.on_invalid == "quarantine":
        explained = _explain(src, checks, frame.filter(bad), frame.height)
        problems = _problems(src, checks, explained, counts)
        quarantined = _quarantine_frame(src, explained)
    report = IngestReport(
        src.name, src.format, frame.height, good.height, invalid, invalid, problems, out=str(cfg.out)
    )  # reaching here with invalid rows means on_invalid="quarantine": every one of them was set aside
    # Quarantine mode writes the quarantine file even when empty, so that it always describes this dataset.
    write_dataset(
        good, cfg.out, _metadata_source(src, cfg, report), quarantine=quarantined, rows_checked=True
    )
    return report


def _raw(canonical: str) -> str:
    return f"__raw_{canonical}"


def _parse(src: IngestInput, checks: list[_Check], label_delay_days: float) -> pl.DataFrame:
    """Pass 1: (N rows) ROW, the canonical columns, and one flag per check evaluated row by row."""
    parsed = []
    for c, s in src.present.items():
        raw, dtype = pl.col(_raw(c)), src.schema[s]
        if c in ("ts", "label_ts"):
            try:
                parsed.append(src.mapping.timestamp(c).parse(raw, dtype).alias(c))
            except MappingError as exc:
                message = f'{src.path}: column "{s}" -> {c} {exc} ({src.mapping.path})'
                raise IngestError(message, IngestReport(src.name, src.format)) from exc
        elif c == "is_fraud":
            parsed.append(src.mapping.parse_label(raw, dtype).alias(c))
        elif c == "amount":
            if dtype == pl.Boolean:  # true / false: no amount (cast, they would read 1.0 and 0.0), as in JSON
                parsed.append(pl.lit(None, dtype=pl.Float64).alias(c))
                continue
            text = raw.str.strip_chars() if dtype == pl.String else raw
            parsed.append(text.cast(pl.Float64, strict=False).alias(c))
        else:
            parsed.append(raw.cast(pl.String).alias(c))
    defaulted = []
    if "is_fraud" in src.present and "label_ts" not in src.present:
        defaulted.append((pl.col("ts") + timedelta(days=label_delay_days)).alias("label_ts"))
    canonical = [c for c in TRANSACTION_SCHEMA if c in src.present or (c == "label_ts" and defaulted)]
    row_checks = [c for c in checks if c.failed is not None]
    return (
        src.scan_rows()
        .select(ROW, ENDS_EMPTY, *(pl.col(s).alias(_raw(c)) for c, s in src.present.items()))
        .with_columns(parsed)
        .with_columns(defaulted)
        .with_columns(c.failed.fill_null(False).alias(c.flag) for c in row_checks)
        .select(ROW, ENDS_EMPTY, *canonical, *(c.flag for c in row_checks))
        .collect(engine="streaming")
    )


def _flag_rows(src: IngestInput, frame: pl.DataFrame, checks: list[_Check]) -> pl.DataFrame:
    """`frame` with the flags pass 1 cannot set: short rows, then duplicates. A short row is flagged short
    only: its other problems would be those of the fields it lacks. One query: eager steps would each copy
    the frame's columns (about 100 MB at 1.8M rows)."""
    short = src.short_rows(frame[ROW].filter(frame[ENDS_EMPTY]), frame.height)  # one column, not all
    flagged = frame.lazy().drop(ENDS_EMPTY)
    if short.is_empty():  # a clean file: no join over every row
        flagged = flagged.with_columns(pl.lit(None, pl.Int64).alias(FIELDS), pl.lit(False).alias(SHORT))
    else:
        flagged = flagged.join(short.lazy(), on=ROW, how="left", maintain_order="left")
        flagged = flagged.with_columns(pl.col(FIELDS).is_not_null().alias(SHORT))
    flagged = _flag_duplicates(flagged, checks)
    return flagged.with_columns(pl.col(c.flag) & ~pl.col(SHORT) for c in checks if c.flag != SHORT).collect()


def _flag_duplicates(frame: pl.LazyFrame, checks: list[_Check]) -> pl.LazyFrame:
    """Flag every row that repeats an event_id, but one: the first row with that id that has no other
    problem, so that one is written (in quarantine mode), or, when every row with the id has a problem, the
    first. DUP_OF is that row. Judged before the others, a duplicate of a bad row would be set aside with it
    and the id lost altogether."""
    valid = ~pl.any_horizontal(c.flag for c in checks if c.flag != DUPLICATE)
    first_valid = pl.when(valid).then(pl.col(ROW)).min().over("event_id")
    keeper = pl.coalesce(first_valid, pl.col(ROW).min().over("event_id"))
    return frame.with_columns(
        pl.when(~pl.col("__bad_event_id_empty") & (pl.col(ROW) != keeper)).then(keeper).alias(DUP_OF),
        first_valid.is_not_null().alias(DUP_OF_VALID),
    ).with_columns(pl.col(DUP_OF).is_not_null().alias(DUPLICATE))


def _checks(src: IngestInput, label_delay_days: float) -> list[_Check]:
    """The rules of pipeline/data/rules.py over the columns ingest writes, each with the words that explain a
    failing row from its source text; then the duplicate check, which ingest makes its own way (it keeps one
    row of each id)."""
    checks = []
    for rule in value_rules(src.written):
        if rule.column not in src.present and rule.key != "out_of_range":
            continue  # label_ts = ts + label_delay_days: null only where ts is, never before it
        title = _UNREAD.get(rule.column, rule.title) if rule.key == "missing" else rule.title
        problem = _problem(src, rule, label_delay_days)
        checks.append(
            _value_check(rule.flag, title, rule.column, src.written[rule.column], rule.failed, problem)
        )
    # Needs every row's event_id at once, so it is evaluated on the collected frame (failed=None).
    kept = pl.when(pl.col(DUP_OF_VALID)).then(pl.lit(", the first row with it and no other problem"))
    problem = pl.format(
        "has the event_id of {}{}; expected unique event ids",
        src.location(pl.col(DUP_OF), pl.col(DUP_LINE)),
        kept.otherwise(pl.lit("")),
    )
    duplicate = _value_check(
        DUPLICATE, "duplicate event_id", "event_id", src.present["event_id"], None, problem
    )
    checks += [duplicate, _short_row_check(src)]
    return checks


def _value_check(
    flag: str, title: str, canonical: str, source: str, failed: pl.Expr | None, problem: pl.Expr
) -> _Check:
    """A check of a column's value, whose message quotes the value as the source wrote it."""
    shown = cut_column(pl.col(_raw(canonical)).fill_null(""))
    message = pl.format('column {} -> {}: value "{}" {}', pl.lit(source), pl.lit(canonical), shown, problem)
    return _Check(flag, title, f"{source} -> {canonical}", failed, message)


def _short_row_check(src: IngestInput) -> _Check:
    """A CSV row with fewer fields than the header, which polars reads as nulls in the fields it lacks;
    _flag_rows sets it (never for Parquet or NDJSON, whose records name their fields)."""
    width, header = len(src.schema), src.header
    blank = pl.lit(f"is blank and {header} has {width} fields; expected {width} (delete the line)")
    short = pl.format(
        f"has {{}} fields and {header} has {width}; expected {width} (is the line cut short, or a field with "
        "a line break not quoted?)",
        pl.col(FIELDS),
    )
    message = pl.when(pl.col(FIELDS) == 0).then(blank).otherwise(short)
    return _Check(SHORT, "short row", f"{header} has {width} fields", None, message)


# A value the rules call missing (null) was, in a source file, empty or not readable as its column's kind.
_UNREAD = {
    "ts": "unparsable timestamp",
    "label_ts": "unparsable timestamp",
    "amount": "amount not a number",
    "is_fraud": "invalid fraud label",
}


_AMOUNT_PROBLEMS = {"negative": "negative", "not_finite": "not finite", "too_large": f"above {MAX_AMOUNT:g}"}


def _problem(src: IngestInput, rule: Rule, label_delay_days: float) -> pl.Expr:
    """Pass 2's words for a row that breaks `rule`: what is wrong with its source text, what was expected."""
    c, key = rule.column, rule.key
    if key == "empty":
        return pl.lit(f"is empty; expected {rule.expected}")
    if key == "unfit":
        return pl.col(_raw(c)).cast(pl.String).map_batches(_id_problems, return_dtype=pl.String)
    if c not in src.present:  # label_ts = ts + label_delay_days, and the ts quoted
        return pl.lit(
            f"+ label_delay_days = {label_delay_days:g} (--label-delay-days) is outside {TS_RANGE}; expected a "
            "ts whose label time is in those years"
        )
    if key == "before_ts":
        return pl.format(
            'is before ts "{}" (column {}); expected label_ts >= ts',
            cut_column(pl.col(_raw("ts")).cast(pl.String)),
            pl.lit(src.present["ts"]),
        )
    if c in TIMESTAMP_COLUMNS:
        expected = src.mapping.timestamp(c).expected()
        if key == "out_of_range":
            return pl.lit(f"is outside {TS_RANGE} read as {expected}; expected a time in those years")
        return _empty_or(c, expected, f"is not a timestamp; expected {expected}")
    if c == "is_fraud":
        expected = src.mapping.expected_label()
        return _empty_or(c, expected, f"is not a fraud label; expected {expected}")
    if key == "missing":  # the amount
        return _empty_or(c, "a number", f"is not a number; expected {rule.expected}")
    return pl.lit(f"is {_AMOUNT_PROBLEMS[key]}; expected {rule.expected}")


def _empty_or(canonical: str, expected: str, otherwise: str) -> pl.Expr:
    raw = pl.col(_raw(canonical))
    empty = raw.is_null() | (raw.cast(pl.String).str.strip_chars() == "")
    return pl.when(empty).then(pl.lit(f"is empty; expected {expected}")).otherwise(pl.lit(otherwise))


def _id_problems(ids: pl.Series) -> pl.Series:
    """[N] what is wrong with each id, with what was expected (null: nothing)."""
    values = ids.to_list()
    problems = [
        None if v is None or not (p := id_problem(v)) else f"{p}; expected {ID_EXPECTED}" for v in values
    ]
    return pl.Series(problems, dtype=pl.String)


def _explain(src: IngestInput, checks: list[_Check], bad: pl.DataFrame, rows_read: int) -> pl.DataFrame:
    """Pass 2: the `bad` rows with their source text and lines, a message column per check, `__reason`
    joining them."""
    if bad.is_empty():  # no need to read the file again
        raw = pl.DataFrame(schema={ROW: bad.schema[ROW]} | dict.fromkeys(src.sources, pl.String))
    else:
        raw = src.read(
            lambda: (
                src.scan(src.sources)
                .filter(pl.col(ROW).is_in(bad[ROW].implode()))
                .select(ROW, *(pl.col(s).cast(pl.String) for s in src.sources))
                .collect(engine="streaming")
            )
        )
    flags = bad.select(ROW, FIELDS, DUP_OF, DUP_OF_VALID, *(c.flag for c in checks))
    explained = raw.join(flags, on=ROW).sort(ROW)
    explained = _with_lines(src, explained, rows_read)
    explained = explained.with_columns(pl.col(s).alias(_raw(c)) for c, s in src.written.items())
    messages = [pl.when(pl.col(c.flag)).then(c.message).alias(f"__msg{c.flag}") for c in checks]
    reason = pl.concat_str([f"__msg{c.flag}" for c in checks], separator=" | ", ignore_nulls=True)
    return explained.with_columns(messages).with_columns(reason.alias("__reason"))


def _with_lines(src: IngestInput, explained: pl.DataFrame, rows_read: int) -> pl.DataFrame:
    """`explained` with LINE and DUP_LINE (CSV): the lines its rows, and the rows they repeat, start on."""
    if src.format != "csv":
        return explained
    rows = pl.concat([explained[ROW], explained[DUP_OF].drop_nulls()]).unique().sort()
    found = pl.DataFrame({ROW: rows, LINE: src.lines(rows, rows_read)})
    dup_found = found.rename({ROW: DUP_OF, LINE: DUP_LINE})
    return explained.join(found, on=ROW, how="left", maintain_order="left").join(
        dup_found, on=DUP_OF, how="left", maintain_order="left"
    )


def _problems(
    src: IngestInput, checks: list[_Check], explained: pl.DataFrame, counts: dict
) -> tuple[Problem, ...]:
    located = explained.with_columns(src.location(pl.col(ROW), pl.col(LINE)).alias("__where"))
    problems = []
    for c in checks:
        if counts[c.flag]:
            first = located.filter(pl.col(c.flag)).head(EXAMPLES_PER_PROBLEM)
            where, message = first["__where"], first[f"__msg{c.flag}"]
            examples = tuple(f"{src.path} {w}, {m}" for w, m in zip(where, message, strict=True))
            problems.append(Problem(c.title, c.column, counts[c.flag], examples))
    return tuple(problems)


def _quarantine_frame(src: IngestInput, explained: pl.DataFrame) -> pl.DataFrame:
    """row, line (CSV), the mapped source columns as text, and the reason naming every problem of the row."""
    columns = [(pl.col(ROW).cast(pl.Int64) + 1).alias("row")]
    if src.format == "csv":
        columns.append(pl.col(LINE).alias("line"))
    for s in src.sources:
        # Keep our own column names unambiguous if the source happens to use them.
        columns.append(pl.col(s).alias(f"source_{s}" if s in ("row", "line", "reason") else s))
    return explained.select(*columns, pl.col("__reason").alias("reason"))


def _metadata_source(src: IngestInput, cfg: IngestConfig, report: IngestReport) -> dict:
    if "label_ts" in src.present:
        label_ts = f"input column {src.present['label_ts']}"
    else:
        label_ts = f"ts + {cfg.label_delay_days} days" if "is_fraud" in src.present else None
    return {
        "kind": "ingest",
        "input": str(src.path.resolve()),
        "format": src.format,
        "mapping": str(Path(cfg.mapping).resolve()),
        "columns": src.present,
        "label_ts": label_ts,
        "on_invalid": cfg.on_invalid,
        "rows_read": report.rows_read,
        "rows_written": report.rows_written,
        "rows_quarantined": report.rows_quarantined,
        "problems": {f"{p.title} ({p.column})": p.rows for p in report.problems},
    }


__all__ = ["IngestConfig", "IngestError", "IngestReport", "Problem", "ingest", "load_mapping"]
