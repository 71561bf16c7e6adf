"""A source file as text: the line a CSV record starts on, and where a file polars refuses goes wrong.

polars reads a CSV fast but names no line: not the byte that is not UTF-8, the quote that never closes, or
the record with a field too many; a quoted field that holds line breaks makes its row number and its line
differ; and it fills the fields a record lacks with nulls, as it does empty fields, so that only the text
tells a record cut short from one whose last field is empty. The functions here find those lines and fields
by reading the file again in Python, so ingest calls them only for the rows it has to report or to tell
apart: a file that ingests cleanly, its last field never empty, never pays for them.

Lines are numbered from 1 as an editor shows them, each ending at "\\n"; a record starts on the line of its
first character. Records are counted as polars counts them: `skip_rows` records, the header, then the data.
"""

import csv
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import compress, islice
from pathlib import Path
from typing import TextIO

import polars as pl

import configs
from pipeline.data.mapping import CsvOptions, Mapping

SHOWN_ITEMS = 5  # a list in a message shows this many items, then "... and N more"
SHOWN_CHARS = 80  # a value quoted in a message is cut to about this many characters
_CHUNK_BYTES = 1 << 20
# Control characters, escaped as repr escapes them: a value quoted in a message keeps the message on one line.
_CONTROL = [chr(c) for c in (*range(32), *range(127, 160), 0x2028, 0x2029)]
_ESCAPED = [repr(c)[1:-1] for c in _CONTROL]


def cut(text: str, chars: int = SHOWN_CHARS) -> str:
    """`text` with control characters escaped as repr escapes them, cut to about `chars` characters."""
    shown = repr(text[: chars + 1])[1:-1]
    return shown if len(shown) <= chars else f"{shown[:chars]}... ({len(text)} characters)"


def cut_column(text: pl.Expr) -> pl.Expr:
    """[N] `text` cut to SHOWN_CHARS characters, control characters escaped: a column of values to quote."""
    long = text.str.len_chars() > SHOWN_CHARS
    cut_text = pl.when(long).then(text.str.slice(0, SHOWN_CHARS - 3) + "...").otherwise(text)
    return cut_text.str.replace_many(_CONTROL, _ESCAPED)


def listed(items: list[str], shown: int = SHOWN_ITEMS) -> str:
    """The first `shown` of `items`, quoted and cut, then how many more there are."""
    head = ", ".join(f'"{cut(item, 40)}"' for item in items[:shown])
    return head + (f", ... and {len(items) - shown} more" if len(items) > shown else "")


@dataclass(frozen=True)
class BadByte:
    offset: int  # bytes from the start of the file
    line: int
    column: int  # characters from the start of the line, from 1
    value: int

    def __str__(self) -> str:
        return (
            f"line {self.line}, column {self.column} (byte {self.offset} of the file) holds "
            f"0x{self.value:02X}, which is not UTF-8"
        )


def unreadable(path: Path, mapping: Mapping, fmt: str, said: str) -> str:
    """Why polars (or json) could not read `path`, having said `said`: what is wrong and, where it can be
    found, on which line."""
    found = None
    if fmt == "csv":
        found = not_utf8(path, mapping, fmt) if "utf-8" in said.lower() else None
        found = found or csv_problem(path, mapping.csv)
    # polars quotes the text it failed on, which may be the rest of the file: its first line, cut, will do.
    first_line = next(iter(said.strip().splitlines()), "")
    return found or not_utf8(path, mapping, fmt) or f"cannot be read as {fmt}: {cut(first_line, 200)}"


def not_utf8(path: Path, mapping: Mapping, fmt: str) -> str | None:
    """Where `path`, read as UTF-8, is not, and what to do; None when it is, or is not read as text."""
    if fmt not in ("csv", "ndjson") or (fmt == "csv" and mapping.csv.encoding != "utf8"):
        return None
    bad = first_non_utf8(path)
    if bad is None:
        return None
    converted = path.with_suffix(".utf8" + path.suffix)
    where = (  # a packaged profile lives inside the installed package: a copy is the user's to change
        f"a copy of {mapping.path} passed as --mapping"
        if mapping.path.parent == configs.packaged("data")
        else str(mapping.path)
    )
    lossy = f", or set `csv: {{encoding: utf8-lossy}}` in {where} to read such bytes as U+FFFD"
    return (
        f"{bad}; the file must be UTF-8 text. Convert it, e.g. `iconv -f WINDOWS-1252 -t UTF-8 {path} > "
        f"{converted}` (with the encoding it was written in){lossy if fmt == 'csv' else ''}"
    )


