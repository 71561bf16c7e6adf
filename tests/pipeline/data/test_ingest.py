import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from consumers.scoring.message_limits import MessageError
from consumers.scoring.messages import Transaction, decode_transaction, encode_transaction
from pipeline.data.dataset import QUARANTINE_FILE, read_dataset, read_metadata
from pipeline.data.ingest import IngestConfig, IngestError, ingest
from pipeline.data.mapping import MappingError, load_mapping
from pipeline.data.schema import TRANSACTION_SCHEMA

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "data"


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def canonical(rows: dict) -> pl.DataFrame:
    return pl.DataFrame(rows, schema={name: TRANSACTION_SCHEMA[name] for name in rows})


def write(path: Path, text: str) -> Path:
    path.write_text(text.lstrip("\n"))
    return path


def mapping_file(tmp_path: Path, text: str) -> Path:
    return write(tmp_path / "mapping.yaml", text)


# One row of each bad kind, between good ones; the comment after each row says what is wrong.
BAD_CSV = """
TRANSACTION_ID,TX_DATETIME,CUSTOMER_ID,TERMINAL_ID,TX_AMOUNT,TX_FRAUD
t1,2018-04-01 00:00:31,c1,m1,57.16,0
t2,2018-04-01 00:02:10,c2,m2,-5.0,0
t3,2018-04-01 00:03:00,,m3,10.0,0
t4,2018-04-01 25:00:00,c4,m4,10.0,0
t5,2018-04-01 00:05:00,c5,m5,ten,0
t6,2018-04-01 00:06:00,c6,m6,inf,0
t1,2018-04-01 00:07:00,c7,m7,10.0,1
t8,2018-04-01 00:08:00,c8,m8,10.0,maybe
t9,2018-04-01 00:09:00,c9,m9,12.5,1
"""
# negative amount (row 2), empty id (3), bad time (4), not a number (5), inf (6), duplicate (7), bad label (8)


def test_csv_with_renamed_columns_and_custom_format(tmp_path):
    csv = write(
        tmp_path / "bank.csv",
        """
ref;when;client;shop;eur;flag;note
b;31/01/2024 14:30;acc1;shopA;10,5;N;ignored
a;31/01/2024 14:30;acc2;shopB;  7.25 ;y;ignored too
c;01/07/2024 09:00;acc1;shopA;0;Y;
""",
    )
    mapping = mapping_file(
        tmp_path,
        """
columns: {event_id: ref, ts: when, account_id: client, terminal_id: shop, amount: eur, is_fraud: flag}
csv: {separator: ";"}
timestamps:
  ts: {format: "%d/%m/%Y %H:%M", timezone: Europe/Paris}
is_fraud_values: {fraud: ["Y"], legit: ["N"]}
""",
    )
    # "10,5" is not a number in this file: quarantine it and check that the rest is exactly right.
    report = ingest(IngestConfig(csv, mapping, tmp_path / "out", on_invalid="quarantine", label_delay_days=1))

    expected = canonical(
        {
            # Paris is UTC+1 in January and UTC+2 in July; rows come back in (ts, event_id) order.
            "event_id": ["a", "c"],
            "account_id": ["acc2", "acc1"],
            "ts": [utc(2024, 1, 31, 13, 30), utc(2024, 7, 1, 7)],
            "amount": [7.25, 0.0],
            "terminal_id": ["shopB", "shopA"],
            "is_fraud": [True, True],
            "label_ts": [utc(2024, 2, 1, 13, 30), utc(2024, 7, 2, 7)],
        }
    )
    assert_frame_equal(read_dataset(tmp_path / "out"), expected)
    assert (report.rows_read, report.rows_written, report.rows_quarantined) == (3, 2, 1)
    quarantine = pl.read_parquet(tmp_path / "out" / QUARANTINE_FILE)
    assert quarantine["row"].to_list() == [1] and quarantine["line"].to_list() == [2]
    assert quarantine["eur"].to_list() == ["10,5"]


