"""Acceptance: a generated dataset written as a CSV with other column names ingests back to itself."""

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from pipeline.cli.main import main
from pipeline.data.dataset import QUARANTINE_FILE, read_dataset

RENAMED = {
    "event_id": "TxnRef",
    "account_id": "Customer",
    "ts": "When",
    "amount": "Amount EUR",
    "terminal_id": "Merchant Terminal",
    "is_fraud": "Chargeback",
    "label_ts": "Reported",
    "scenario": "Truth",
}
MAPPING = """
columns:
  event_id: TxnRef
  account_id: Customer
  ts: When
  amount: Amount EUR
  terminal_id: Merchant Terminal
  is_fraud: Chargeback
  label_ts: Reported
  scenario: Truth
timestamps:
  ts: {format: "%d/%m/%Y %H:%M:%S%.f"}
  label_ts: {format: "%d/%m/%Y %H:%M:%S%.f"}
is_fraud_values: {fraud: ["Y"], legit: ["N"]}
"""


def write_renamed_csv(frame: pl.DataFrame, path) -> None:
    stamp = "%d/%m/%Y %H:%M:%S%.6f"
    frame.with_columns(
        pl.col("ts").dt.strftime(stamp),
        pl.col("label_ts").dt.strftime(stamp),
        pl.when(pl.col("is_fraud")).then(pl.lit("Y")).otherwise(pl.lit("N")).alias("is_fraud"),
    ).rename(RENAMED).write_csv(path)


def test_generate_then_ingest_renamed_csv_gives_the_same_dataset(tmp_path):
    generated_dir, ingested_dir = tmp_path / "generated", tmp_path / "ingested"
    assert (
        main(["generate", "--out", str(generated_dir), "--accounts", "150", "--days", "20", "--seed", "3"])
        == 0
    )
    generated = read_dataset(generated_dir)
    write_renamed_csv(generated, tmp_path / "export.csv")
    (tmp_path / "mapping.yaml").write_text(MAPPING)

    code = main(
        [
            "ingest",
            str(tmp_path / "export.csv"),
            "--mapping",
            str(tmp_path / "mapping.yaml"),
            "--out",
            str(ingested_dir),
        ]
    )
    assert code == 0
    assert_frame_equal(read_dataset(ingested_dir), generated)


def test_one_row_of_each_bad_kind_fails_naming_each_then_quarantine_keeps_the_rest(tmp_path, capsys):
    generated_dir = tmp_path / "generated"
    main(["generate", "--out", str(generated_dir), "--accounts", "40", "--days", "10", "--seed", "4"])
    frame = read_dataset(generated_dir)
    write_renamed_csv(frame, tmp_path / "export.csv")
    lines = (tmp_path / "export.csv").read_text().splitlines()
    header, rows = lines[0], lines[1:]
    columns = header.split(",")

    def broken(row: str, column: str, value: str) -> str:
        cells = row.split(",")
        cells[columns.index(column)] = value
        return ",".join(cells)

    bad = [
        broken(rows[0], "When", "31/02/2026 10:00:00.000000"),  # unparsable timestamp
        broken(rows[1], "Customer", ""),  # empty id
        broken(rows[2], "Amount EUR", "NaN"),  # not finite
        broken(rows[3], "Amount EUR", "-3.5"),  # negative
        rows[5],  # good; the next row repeats its event_id
        broken(rows[4], "TxnRef", rows[5].split(",")[0]),  # duplicate event_id
        broken(rows[6], "Reported", "01/01/2000 00:00:00.000000"),  # label_ts before ts
    ]
    (tmp_path / "bad.csv").write_text("\n".join([header, *bad, *rows[7:]]) + "\n")
    (tmp_path / "mapping.yaml").write_text(MAPPING)
    args = ["ingest", str(tmp_path / "bad.csv"), "--mapping", str(tmp_path / "mapping.yaml")]

    assert main([*args, "--out", str(tmp_path / "failed")]) == 2  # the input is wrong: the operator's to fix
    message = capsys.readouterr().err
    for expected in ("31/02/2026", 'value ""', '"NaN"', '"-3.5"', "has the event_id of", "label_ts"):
        assert expected in message, expected
    assert not (tmp_path / "failed" / "transactions.parquet").exists()

    assert main([*args, "--out", str(tmp_path / "kept"), "--on-invalid", "quarantine"]) == 0
    kept = read_dataset(tmp_path / "kept")
    quarantined = pl.read_parquet(tmp_path / "kept" / QUARANTINE_FILE)
    assert kept.height + quarantined.height == len(bad) + len(rows) - 7
    assert quarantined.height == 6
    assert quarantined["reason"].null_count() == 0
    assert rows[5].split(",")[0] in kept["event_id"].to_list()  # the first of the duplicates is kept
    assert "6" in capsys.readouterr().out


@pytest.mark.parametrize(
    "command",
    ["generate", "ingest", "features", "train", "promote", "serve", "backtest", "compare", "bench", "demo"],
)
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert "usage: txsentinel " + command in capsys.readouterr().out
