import json

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from pipeline.data.dataset import read_dataset, read_metadata, write_dataset
from pipeline.data.generate import generate
from pipeline.data.world import GenerateConfig


@pytest.fixture(scope="module")
def frames() -> tuple[pl.DataFrame, pl.DataFrame]:
    return (
        generate(GenerateConfig(accounts=20, days=3, seed=0)),
        generate(GenerateConfig(accounts=20, days=3, seed=1)),
    )


def test_a_write_that_fails_leaves_the_old_dataset_whole(frames, tmp_path, monkeypatch):
    old, new = frames
    out = tmp_path / "data"
    write_dataset(old, out, {"generator": "old"})

    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    # Fails after the new transactions are written, before their metadata is.
    monkeypatch.setattr(json, "dumps", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        write_dataset(new, out, {"generator": "new"})
    monkeypatch.undo()

    assert_frame_equal(read_dataset(out), old)
    assert read_metadata(out)["source"] == {"generator": "old"}
    assert [p.name for p in tmp_path.iterdir()] == ["data"]  # no staging directory left behind


def test_a_write_that_fails_into_a_new_directory_leaves_nothing(frames, tmp_path, monkeypatch):
    monkeypatch.setattr(json, "dumps", lambda *args, **kwargs: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        write_dataset(frames[0], tmp_path / "data", {"generator": "new"})
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_a_dataset_replaces_the_one_before_it_quarantine_included(frames, tmp_path):
    old, new = frames
    out = tmp_path / "data"
    write_dataset(old, out, {"generator": "old"}, quarantine=pl.DataFrame({"row": [1], "reason": ["bad"]}))
    write_dataset(new, out, {"generator": "new"})
    assert_frame_equal(read_dataset(out), new)
    assert sorted(p.name for p in out.iterdir()) == ["metadata.json", "transactions.parquet"]
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


def test_an_output_that_is_not_a_dataset_directory_is_refused_untouched(frames, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    with pytest.raises(ValueError, match=f"{afile} is a file; expected a dataset directory"):
        write_dataset(frames[0], afile, {})
    with pytest.raises(ValueError, match=f"{afile / 'data'} is under {afile}, which is a file"):
        write_dataset(frames[0], afile / "data", {})
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me too")
    with pytest.raises(ValueError, match=r"holds \['todo.txt'\], which are not a dataset's files"):
        write_dataset(frames[0], notes, {})
    assert afile.read_text() == "keep me" and (notes / "todo.txt").read_text() == "keep me too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "notes"]


def test_a_frame_with_times_no_dataset_holds_is_refused_before_writing(frames, tmp_path):
    far = frames[0].with_columns(pl.col("ts").dt.offset_by("3000y"))
    with pytest.raises(
        ValueError,
        match=r"timestamp out of range \(column ts\): \d+ rows.* expected a time in 1970-01-01 .. 2099-12-31",
    ):
        write_dataset(far, tmp_path / "data", {})
    assert list(tmp_path.iterdir()) == []


def _damage(out, name: str, content) -> None:
    if name == "transactions.parquet" and isinstance(content, pl.DataFrame):
        content.write_parquet(out / name)
    elif content is None:
        (out / name).unlink()
    else:
        (out / name).write_bytes(content)


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("metadata.json", b"{oops", "metadata.json: not valid JSON (Expecting property name"),
        ("metadata.json", b"[1]", "metadata.json: expected a JSON object, got list"),
        ("metadata.json", b"\xff{}", "metadata.json: not valid JSON ('utf-8' codec can't decode"),
        ("metadata.json", None, "metadata.json: no such file"),
        ("transactions.parquet", b"junk", "transactions.parquet: not a readable Parquet file (parquet: "),
        (
            "transactions.parquet",
            pl.DataFrame(
                {"event_id": ["a"], "account_id": ["x"], "terminal_id": ["t"], "amount": [1.0]}
            ).with_columns(ts=pl.lit("2024-01-01"), note=pl.lit("n")),
            "transactions.parquet: column ts is String, expected Datetime(time_unit='us', time_zone='UTC'); "
            "column note is not a canonical column",
        ),
        (
            "transactions.parquet",
            pl.DataFrame({"event_id": ["a"]}),
            "transactions.parquet: column account_id is missing; column ts is missing",
        ),
    ],
    ids=["bad json", "not an object", "not utf-8", "no metadata", "junk", "wrong types", "missing columns"],
)
def test_a_damaged_dataset_is_named_with_the_file_and_what_is_wrong(
    name, content, expected, frames, tmp_path, capsys
):
    from pipeline.cli.main import main

    out = tmp_path / "data"
    write_dataset(frames[0], out, {"generator": "test"})
    _damage(out, name, content)
    with pytest.raises((ValueError, FileNotFoundError)) as caught:
        read_dataset(out)
    assert f"{out / name}: " in str(caught.value) and expected in str(caught.value)
    assert "the dataset is damaged: make it again" in str(caught.value)

    assert main(["features", "--data", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and expected in err


ROW5 = pl.int_range(pl.len()) == 5  # the sixth row, an event_id E000000005 in a generated dataset


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            pl.when(ROW5).then(float("nan")).otherwise("amount").alias("amount"),
            "amount not finite (column amount)",
        ),
        (pl.when(ROW5).then(-3.0).otherwise("amount").alias("amount"), "negative amount (column amount)"),
        (pl.when(ROW5).then(2e15).otherwise("amount").alias("amount"), "amount too large (column amount)"),
        (pl.when(ROW5).then(None).otherwise("amount").alias("amount"), "missing amount (column amount)"),
        (
            pl.when(ROW5).then(None).otherwise("account_id").alias("account_id"),
            "empty id (column account_id)",
        ),
        (
            pl.when(ROW5).then(pl.lit("A\u200b")).otherwise("account_id").alias("account_id"),
            "id the service refuses",
        ),
        (
            pl.when(ROW5).then(pl.lit("fo\nod")).otherwise(pl.lit("food")).alias("category"),
            "text the service refuses (column category)",
        ),
        (
            pl.when(ROW5).then(None).otherwise("is_fraud").alias("is_fraud"),
            "missing fraud label (column is_fraud)",
        ),
        (pl.when(ROW5).then(None).otherwise("ts").alias("ts"), "missing timestamp (column ts)"),
        (pl.col("ts").dt.offset_by("-100y"), "timestamp out of range (column ts)"),
        (pl.col("label_ts").dt.offset_by("-8d"), "label_ts before ts (column label_ts)"),
    ],
    ids=[
        "nan",
        "negative",
        "too large",
        "null amount",
        "null id",
        "invisible id",
        "line break in category",
        "null label",
        "null ts",
        "ts",
        "label",
    ],
)
def test_a_dataset_edited_to_hold_what_ingest_refuses_is_refused_when_read(edit, expected, frames, tmp_path):
    out = tmp_path / "data"
    write_dataset(frames[0], out, {"generator": "test"})
    read_dataset(out).with_columns(edit).write_parquet(out / "transactions.parquet")
    with pytest.raises(ValueError) as caught:
        read_dataset(out)
    said = str(caught.value)
    assert said.startswith(f"{out / 'transactions.parquet'}: ") and expected in said
    assert "the first row " in said and "re-run `txsentinel ingest`" in said