def test_handbook_mapping_defaults_label_ts(tmp_path):
    header, *_, last = BAD_CSV.strip().splitlines()
    csv = write(tmp_path / "handbook.csv", f"{header}\n{last}\n")
    ingest(IngestConfig(csv, CONFIGS / "handbook.yaml", tmp_path / "out"))
    ingest(IngestConfig(csv, CONFIGS / "handbook.yaml", tmp_path / "out2", label_delay_days=2.5))

    frame = read_dataset(tmp_path / "out")
    assert frame["ts"].to_list() == [utc(2018, 4, 1, 0, 9)]
    assert frame["label_ts"].to_list() == [utc(2018, 4, 8, 0, 9)]  # ts + 7 days by default
    assert frame["is_fraud"].to_list() == [True]
    assert read_dataset(tmp_path / "out2")["label_ts"].to_list() == [utc(2018, 4, 3, 12, 9)]
    source = read_metadata(tmp_path / "out")["source"]
    assert source["input"] == str(csv.resolve()) and source["format"] == "csv"
    assert source["mapping"] == str((CONFIGS / "handbook.yaml").resolve())
    assert (source["rows_read"], source["rows_written"], source["rows_quarantined"]) == (1, 1, 0)
    assert source["on_invalid"] == "fail"


def test_ndjson_with_epoch_milliseconds(tmp_path):
    records = [
        # Numbers, text and booleans may all appear for the same key; an extra nested key is ignored.
        {"id": "e2", "card": "c1", "merchant": "m2", "time_ms": 1704067260500, "value": 3,
         "fraud": True, "chargeback_time_ms": 1704153600000, "mcc": "5411", "extra": {"a": 1}},
        {"id": "e1", "card": "c1", "merchant": "m1", "time_ms": "1704067200000", "value": "12.5",
         "fraud": "false", "chargeback_time_ms": 1704672000000, "extra": [1, 2]},
    ]  # fmt: skip
    path = write(tmp_path / "events.ndjson", "".join(json.dumps(r) + "\n" for r in records))
    report = ingest(IngestConfig(path, CONFIGS / "epoch_ndjson.yaml", tmp_path / "out"))

    expected = canonical(
        {
            "event_id": ["e1", "e2"],
            "account_id": ["c1", "c1"],
            "ts": [utc(2024, 1, 1), utc(2024, 1, 1, 0, 1, 0) + timedelta(milliseconds=500)],
            "amount": [12.5, 3.0],
            "terminal_id": ["m1", "m2"],
            "category": [None, "5411"],  # optional column: in the file, null where a record lacks it
            "is_fraud": [False, True],
            "label_ts": [utc(2024, 1, 8), utc(2024, 1, 2)],
        }
    )
    assert_frame_equal(read_dataset(tmp_path / "out"), expected)
    assert report.rows_read == report.rows_written == 2


def test_a_boolean_amount_column_is_no_amount_in_parquet_as_in_json(tmp_path):
    # Cast, true and false read 1.0 and 0.0: every row is refused, naming the value, as JSON's true is.
    source = pl.DataFrame(
        {"event_id": ["E1", "E2"], "account_id": ["A", "B"], "terminal_id": ["T", "T"],
         "ts": [datetime(2026, 3, 1, 12, tzinfo=UTC)] * 2, "amount": [True, False], "is_fraud": [False, False]}
    )  # fmt: skip
    source.write_parquet(tmp_path / "tx.parquet")
    with pytest.raises(IngestError) as caught:
        ingest(IngestConfig(tmp_path / "tx.parquet", CONFIGS / "canonical.yaml", tmp_path / "out"))
    assert 'row 1, column amount -> amount: value "true" is not a number' in str(caught.value)


def test_parquet_with_native_types(tmp_path):
    source = pl.DataFrame(
        {
            "tx": [10, 11],
            "cust": [1, 2],
            "term": ["T1", "T2"],
            "at": [datetime(2024, 3, 1, 12), datetime(2024, 3, 1, 13)],  # naive, local New York time
            "amt": [1.5, 2.0],
            "fraud": [False, True],
            "chan": ["web", "pos"],
        }
    )
    source.write_parquet(tmp_path / "tx.parquet")
    mapping = mapping_file(
        tmp_path,
        """
columns: {event_id: tx, account_id: cust, terminal_id: term, ts: at, amount: amt, is_fraud: fraud}
optional_columns: {channel: chan, country: not_in_this_file}
timestamps: {ts: {timezone: America/New_York}}
""",
    )
    ingest(IngestConfig(tmp_path / "tx.parquet", mapping, tmp_path / "out", label_delay_days=0))

    expected = canonical(
        {
            "event_id": ["10", "11"],
            "account_id": ["1", "2"],
            "ts": [utc(2024, 3, 1, 17), utc(2024, 3, 1, 18)],
            "amount": [1.5, 2.0],
            "terminal_id": ["T1", "T2"],
            "channel": ["web", "pos"],
            "is_fraud": [False, True],
            "label_ts": [utc(2024, 3, 1, 17), utc(2024, 3, 1, 18)],
        }
    )
    assert_frame_equal(read_dataset(tmp_path / "out"), expected)