def first_non_utf8(path: Path) -> BadByte | None:
    """Where `path` first breaks UTF-8; None when all of it is UTF-8."""
    line, column, offset, carry = 1, 1, 0, b""
    leading = True  # no character read yet: a byte-order mark there takes no column an editor shows
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            data, start = carry + chunk, offset - len(carry)
            offset += len(chunk)
            try:
                good, bad, carry = data.decode("utf-8"), None, b""
            except UnicodeDecodeError as error:
                good, bad = data[: error.start].decode("utf-8"), error.start
                # A character cut by the chunk's end is read whole with the next chunk.
                if error.end == len(data) and error.reason == "unexpected end of data":
                    bad, carry = None, data[error.start :]
            if leading and good:
                good, leading = good.removeprefix("\ufeff"), False
            line += good.count("\n")
            column = len(good) - good.rfind("\n") if "\n" in good else column + len(good)
            if bad is not None:
                return BadByte(start + bad, line, column, data[bad])
    return BadByte(offset - len(carry), line, column, carry[0]) if carry else None


def data_lines(path: Path, options: CsvOptions, rows: list[int], rows_read: int) -> list[int | None]:
    """[N] the line each of `rows` (0-based data rows, ascending) starts on, None for a row not found;
    `rows_read`: how many data rows polars read from the file."""
    first = _first_data_line(options)
    if not rows or _a_record_per_line(path, options, rows_read):
        return [row + first for row in rows]
    starts = {row: line for row, line, _ in _data_records(path, options, rows)}
    return [starts.get(row) for row in rows]


def field_counts(path: Path, options: CsvOptions, rows: list[int], rows_read: int) -> list[int | None]:
    """[N] how many fields each of `rows` (0-based data rows, ascending) holds, 0 for a blank line, None for
    a row not found; `rows_read` as for data_lines."""
    if not rows:
        return []
    if _a_record_per_line(path, options, rows_read):  # the rows' lines are read alone, in one pass
        wanted = bytearray(rows[-1] + 1)
        for row in rows:
            wanted[row] = 1
        with _open_text(path) as f, _no_field_limit():
            data = islice(f, _first_data_line(options) - 1, None)
            return [_fields_on(line, options) for line in compress(data, wanted)]
    counts = {row: len(record) for row, _, record in _data_records(path, options, rows)}
    return [counts.get(row) for row in rows]


def _fields_on(line: str, options: CsvOptions) -> int | None:
    """How many fields `line`, a whole record, holds; None where csv cannot read it (a lone "\\r")."""
    line = line.removesuffix("\n").removesuffix("\r")
    if not line:
        return 0
    if not options.quote_char or options.quote_char not in line:
        return line.count(options.separator) + 1
    try:  # a separator may be inside a quoted field
        return len(next(csv.reader([line], **_dialect(options))))
    except csv.Error:
        return None


def _first_data_line(options: CsvOptions) -> int:
    """The line of data row 0 in a file with a line per record."""
    return options.skip_rows + int(options.has_header) + 1


def _a_record_per_line(path: Path, options: CsvOptions, rows_read: int) -> bool:
    """Whether no field of `path` holds a line break, so that data row R is on line R + the first."""
    return _line_count(path) == _first_data_line(options) - 1 + rows_read


def _data_records(path: Path, options: CsvOptions, rows: list[int]) -> Iterator[tuple[int, int, list[str]]]:
    """(row, the line it starts on, its fields) for each of `rows` (0-based data rows) found, in order."""
    wanted = set(rows)
    records = islice(_Records(path, options, strict=False), _first_data_line(options) - 1, None)
    try:
        for row, (line, record, _) in enumerate(records):
            if row in wanted:
                yield row, line, record
                wanted.discard(row)
                if not wanted:
                    return
    except csv.Error:  # text polars took and csv does not, such as a lone "\r": later rows go unnamed
        return


def csv_problem(path: Path, options: CsvOptions) -> str | None:
    """The first record that keeps polars from reading `path` as `options` describe, and why, naming its
    line; None: none found. Polars refuses a quote that never closes, a quote inside a field that does not
    start with one, and a record with more fields than the first after `skip_rows`."""
    records = _Records(path, options, strict=True)
    width = None
    try:
        for index, (line, record, quotes) in enumerate(records):
            if quotes % 2:  # a quoted field holds an even number: its opening, closing and doubled quotes
                return _stray_quote(path, options, line, records.line)
            if index < options.skip_rows:
                continue
            if width is not None and len(record) > width:
                found = f"line {line} has {len(record)} fields and the first record has {width}"
                return f"{found}; expected at most {width} (is a field with a separator not quoted?)"
            width = width or len(record)
    except csv.Error as error:
        return _csv_error(records, str(error))
    return None