def test_a_dataset_edited_out_of_order_or_with_a_repeated_id_is_refused_naming_the_first_row(
    frames, tmp_path
):
    out = tmp_path / "data"
    write_dataset(frames[0], out, {"generator": "test"})
    frame = read_dataset(out)
    first_id = frame["event_id"][0]
    repeated = frame.with_columns(
        pl.when(ROW5).then(pl.lit(first_id)).otherwise("event_id").alias("event_id")
    )
    repeated.write_parquet(out / "transactions.parquet")
    with pytest.raises(
        ValueError,
        match=rf"duplicate event_id \(column event_id\): 1 row, the first row 6 \(event_id '{first_id}'\)",
    ):
        read_dataset(out)
    frame.reverse().write_parquet(out / "transactions.parquet")
    last_but_one = frame["event_id"][-2]
    with pytest.raises(
        ValueError,
        match=rf"not in event order .*: {frame.height - 1} rows, the first row 2 \(event_id '{last_but_one}'\); expected rows sorted by \(ts, event_id\)",
    ):
        read_dataset(out)


def test_labels_without_their_times_are_refused_by_the_schema_check(frames, tmp_path):
    out = tmp_path / "data"
    write_dataset(frames[0], out, {"generator": "test"})
    read_dataset(out).drop("label_ts").write_parquet(out / "transactions.parquet")
    with pytest.raises(ValueError, match="column label_ts is missing, which is_fraud comes with"):
        read_dataset(out)


def test_an_edited_dataset_stops_a_command_in_one_line_before_any_work(frames, tmp_path, capsys):
    from pipeline.cli.main import main

    out = tmp_path / "data"
    write_dataset(frames[0], out, {"generator": "test"})
    read_dataset(out).with_columns(pl.col("amount") * -1).write_parquet(out / "transactions.parquet")
    assert main(["features", "--data", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "negative amount (column amount)" in err