def test_canonical_mapping_round_trips_a_dataset(tmp_path):
    frame = canonical(
        {
            "event_id": ["a", "b"],
            "account_id": ["x", "y"],
            "ts": [utc(2024, 1, 1), utc(2024, 1, 2)],
            "amount": [1.0, 2.0],
            "terminal_id": ["t", "u"],
            "is_fraud": [False, True],
            "label_ts": [utc(2024, 1, 3), utc(2024, 1, 9)],
        }
    )
    frame.write_parquet(tmp_path / "in.parquet")
    out = tmp_path / "out"
    ingest(IngestConfig(tmp_path / "in.parquet", CONFIGS / "canonical.yaml", out, on_invalid="quarantine"))
    assert_frame_equal(read_dataset(out), frame)
    # Nothing to set aside, but the quarantine file is there (and empty) so no stale one can linger.
    sources = ["event_id", "account_id", "terminal_id", "ts", "amount", "is_fraud", "label_ts"]
    assert pl.read_parquet(out / QUARANTINE_FILE).columns == ["row", *sources, "reason"]
    assert pl.read_parquet(out / QUARANTINE_FILE).is_empty()


def test_iso_timestamps_with_and_without_offsets(tmp_path):
    csv = write(
        tmp_path / "iso.csv",
        """
event_id,account_id,terminal_id,ts,amount
a,x,t,2024-01-31T13:45:00Z,1
b,x,t,2024-01-31T14:45:00.250+01:00,1
c,x,t,2024-01-31 13:46:00,1
d,x,t,2024-02-01,1
""",
    )
    ingest(IngestConfig(csv, CONFIGS / "canonical.yaml", tmp_path / "out"))
    assert read_dataset(tmp_path / "out")["ts"].to_list() == [
        utc(2024, 1, 31, 13, 45),
        utc(2024, 1, 31, 13, 45, 0, 250_000),
        utc(2024, 1, 31, 13, 46),
        utc(2024, 2, 1),
    ]


def test_an_amount_above_what_the_streams_state_holds_is_refused(tmp_path):
    # The service's state, and so the backtest's replay, hold amounts up to 1e15: a larger one is no event.
    csv = write(
        tmp_path / "big.csv",
        """
event_id,account_id,terminal_id,ts,amount
a,x,t,2024-01-31T13:45:00Z,1e15
b,x,t,2024-01-31T13:46:00Z,2e15
""",
    )
    with pytest.raises(IngestError) as caught:
        ingest(IngestConfig(csv, CONFIGS / "canonical.yaml", tmp_path / "out"))
    assert (
        f'{csv} row 2 (line 3), column amount -> amount: value "2e15" is above 1e+15; expected a finite amount '
        "in 0..1e+15"
    ) in str(caught.value)
    assert {p.title: p.rows for p in caught.value.report.problems} == {"amount too large": 1}


def test_fail_mode_names_every_problem_and_writes_nothing(tmp_path):
    csv = write(tmp_path / "transactions.csv", BAD_CSV)
    with pytest.raises(IngestError) as caught:
        ingest(IngestConfig(csv, CONFIGS / "handbook.yaml", tmp_path / "out"))

    message = str(caught.value)
    for expected in [
        f"{csv}: 7 of 9 rows are invalid, so nothing was written",
        f'{csv} row 2 (line 3), column TX_AMOUNT -> amount: value "-5.0" is negative; expected a finite amount in 0..1e+15',
        f'{csv} row 3 (line 4), column CUSTOMER_ID -> account_id: value "" is empty; expected a non-empty id',
        f'{csv} row 4 (line 5), column TX_DATETIME -> ts: value "2018-04-01 25:00:00" is not a timestamp; '
        'expected a date-time in format "%Y-%m-%d %H:%M:%S"',
        f'{csv} row 5 (line 6), column TX_AMOUNT -> amount: value "ten" is not a number',
        f'{csv} row 6 (line 7), column TX_AMOUNT -> amount: value "inf" is not finite',
        f'{csv} row 7 (line 8), column TRANSACTION_ID -> event_id: value "t1" has the event_id of row 1 (line 2)',
        f'{csv} row 8 (line 9), column TX_FRAUD -> is_fraud: value "maybe" is not a fraud label; '
        'expected one of "1" (fraud) or "0" (legit)',
    ]:
        assert expected in message
    report = caught.value.report
    assert {p.title: p.rows for p in report.problems} == {
        "negative amount": 1,
        "empty id": 1,
        "unparsable timestamp": 1,
        "amount not a number": 1,
        "amount not finite": 1,
        "duplicate event_id": 1,
        "invalid fraud label": 1,
    }
    assert (report.rows_read, report.rows_written, report.rows_invalid) == (9, 0, 7)
    assert not (tmp_path / "out").exists()