class _Records:
    """(line it starts on, fields, quote characters in its text) for each record of a CSV file, as
    csv.reader reads them; `line` and `opened` say how far it got when it raises csv.Error."""

    def __init__(self, path: Path, options: CsvOptions, strict: bool):
        self.path, self.options, self.strict = path, options, strict
        self.line = 0  # lines read so far: the last line of the record just read
        self.quotes = 0  # quote characters read so far
        self.opened, self.opened_text = 0, ""  # the last line that leaves a quoted field open, and its text

    def __iter__(self) -> Iterator[tuple[int, list[str], int]]:
        with _open_text(self.path) as f, _no_field_limit():
            reader = csv.reader(self._lines(f), strict=self.strict, **_dialect(self.options))
            start, quotes = 1, 0
            for record in reader:
                yield start, record, self.quotes - quotes
                start, quotes = self.line + 1, self.quotes

    def _lines(self, f: TextIO) -> Iterator[str]:
        quote = self.options.quote_char
        for self.line, text in enumerate(f, 1):
            if quote and quote in text:
                before, self.quotes = self.quotes, self.quotes + text.count(quote)
                if self.quotes % 2 and not before % 2:
                    self.opened, self.opened_text = self.line, text
            yield text


def _csv_error(records: _Records, error: str) -> str:
    quote = records.options.quote_char
    if error == "unexpected end of data":  # the file ends inside a quoted field: the last one opened
        column = records.opened_text.rfind(quote or "") + 1  # the line's last quote leaves the field open
        return (
            f"line {records.opened}, column {column}: a quoted field starts here and is never closed; close "
            f"it, or write a {quote} inside a quoted field as two"
        )
    if error.startswith("new-line character"):
        return (
            f'line {records.line} holds a carriage return ("\\r") inside it, which ends no line for the '
            'reader; convert the file\'s line endings to "\\n"'
        )
    return (
        f"line {records.line}: {error}; a quoted field ends at its closing {quote}, so write a {quote} inside "
        "it as two"
    )


def _stray_quote(path: Path, options: CsvOptions, first: int, last: int) -> str:
    """The message for the record on lines first..last, whose quotes do not pair up: a quote inside a field
    that does not start with one, which polars takes for the start of a quoted field."""
    with _open_text(path) as f:
        text = "".join(islice(f, first - 1, last))
    quote, sep = options.quote_char, options.separator
    at_start, quoted, closed = True, False, -2
    for i, c in enumerate(text):
        if quoted:
            if c == quote:
                quoted, closed = False, i
        elif c == quote:
            if not (at_start or closed == i - 1):  # neither opens a field nor doubles a closing quote
                return _stray_quote_at(text, i, first, sep, quote)
            quoted = True
        at_start = not quoted and c in (sep, "\n")
    return f"lines {first}..{last} hold an odd number of {quote}: a quoted field is not closed"


def _stray_quote_at(text: str, i: int, first: int, sep: str, quote: str) -> str:
    line_start = text.rfind("\n", 0, i) + 1
    field_start = max(line_start, text.rfind(sep, 0, i) + 1)
    ends = [end for end in (text.find(sep, i), text.find("\n", i)) if end >= 0]
    field = text[field_start : min(ends, default=len(text))].rstrip("\r")
    line = first + text.count("\n", 0, i)
    return (
        f"line {line}, column {i - line_start + 1}: a {quote} inside a field that "
        f'does not start with one ("{cut(field)}"), which the reader takes for the start of a quoted field; '
        f"quote the whole field and write the {quote} inside it as two, or set csv.quote_char: null if the "
        "file quotes no field"
    )


def _line_count(path: Path) -> int:
    lines, last = 0, b"\n"
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            lines, last = lines + chunk.count(b"\n"), chunk[-1:]
    return lines + (last != b"\n")


def _dialect(options: CsvOptions) -> dict:
    """csv.reader's arguments for a file that polars reads with `options`."""
    quoting = {"quotechar": options.quote_char} if options.quote_char else {"quoting": csv.QUOTE_NONE}
    return {"delimiter": options.separator, **quoting}


def _open_text(path: Path) -> TextIO:
    # newline="\n": lines end where polars ends them, and a lone "\r" is no line break.
    return path.open(encoding="utf-8-sig", errors="replace", newline="\n")


@contextmanager
def _no_field_limit() -> Iterator[None]:
    # csv refuses a field over 131,072 characters; polars read it, so it is read here too.
    limit = csv.field_size_limit(sys.maxsize)
    try:
        yield
    finally:
        csv.field_size_limit(limit)
