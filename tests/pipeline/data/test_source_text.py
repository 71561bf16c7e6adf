"""Ingest names the line of every CSV problem, as an editor numbers lines, and keeps its messages bounded."""

from pathlib import Path

import polars as pl
import pytest

from pipeline.data import source_text
from pipeline.data.dataset import QUARANTINE_FILE, read_dataset
from pipeline.data.ingest import IngestConfig, IngestError, ingest
from pipeline.data.mapping import load_mapping
from pipeline.data.source_text import first_non_utf8, unreadable

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "data"
HEADER = "event_id,account_id,terminal_id,ts,amount,category\n"
ROW = "{},x,t,2024-01-01,1,food\n"


def ingest_error(path: Path, mapping: Path = CONFIGS / "canonical.yaml", **kwargs) -> str:
    with pytest.raises(IngestError) as caught:
        ingest(IngestConfig(path, mapping, path.parent / "out", **kwargs))
    assert not (path.parent / "out").exists()
    return str(caught.value)


def write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_a_byte_that_is_not_utf8_is_named_by_line_column_and_offset_with_what_to_do(tmp_path):
    data = (HEADER + ROW.format("a")).encode() + b"b,x,t,2024-01-01,1,caf\xe9\n" + ROW.format("c").encode()
    csv = write_bytes(tmp_path / "latin1.csv", data)
    message = ingest_error(csv)
    assert message.startswith(
        f"{csv}: line 3, column 23 (byte 97 of the file) holds 0xE9, which is not UTF-8"
    )
    assert "iconv -f WINDOWS-1252 -t UTF-8" in message and "csv: {encoding: utf8-lossy}" in message
    assert (
        f"in a copy of {CONFIGS / 'canonical.yaml'} passed as --mapping" in message
    )  # not the package's file
    # The setting it offers works: the byte is read as U+FFFD, and the rest of the file as it is.
    mapping = tmp_path / "lossy.yaml"
    mapping.write_text((CONFIGS / "canonical.yaml").read_text() + "csv: {encoding: utf8-lossy}\n")
    ingest(IngestConfig(csv, mapping, tmp_path / "lossy"))
    assert read_dataset(tmp_path / "lossy")["category"].to_list() == ["food", "caf\ufffd", "food"]


def test_an_ndjson_byte_that_is_not_utf8_is_named_by_line(tmp_path):
    record = '{"event_id": "%s", "account_id": "x", "terminal_id": "t", "ts": "2024-01-01", "amount": 1}\n'
    path = write_bytes(tmp_path / "e.ndjson", (record % "a").encode() + (record % "b\xe9").encode("latin-1"))
    assert ingest_error(path).startswith(f"{path}: line 2, column 16 (byte 105 of the file) holds 0xE9")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        "caf\u00e9\n\U0001f600 ok\nline three".encode(),
        "ab\ncaf\u00e9\n".encode() + b"x\xe9y",  # a bad byte after good multi-byte characters
        "\U0001f600".encode() * 5 + b"\n\xff",
        "\u00e9".encode() * 9 + b"\xc3",  # the file ends inside a character
        b"\n\n\x80" + b"a" * 40,
        "\ufeffab\xe9".encode()[:-2] + b"\xe9",  # a byte-order mark takes no column
        "\ufeffa\nb".encode() + b"\xff",
    ],
)
@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, 1 << 20])
def test_the_first_bad_byte_is_found_across_chunk_boundaries(data, chunk_bytes, tmp_path, monkeypatch):
    monkeypatch.setattr(source_text, "_CHUNK_BYTES", chunk_bytes)
    found = first_non_utf8(write_bytes(tmp_path / "f.txt", data))
    try:  # the reference: decode it whole
        data.decode("utf-8")
        assert found is None
    except UnicodeDecodeError as error:
        before = data[: error.start]
        line_start = before.rfind(b"\n") + 1
        column = len(before[line_start:].decode().removeprefix("\ufeff" if line_start == 0 else "")) + 1
        assert (found.offset, found.line, found.column) == (error.start, before.count(b"\n") + 1, column)
        assert found.value == data[error.start]


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (  # the file ends inside the quoted field that opens on line 3
            ROW.format("a") + 'b,x,t,2024-01-01,1,"open\n' + ROW.format("c"),
            'line 3, column 20: a quoted field starts here and is never closed; close it, or write a " inside',
        ),
        (  # the same after a quoted field that holds a line break: line 4, not row 3
            'a,x,t,2024-01-01,1,"two\nlines"\n' + '"b,x,t,2024-01-01,1,food\n' + ROW.format("c"),
            "line 4, column 1: a quoted field starts here and is never closed",
        ),
        (  # polars would take the quote for the start of a quoted field that runs on to the end
            ROW.format("a") + 'b,x,t,2024-01-01,1,5" screen\n' + ROW.format("c"),
            'line 3, column 21: a " inside a field that does not start with one ("5" screen")',
        ),
        (
            ROW.format("a") + 'b,x,t,2024-01-01,1,"quoted" not\n' + ROW.format("c"),
            "line 3: ',' expected after '\"'; a quoted field ends at its closing \", so write",
        ),
        (  # a record with a field too many that spans lines is named by its first line
            'a,x,t,2024-01-01,1,"two\nlines"\nb,x,t,2024-01-01,1,"food\nstall",extra\n',
            "line 4 has 7 fields and the first record has 6; expected at most 6",
        ),
        (
            ROW.format("a") + ROW.format("b").replace("\n", "\r") + ROW.format("c"),
            'line 3 holds a carriage return ("\\r") inside it, which ends no line for the reader',
        ),
    ],
)
def test_a_csv_polars_refuses_is_named_by_the_line_of_its_problem(rows, expected, tmp_path):
    csv = write_bytes(tmp_path / "t.csv", (HEADER + rows).encode())
    assert ingest_error(csv).startswith(f"{csv}: {expected}")