def test_fail_mode_counts_all_rows_but_quotes_only_the_first_few(tmp_path):
    rows = "".join(f"t{i},2018-04-01 00:00:00,c,m,-{i},0\n" for i in range(10))
    csv = write(tmp_path / "neg.csv", BAD_CSV.splitlines()[1] + "\n" + rows)
    with pytest.raises(IngestError) as caught:
        ingest(IngestConfig(csv, CONFIGS / "handbook.yaml", tmp_path / "out"))
    (problem,) = caught.value.report.problems
    # "-0" is not negative, so 9 of the 10 rows are.
    assert problem.rows == 9 and len(problem.examples) == 3
    assert "... and 6 more" in str(caught.value)


def test_quarantine_keeps_good_rows_and_explains_the_rest(tmp_path):
    csv = write(
        tmp_path / "transactions.csv", BAD_CSV.replace("t8,2018-04-01 00:08:00,c8,m8,10.0", "t8,,c8,m8,-1")
    )
    report = ingest(IngestConfig(csv, CONFIGS / "handbook.yaml", tmp_path / "out", on_invalid="quarantine"))

    assert read_dataset(tmp_path / "out")["event_id"].to_list() == ["t1", "t9"]  # the first t1 is kept
    assert (report.rows_read, report.rows_written, report.rows_quarantined) == (9, 2, 7)
    assert report.rows_read == report.rows_written + report.rows_quarantined
    quarantine = pl.read_parquet(tmp_path / "out" / QUARANTINE_FILE)
    assert quarantine["row"].to_list() == [2, 3, 4, 5, 6, 7, 8]
    assert quarantine["line"].to_list() == [3, 4, 5, 6, 7, 8, 9]
    assert quarantine["TX_AMOUNT"].to_list() == ["-5.0", "10.0", "10.0", "ten", "inf", "10.0", "-1"]
    assert all(v is None or isinstance(v, str) for v in quarantine["TX_DATETIME"])
    reasons = quarantine["reason"].to_list()
    assert "has the event_id of row 1 (line 2)" in reasons[5]
    # Row 8 has three problems; its reason names every one of them.
    assert reasons[6].count(" | ") == 2
    for part in ['TX_DATETIME -> ts: value "" is empty', 'value "-1" is negative', 'value "maybe"']:
        assert part in reasons[6]
    source = read_metadata(tmp_path / "out")["source"]
    assert source["rows_quarantined"] == 7 and source["on_invalid"] == "quarantine"
    assert source["problems"]["negative amount (TX_AMOUNT -> amount)"] == 2
    assert "7 quarantined" in report.format()


# Row 2 lacks only the optional category, row 3 the amount too, row 4 is blank; row 5 has all six fields, its
# category empty, which polars reads as it reads the fields row 2 lacks.
SHORT_CSV = """
event_id,account_id,terminal_id,ts,amount,category
a,x,t,2024-01-01,1,food
b,x,t,2024-01-01,1
c,x,t,2024-01-01

e,x,t,2024-01-01,2,
"""