def test_a_ragged_line_is_found_past_skipped_rows_of_another_width(tmp_path):
    csv = write_bytes(
        tmp_path / "t.csv",
        ("exported from the bank\n" + HEADER + ROW.format("a") + "b,x,t,2024-01-01,1,food,5\n").encode(),
    )
    mapping = tmp_path / "skip.yaml"
    mapping.write_text((CONFIGS / "canonical.yaml").read_text() + "csv: {skip_rows: 1}\n")
    assert ingest_error(csv, mapping).startswith(f"{csv}: line 4 has 7 fields and the first record has 6")


def test_a_header_that_is_not_utf8_is_named_when_a_mapped_column_is_not_found(tmp_path):
    csv = write_bytes(
        tmp_path / "t.csv", HEADER.replace("amount", "am\xe9nt").encode("latin-1") + ROW.format("a").encode()
    )
    message = ingest_error(csv)
    assert f'{csv} has no column "amount"' in message
    assert message.splitlines()[2].startswith("line 1, column 38 (byte 37 of the file) holds 0xE9")


def test_rows_after_a_field_with_line_breaks_are_named_by_the_line_they_start_on(tmp_path):
    csv = write_bytes(
        tmp_path / "t.csv",
        (
            '"junk\nbefore the header"\n'  # a skipped row of two lines
            + HEADER.replace("category", "note")  # a column the mapping does not read
            + 'e1,x,t,2024-01-01,1,"a note\non three\nlines"\n'
            + "e2,x,t,2024-01-01,-1,food\n"
            + 'e3,x,t,2024-01-01,1,"two\nlines"\n'
            + "e1,x,t,2024-01-01,1,food\n"
        ).encode(),
    )
    mapping = tmp_path / "skip.yaml"
    mapping.write_text((CONFIGS / "canonical.yaml").read_text() + "csv: {skip_rows: 1}\n")
    message = ingest_error(csv, mapping)
    assert f'{csv} row 2 (line 7), column amount -> amount: value "-1" is negative' in message
    assert (
        f'{csv} row 4 (line 10), column event_id -> event_id: value "e1" has the event_id of row 1 (line 4)'
        in message
    )

    ingest(IngestConfig(csv, mapping, tmp_path / "out", on_invalid="quarantine"))
    quarantine = pl.read_parquet(tmp_path / "out" / QUARANTINE_FILE)
    assert quarantine.select("row", "line").rows() == [(2, 7), (4, 10)]


def test_a_short_row_is_named_by_its_line_after_a_field_with_line_breaks(tmp_path):
    csv = write_bytes(
        tmp_path / "t.csv",
        (HEADER + 'a,x,t,2024-01-01,1,"two\nlines"\n' + "b,x,t,2024-01-01,1\n" + ROW.format("c")).encode(),
    )
    assert f"{csv} row 2 (line 4), has 5 fields and the header has 6; expected 6" in ingest_error(csv)