def test_a_row_short_of_fields_is_named_by_its_line_not_filled_with_nulls(tmp_path):
    csv = write(tmp_path / "short.csv", SHORT_CSV)
    with pytest.raises(IngestError) as caught:
        ingest(IngestConfig(csv, CONFIGS / "canonical.yaml", tmp_path / "out"))
    cause = "(is the line cut short, or a field with a line break not quoted?)"
    assert caught.value.report.problem_lines() == [
        "  short row (the header has 6 fields): 3 rows",
        f"    {csv} row 2 (line 3), has 5 fields and the header has 6; expected 6 {cause}",
        f"    {csv} row 3 (line 4), has 4 fields and the header has 6; expected 6 {cause}",
        f"    {csv} row 4 (line 5), is blank and the header has 6 fields; expected 6 (delete the line)",
    ]  # and not "amount not a number" or "empty id": the row lacks those fields
    assert not (tmp_path / "out").exists()

    report = ingest(IngestConfig(csv, CONFIGS / "canonical.yaml", tmp_path / "out", on_invalid="quarantine"))
    assert (report.rows_written, report.rows_quarantined) == (2, 3)
    assert read_dataset(tmp_path / "out").select("event_id", "category").rows() == [
        ("a", "food"),
        ("e", None),
    ]
    quarantine = pl.read_parquet(tmp_path / "out" / QUARANTINE_FILE)
    assert quarantine.select("row", "line", "event_id").rows() == [(2, 3, "b"), (3, 4, "c"), (4, 5, None)]
    assert quarantine["reason"][0] == f"has 5 fields and the header has 6; expected 6 {cause}"
    assert read_metadata(tmp_path / "out")["source"]["problems"] == {"short row (the header has 6 fields)": 3}


def test_a_short_row_is_only_short_and_leaves_its_event_id_to_a_full_row(tmp_path):
    csv = write(
        tmp_path / "short.csv",
        "event_id,account_id,terminal_id,ts,amount\na,x,t,2024-01-01\na,x,t,2024-01-01,1\n",
    )
    report = ingest(IngestConfig(csv, CONFIGS / "canonical.yaml", tmp_path / "out", on_invalid="quarantine"))
    assert [(p.title, p.rows) for p in report.problems] == [("short row", 1)]  # not a duplicate too
    assert read_dataset(tmp_path / "out")["amount"].to_list() == [1.0]


def test_a_short_row_without_a_header_is_measured_against_the_first_record(tmp_path):
    csv = write(tmp_path / "short.csv", "a;x;t;2024-01-01;1\nb;x;t;2024-01-01;1\nc;x;t\n")
    mapping = mapping_file(
        tmp_path,
        """
columns: {event_id: column_0, account_id: column_1, terminal_id: column_2, ts: column_3, amount: column_4}
csv: {separator: ";", has_header: false}
""",
    )
    with pytest.raises(IngestError) as caught:
        ingest(IngestConfig(csv, mapping, tmp_path / "out"))
    assert f"{csv} row 3 (line 3), has 3 fields and the first record has 5; expected 5" in str(caught.value)


def test_label_ts_before_ts_is_reported(tmp_path):
    path = write(
        tmp_path / "e.ndjson",
        '{"id": "e1", "card": "c", "merchant": "m", "time_ms": 2000, "value": 1, "fraud": 1,'
        ' "chargeback_time_ms": 1000}\n',
    )
    with pytest.raises(
        IngestError, match=r'row 1, column chargeback_time_ms -> label_ts: value "1000" is before'
    ):
        ingest(IngestConfig(path, CONFIGS / "epoch_ndjson.yaml", tmp_path / "out"))


def test_mapped_column_absent_from_file(tmp_path):
    csv = write(tmp_path / "t.csv", "TRANSACTION_ID,TX_DATETIME,CUSTOMER_ID,TERMINAL_ID,AMOUNT,TX_FRAUD\n")
    with pytest.raises(IngestError) as caught:
        ingest(IngestConfig(csv, CONFIGS / "handbook.yaml", tmp_path / "out"))
    assert (
        f'{csv} has no column "TX_AMOUNT", which {CONFIGS / "handbook.yaml"} maps to canonical column amount'
        in str(caught.value)
    )
    assert '"AMOUNT"' in str(caught.value)  # the columns the file does have
    assert caught.value.report.problems[0].title == "missing column"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("colums: {}\n", r"unknown keys \['colums'\]; allowed keys are \['description', 'format'"),
        (
            "columns: {event_id: a, account_id: b, terminal_id: c, ts: d, amount: e}\n"
            "timestamps: {ts: {fromat: '%Y'}}\n",
            r"timestamps.ts: unknown keys \['fromat'\]",
        ),
        (
            "columns: {event_id: a, account_id: b, ts: d}\n",
            r"required canonical columns \['amount', 'terminal_id'\]",
        ),
        (
            "columns: {event_id: a, account_id: b, terminal_id: c, ts: d, amount: e, fraud: f}\n",
            r"\['fraud'\]",
        ),
        (
            "columns: {event_id: a, account_id: b, terminal_id: c, ts: d, amount: e, label_ts: f}\n",
            "maps label_ts but not is_fraud",
        ),
        (
            "columns: {event_id: a, account_id: b, terminal_id: c, ts: d, amount: e, is_fraud: f}\n"
            "is_fraud_values: {fraud: [yes], legit: [no]}\n",
            "is a YAML boolean; quote it",
        ),
        (
            "columns: {event_id: a, account_id: b, terminal_id: c, ts: d, amount: e}\n"
            "timestamps: {ts: {epoch: minutes}}\n",
            r"timestamps.ts.epoch: 'minutes' is not one of \['s', 'ms', 'us'\]",
        ),
        (
            "columns: {event_id: a, account_id: b, terminal_id: c, ts: d, amount: e}\n"
            "csv: {skip_rows: true}\n",
            "csv.skip_rows: expected a whole number >= 0, got True",
        ),
        (  # a date that YAML reads but cannot build raised a bare ValueError, naming no file
            "columns: {event_id: a, account_id: b, terminal_id: c, ts: d, amount: e}\nsince: 2026-13-01\n",
            r"not valid YAML: '2026-13-01' does not read as a timestamp \(month must be in 1..12\) .* line 2",
        ),
        (
            "columns: {event_id: a, account_id: b, terminal_id: c, ts: d, amount: e}\n"
            "csv: {has_header: 'no'}\n",
            "csv.has_header: expected true or false, got 'no'",
        ),
        (
            "columns: {event_id: a, account_id: b, terminal_id: c, ts: d, amount: e}\n"
            "csv: {null_values: 5}\n",
            "csv.null_values: expected a list of values, got 5",
        ),
        (
            "columns: {event_id: a, account_id: b, terminal_id: c, ts: d, amount: e}\n"
            "csv: {null_values: [1, null]}\n",
            "csv.null_values: None is not a plain value; expected text or a number",
        ),
        (
            "columns: {event_id: a, account_id: b, terminal_id: c, ts: d, amount: e}\n"
            "csv: {quote_char: 'ab'}\n",
            "csv.quote_char: expected one ASCII character, or null for none",
        ),
        (
            "columns: {event_id: a, account_id: b, terminal_id: c, ts: d, amount: e}\n"
            "csv: {separator: 'é'}\n",
            "csv.separator: expected one ASCII character, got 'é'",
        ),
        (
            "columns: {event_id: a, account_id: b, terminal_id: c, ts: d, amount: e}\n"
            "timestamps: {ts: {epoch: [s]}}\n",
            r"timestamps.ts.epoch: \['s'\] is not one of",
        ),
        (
            "columns: {event_id: a, account_id: b, terminal_id: c, ts: d, amount: e}\n"
            "timestamps: {ts: {format: '%H'}}\n",
            "timestamps.ts.format: '%H' is not a layout polars can read: Invalid format string",
        ),
        (b"\xff\xfe columns", r"not UTF-8 text \(byte 0\): expected a YAML file"),
    ],
)
def test_mapping_errors_are_clear(tmp_path, text, expected):
    path = tmp_path / "mapping.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(MappingError, match=expected) as caught:
        load_mapping(path)
    assert str(path) in str(caught.value)