@pytest.mark.parametrize(
    ("rows", "fields"),
    [
        (["a,b,c", "a,b", "", "a,b,", "a", "  "], [3, 2, 0, 3, 1, 1]),
        (['a,"b,c"', '"a,b",', '"a",""', '"a,""b"",c"', "a,b"], [2, 2, 2, 1, 2]),  # separators in quotes
        (['a,"two\nlines"', "a,b", 'a,"b,c",', "", "a"], [2, 2, 3, 0, 1]),  # a record over two lines
        (["a,b\r", "a,b,c\r", "\r"], [2, 3, 0]),  # "\r\n" line ends
    ],
)
def test_fields_are_counted_as_a_csv_reader_counts_them(rows, fields, tmp_path):
    path = write_bytes(tmp_path / "t.csv", ("x,y,z\n" + "\n".join(rows) + "\n").encode())
    options = load_mapping(CONFIGS / "canonical.yaml").csv
    every = list(range(len(rows)))
    assert source_text.field_counts(path, options, every, len(rows)) == fields
    assert source_text.field_counts(path, options, every[1::2], len(rows)) == fields[1::2]


def test_a_line_break_in_an_id_or_category_is_refused_naming_the_line_and_column(tmp_path):
    csv = write_bytes(
        tmp_path / "t.csv",
        (
            HEADER + '"e\n1",x,t,2024-01-01,1,food\ne2,x,t,2024-01-01,1,"fo\r\nod"\n' + ROW.format("e3")
        ).encode(),
    )
    report = ingest(IngestConfig(csv, CONFIGS / "canonical.yaml", tmp_path / "out", on_invalid="quarantine"))
    assert read_dataset(tmp_path / "out")["event_id"].to_list() == ["e3"]
    assert report.rows_quarantined == 2
    examples = [example for problem in report.problems for example in problem.examples]
    assert examples == [
        f'{csv} row 1 (line 2), column event_id -> event_id: value "e\\n1" holds U+000A, not printable; '
        "expected printable, visible characters, at most 256, as the service reads them",
        f'{csv} row 2 (line 4), column category -> category: value "fo\\r\\nod" holds U+000D, not printable; '
        "expected printable, visible characters, at most 256, as the service reads them",
    ]


def test_a_hostile_file_gets_a_one_screen_error(tmp_path):
    # 100,000 columns, none the mapping's amount, one of them named with 100,000 characters
    names = ["event_id", "account_id", "terminal_id", "ts", "x" * 100_000, *(f"c{i}" for i in range(99_995))]
    csv = write_bytes(tmp_path / "wide.csv", (",".join(names) + "\n").encode())
    message = ingest_error(csv)
    assert len(message) < 1000 and len(message.splitlines()) == 2
    assert message.endswith(
        f'the file\'s columns are "event_id", "account_id", "terminal_id", "ts", "{"x" * 40}... '
        '(100000 characters)", ... and 99995 more'
    )

    # A 10 MB field: in a bad value (its line break shown as "\n"), and where polars quotes what it could not read.
    huge = "9" * 10_000_000
    bad_amount = write_bytes(
        tmp_path / "amount.csv", (HEADER + f'a,x,t,2024-01-01,"-1\n{huge}",food\n').encode()
    )
    unclosed = write_bytes(tmp_path / "quote.csv", (HEADER + f'a,x,t,2024-01-01,1,"{huge}\n').encode())
    for path, lines in ((bad_amount, 3), (unclosed, 1)):
        message = ingest_error(path)
        assert len(message) < 1000 and len(message.splitlines()) == lines
        assert all(len(line) < 400 for line in message.splitlines())
    assert f'value "-1\\n{"9" * 74}..." is not a number' in ingest_error(bad_amount)
    # What polars says of a file no check here explains is cut to its first line, and that line cut too.
    first_line = f"could not parse `{huge}` as dtype `str`"
    said = f"{first_line}\n\nThe current offset in the file is 19 bytes."
    message = unreadable(bad_amount, load_mapping(CONFIGS / "canonical.yaml"), "csv", said)
    assert message == f"cannot be read as csv: {first_line[:200]}... ({len(first_line)} characters)"