def test_example_mappings_load():
    for path in sorted(CONFIGS.glob("*.yaml")):
        assert load_mapping(path).columns["event_id"]


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("missing.csv", None, "missing.csv: no such file"),
        ("empty.csv", "", "empty.csv: cannot be read as csv"),
        (
            "ragged.csv",
            "event_id,account_id,terminal_id,ts,amount\na,x,t,2024-01-01,1\nb,x,t,2024-01-01,1,5\n",
            "ragged.csv: line 3 has 6 fields and the first record has 5; expected at most 5",
        ),
        (
            "ragged_long.csv",  # the field is past the csv module's limit, which the line finder lifts
            "event_id,account_id,terminal_id,ts,amount\na,x,t,2024-01-01,1\nb,x,t,2024-01-01,1,"
            + "9" * 200_000
            + "\n",
            "ragged_long.csv: line 3 has 6 fields and the first record has 5; expected at most 5",
        ),
        (
            "lines.ndjson",
            '{"event_id": "a"}\n[1, 2]\n',
            "lines.ndjson: line 2 is '[1, 2]'; expected a JSON object",
        ),
        ("broken.ndjson", '{"event_id": "a"}\n\n{oops\n', "broken.ndjson: line 3 is not JSON"),
    ],
)
def test_unreadable_files_are_named_with_the_line(tmp_path, name, content, expected):
    if content is not None:
        write(tmp_path / name, content)
    with pytest.raises(IngestError, match=re.escape(expected)):
        ingest(IngestConfig(tmp_path / name, CONFIGS / "canonical.yaml", tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_timestamps_outside_the_years_a_dataset_holds_are_refused_row_by_row(tmp_path):
    csv = write(
        tmp_path / "far.csv",
        """
event_id,account_id,terminal_id,ts,amount
a,x,t,2024-01-01,1
b,x,t,+12026-01-01,1
c,x,t,1969-12-31T23:59:59Z,1
""",
    )
    with pytest.raises(IngestError) as caught:
        ingest(IngestConfig(csv, CONFIGS / "canonical.yaml", tmp_path / "out"))
    outside = "is outside 1970-01-01 .. 2099-12-31 UTC read as an ISO-8601 date-time"
    assert f'{csv} row 2 (line 3), column ts -> ts: value "+12026-01-01" {outside}' in str(caught.value)
    assert f'{csv} row 3 (line 4), column ts -> ts: value "1969-12-31T23:59:59Z" {outside}' in str(
        caught.value
    )
    assert not (tmp_path / "out").exists()

    report = ingest(IngestConfig(csv, CONFIGS / "canonical.yaml", tmp_path / "out", on_invalid="quarantine"))
    assert (report.rows_written, report.rows_quarantined) == (1, 2)
    assert read_dataset(tmp_path / "out")["ts"].to_list() == [utc(2024, 1, 1)]
    assert read_metadata(tmp_path / "out")["summary"]["last_ts"] == "2024-01-01T00:00:00+00:00"

    path = write(
        tmp_path / "e.ndjson",
        '{"id": "e1", "card": "c", "merchant": "m", "time_ms": -100000000000000, "value": 1, "fraud": 0,'
        ' "chargeback_time_ms": 1704672000000}\n',
    )
    with pytest.raises(
        IngestError,
        match=r'row 1, column time_ms -> ts: value "-100000000000000" is outside 1970-01-01 .. 2099-12-31 UTC '
        "read as a number of milliseconds",
    ):
        ingest(IngestConfig(path, CONFIGS / "epoch_ndjson.yaml", tmp_path / "out2"))


def test_a_label_time_defaulted_past_the_years_a_dataset_holds_is_refused_as_a_read_dataset_would(tmp_path):
    # ts + label_delay_days past 2099 was written, and the dataset then refused when read.
    header, first, *_ = BAD_CSV.strip().splitlines()
    csv = write(tmp_path / "late.csv", f"{header}\n{first}\nt2,2099-12-30 00:00:00,c2,m2,5.0,0\n")
    with pytest.raises(IngestError) as caught:
        ingest(IngestConfig(csv, CONFIGS / "handbook.yaml", tmp_path / "out"))
    assert (
        f'{csv} row 2 (line 3), column TX_DATETIME -> label_ts: value "2099-12-30 00:00:00" + label_delay_days = 7 '
        "(--label-delay-days) is outside 1970-01-01 .. 2099-12-31 UTC" in str(caught.value)
    )
    ingest(IngestConfig(csv, CONFIGS / "handbook.yaml", tmp_path / "out", on_invalid="quarantine"))
    assert read_dataset(tmp_path / "out")["event_id"].to_list() == ["t1"]


def test_of_rows_sharing_an_event_id_the_first_valid_one_is_kept(tmp_path):
    header = "event_id,account_id,terminal_id,ts,amount\n"
    csv = write(
        tmp_path / "dup.csv", header + "e1,x,t,2024-01-01,-5\ne1,x,t,2024-01-02,5\ne2,x,t,2024-01-03,1\n"
    )
    report = ingest(IngestConfig(csv, CONFIGS / "canonical.yaml", tmp_path / "out", on_invalid="quarantine"))

    assert read_dataset(tmp_path / "out")[["event_id", "amount"]].rows() == [("e1", 5.0), ("e2", 1.0)]
    assert (report.rows_written, report.rows_quarantined) == (2, 1)
    (reason,) = pl.read_parquet(tmp_path / "out" / QUARANTINE_FILE)["reason"]
    assert "is negative" in reason
    assert "has the event_id of row 2 (line 3), the first row with it and no other problem" in reason

    # Neither row of e1 valid: the second is flagged against the first, and no row is said to be kept.
    csv = write(tmp_path / "dup.csv", header + "e1,x,t,2024-01-01,-5\ne1,x,t,2024-01-02,-6\n")
    with pytest.raises(IngestError) as caught:
        ingest(IngestConfig(csv, CONFIGS / "canonical.yaml", tmp_path / "out2"))
    assert 'row 2 (line 3), column event_id -> event_id: value "e1" has the event_id of row 1 (line 2);' in (
        str(caught.value)
    )
    assert caught.value.report.rows_invalid == 2


def test_an_ndjson_key_first_seen_deep_in_the_file_is_still_mapped(tmp_path):
    def record(i: int, **more) -> str:
        base = {"id": f"e{i}", "card": "c", "merchant": "m", "time_ms": 1704067200000 + i, "value": 1}
        return json.dumps(base | {"fraud": 0, "chargeback_time_ms": 1704672000000} | more) + "\n"

    # The optional mcc (-> category) first appears after 1500 records; "entry" (-> channel) only escaped.
    lines = [record(i) for i in range(1500)]
    lines += [record(1500, mcc="5411"), record(1501).replace('"fraud"', '"extra": "\\u00e9", "fraud"')]
    lines += [record(1502).replace("}", ', "\\u0065ntry": "chip"}')]
    path = write(tmp_path / "deep.ndjson", "".join(lines))
    ingest(IngestConfig(path, CONFIGS / "epoch_ndjson.yaml", tmp_path / "out"))

    frame = read_dataset(tmp_path / "out")
    assert frame.filter(pl.col("category").is_not_null())[["event_id", "category"]].rows() == [
        ("e1500", "5411")
    ]
    assert frame.filter(pl.col("channel").is_not_null())[["event_id", "channel"]].rows() == [
        ("e1502", "chip")
    ]


@pytest.mark.parametrize("days", ["inf", "1e12", "3000000", "-1", "nan"])
def test_a_label_delay_past_ten_years_is_refused_in_one_line(days, tmp_path, capsys):
    from pipeline.cli.main import main

    header, *_, last = BAD_CSV.strip().splitlines()
    csv = write(tmp_path / "handbook.csv", f"{header}\n{last}\n")
    argv = ["ingest", str(csv), "--mapping", "handbook", "--out", str(tmp_path / "out")]
    assert main([*argv, "--label-delay-days", days]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "txsentinel ingest: label_delay_days (--label-delay-days) must be a number of days in 0..3650"
    )
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    assert main([*argv, "--label-delay-days", "3650"]) == 0
    assert read_dataset(tmp_path / "out")["label_ts"].to_list() == [
        utc(2018, 4, 1, 0, 9) + timedelta(days=3650)
    ]


def test_ingest_keeps_exactly_the_ids_the_service_decodes(tmp_path):
    # One rule for both (pipeline/data/ids.py): a row trained on must not carry an id the service refuses.
    ids = ["A1", "A 1", "é-ok", "\U0001f600", "A\u200b1", "T\x01", "\u034f", "x" * 257, "\u2800", "a\ufe0fb"]
    ids += ["e\u0301-ok", " \u0301"]  # a mark after its letter; marks alone
    rows = "".join(f"E{i},{v},2026-03-01T12:00:00Z,1.5,T{i},0\n" for i, v in enumerate(ids))
    csv = write(tmp_path / "t.csv", "event_id,account_id,ts,amount,terminal_id,is_fraud\n" + rows)
    report = ingest(IngestConfig(csv, CONFIGS / "canonical.yaml", tmp_path / "out", on_invalid="quarantine"))

    def decodes(account: str) -> bool:
        try:
            decode_transaction(encode_transaction(Transaction("E", account, 1_772_366_400_000_000, 1.5, "T")))
        except MessageError:
            return False
        return True

    kept = read_dataset(tmp_path / "out")["account_id"].to_list()
    kept_in_order = sorted(kept, key=ids.index)  # the output is sorted by event_id: E10 before E2
    assert (
        kept_in_order == [v for v in ids if decodes(v)] == ["A1", "A 1", "é-ok", "\U0001f600", "e\u0301-ok"]
    )
    reasons = pl.read_parquet(tmp_path / "out" / QUARANTINE_FILE)["reason"].to_list()
    assert (
        "holds U+200B, not printable" in reasons[0] and "holds U+034F, which prints as nothing" in reasons[2]
    )
    assert "has 257 characters, over the limit of 256" in reasons[3]
    assert "holds U+0301 first, a combining mark" in reasons[6]
    assert report.rows_quarantined == 7
