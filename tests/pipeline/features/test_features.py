"""The feature definitions, and the specifications that batch and stream (bounded state) agree and that the
batch form's compiled kernels equal its polars/numpy reference bit for bit."""

import json
import struct
from datetime import UTC, datetime, timedelta

import numpy as np
import polars as pl
import pytest

from pipeline.features import (
    FEATURE_NAMES,
    EventBatch,
    LabelBatch,
    StreamingFeaturizer,
    compute_features,
    raw_aggregates,
    replay_batches,
)
from pipeline.features.batch_reference import raw_aggregates_reference
from pipeline.features.definitions import (
    DAY_US,
    RAW_FIELDS,
    RING_DAYS,
    WINDOW_DAYS,
    derive_features,
    feature_matrix,
)
from pipeline.features.stream_batches import take_events
from pipeline.features.stream_windows import grouped_cumsum

T0 = datetime(2026, 3, 2, tzinfo=UTC)  # a Monday


def frame_of(rows: list[tuple]) -> pl.DataFrame:
    """rows: (event_id, account, terminal, ts, amount, is_fraud, label_ts)."""
    return pl.DataFrame(
        rows,
        schema={
            "event_id": pl.String,
            "account_id": pl.String,
            "terminal_id": pl.String,
            "ts": pl.Datetime("us", "UTC"),
            "amount": pl.Float64,
            "is_fraud": pl.Boolean,
            "label_ts": pl.Datetime("us", "UTC"),
        },
        orient="row",
    )


def stream_raw(frame: pl.DataFrame, batch_events: int) -> dict[str, np.ndarray]:
    featurizer = StreamingFeaturizer()
    parts = [featurizer.raw_aggregates(e, labels) for e, labels in replay_batches(frame, batch_events)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


# -- definitions, by hand ------------------------------------------------------------------------------


def test_windows_are_whole_utc_days_including_the_event():
    day = timedelta(days=1)
    frame = frame_of(
        [
            ("e1", "a", "t", T0, 10.0, False, T0 + 7 * day),
            ("e2", "a", "t", T0 + 6 * day + timedelta(hours=23), 20.0, False, T0 + 14 * day),
            (
                "e3",
                "a",
                "t",
                T0 + 7 * day,
                40.0,
                False,
                T0 + 14 * day,
            ),  # day 7: e1 (day 0) leaves the 7d window
            ("e4", "a", "t", T0 + 7 * day + timedelta(seconds=1), 80.0, False, T0 + 14 * day),
        ]
    )
    raw = raw_aggregates(frame)
    assert raw["account_count_1d"].tolist() == [1, 1, 1, 2]
    assert raw["account_count_7d"].tolist() == [1, 2, 2, 3]
    assert raw["account_count_30d"].tolist() == [1, 2, 3, 4]
    assert raw["account_amount_7d"].tolist() == pytest.approx([10.0, 30.0, 60.0, 140.0])
    assert raw["prev_count"].tolist() == [0, 1, 2, 3]
    assert raw["gap_s"].tolist() == pytest.approx([0.0, 6 * 86400 + 23 * 3600, 3600, 1])
    assert raw["terminal_seen"].tolist() == [0, 1, 1, 1]
    assert raw["terminal_count_7d"].tolist() == [1, 2, 2, 3]


def test_terminal_reports_use_only_labels_known_at_the_event():
    hour = timedelta(hours=1)
    frame = frame_of(
        [
            ("f1", "x", "t", T0, 500.0, True, T0 + 5 * hour),  # fraud, reported 5 h later
            ("e1", "y", "t", T0 + 4 * hour, 10.0, False, T0 + 200 * hour),
            ("e2", "y", "t", T0 + 5 * hour, 10.0, False, T0 + 200 * hour),  # label_ts == ts: known
            ("e3", "z", "t", T0 + 30 * hour, 10.0, False, T0 + 200 * hour),  # next day: only 7d/30d see it
        ]
    )
    raw = raw_aggregates(frame)
    assert raw["terminal_reports_1d"].tolist() == [0, 0, 1, 0]
    assert raw["terminal_reports_7d"].tolist() == [0, 0, 1, 1]
    features = compute_features(frame)
    assert features["terminal_risk_7d"].to_list() == pytest.approx([0, 0, 1 / 4, 1 / 5])


def test_derived_features_have_the_documented_meaning():
    frame = frame_of(
        [
            ("e1", "a", "t1", T0 + timedelta(hours=3), 9.0, False, None),  # Monday 03:00: night
            ("e2", "a", "t2", T0 + timedelta(days=5, hours=12), 99.0, False, None),  # Saturday noon
        ]
    )
    f = compute_features(frame)
    assert f["is_night"].to_list() == [1.0, 0.0]
    assert f["is_weekend"].to_list() == [0.0, 1.0]
    assert f["is_first_event"].to_list() == [1.0, 0.0]
    assert f["new_terminal"].to_list() == [1.0, 1.0]
    assert f["log_amount"].to_list() == pytest.approx([np.log(10.0), np.log(100.0)])
    # Second event: z-score of log-amount against the first, with the prior variance 0.25.
    assert f["amount_z"][1] == pytest.approx((np.log(100.0) - np.log(10.0)) / 0.5)
    assert f["hour_cos"][1] == pytest.approx(-1.0)
    assert list(f.columns[-len(FEATURE_NAMES) - 1 : -1]) == list(FEATURE_NAMES)


def test_extreme_but_valid_inputs_stay_finite():
    rows = [
        (f"e{i}", "a", "t", T0 + timedelta(microseconds=i), 1e9 if i % 2 else 0.0, False, None)
        for i in range(50)
    ]
    features = compute_features(frame_of(rows))
    assert np.isfinite(features.select(FEATURE_NAMES).to_numpy()).all()


# -- batch kernels == batch reference -------------------------------------------------------------


def assert_kernels_equal_reference(frame: pl.DataFrame) -> None:
    fast, reference = raw_aggregates(frame), raw_aggregates_reference(frame)
    assert list(fast) == list(reference) == list(RAW_FIELDS)
    for name in RAW_FIELDS:
        assert fast[name].dtype == reference[name].dtype, name
        np.testing.assert_array_equal(fast[name], reference[name], err_msg=name)


def test_batch_kernels_equal_the_reference_bit_for_bit(generated):
    assert generated["is_fraud"].sum() > 100  # fraud reports at many terminals
    assert_kernels_equal_reference(generated)


def test_batch_kernels_equal_the_reference_on_ties_gaps_and_late_labels():
    day = timedelta(days=1)
    frame = frame_of(
        [
            ("e1", "A", "T1", T0, 10.0, True, T0 + 2 * day),  # label known two days later
            ("e2", "A", "T1", T0, 0.0, False, None),  # same ts: order by event_id, amount 0
            ("e3", "B", "T1", T0 + timedelta(seconds=1), 1e9, True, T0 + timedelta(seconds=1)),
            ("e4", "A", "T2", T0 + 2 * day, 5.5, False, None),  # label of e1 lands at this ts exactly
            ("e5", "B", "T1", T0 + 40 * day, 3.0, False, None),  # after every window
            ("e6", "C", "T1", T0 + 40 * day + timedelta(microseconds=1), 7.0, True, None),  # no label_ts
        ]
    )
    assert_kernels_equal_reference(frame)
    assert_kernels_equal_reference(frame.head(1))
    assert compute_features(frame.head(0)).height == 0


def test_unsorted_input_is_put_in_event_order_first(generated):
    sample = generated.head(3_000)
    shuffled = sample.sample(fraction=1.0, shuffle=True, seed=5)
    assert not shuffled["event_id"].equals(sample["event_id"])
    assert compute_features(shuffled).equals(compute_features(sample))


# -- batch == stream -----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_events", [500, 137])
def test_batch_and_stream_agree_on_a_generated_dataset(generated, batch_events):
    batch = raw_aggregates(generated)
    stream = stream_raw(generated, batch_events)
    assert set(batch) == set(stream)
    for name in batch:
        np.testing.assert_allclose(stream[name], batch[name], rtol=0, atol=1e-6, err_msg=name)
    features_batch = feature_matrix(derive_features(batch))
    features_stream = feature_matrix(derive_features(stream))
    assert np.abs(features_batch - features_stream).max() <= 1e-6
    # The dataset exercises what the features are about: labels known mid-stream, windows that roll over.
    assert batch["terminal_reports_30d"].max() > 0
    assert (batch["account_count_30d"] < batch["prev_count"] + 1).any()


def test_stream_state_round_trips_through_bytes_mid_stream(generated):
    batches = list(replay_batches(generated.head(20_000), 500))
    straight = StreamingFeaturizer()
    expected = [straight.transform(e, labels)[0] for e, labels in batches]

    resumed = StreamingFeaturizer()
    got = [resumed.transform(e, labels)[0] for e, labels in batches[:17]]
    data = resumed.to_bytes()
    resumed = StreamingFeaturizer.from_bytes(data)
    got += [resumed.transform(e, labels)[0] for e, labels in batches[17:]]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(expected))
    assert resumed.to_bytes() == straight.to_bytes()


def test_one_account_state_moves_between_featurizers_as_bytes(generated):
    head, tail = generated.head(10_000), generated.slice(10_000, 2_000)
    source = StreamingFeaturizer()
    for e, labels in replay_batches(head, 500):
        source.transform(e, labels)
    account = tail["account_id"][0]
    account_rows = tail.filter(pl.col("account_id") == account)
    target = StreamingFeaturizer()
    target.accounts.put_bytes(account, source.accounts.get_bytes(account))
    for terminal in source.terminals:
        target.terminals.put_bytes(terminal, source.terminals.get_bytes(terminal))
    event = EventBatch(
        account_rows["account_id"].to_list(),
        account_rows["terminal_id"].to_list(),
        account_rows["ts"].dt.epoch("us").to_numpy(),
        account_rows["amount"].to_numpy(),
    )
    expected = raw_aggregates(pl.concat([head, account_rows]).sort("ts", "event_id"))
    got = target.raw_aggregates(event)
    assert got["prev_count"][0] == expected["prev_count"][-len(account_rows)] > 0
    np.testing.assert_allclose(
        got["account_amount_30d"], expected["account_amount_30d"][-len(account_rows) :]
    )


def terminal_records(featurizer: StreamingFeaturizer) -> dict[str, bytes]:
    return {t: featurizer.terminals.get_bytes(t) for t in featurizer.terminals}


def test_terminal_state_is_the_same_whatever_order_and_split_the_events_are_folded_in(generated):
    """The scoring service merges instances' terminal counts on this: events and fraud labels folded in
    time order, or shuffled, in other batch sizes, and split across two featurizers whose journals are
    redone into one, give the same terminal records bit for bit."""
    frame = generated.head(20_000)
    in_order = StreamingFeaturizer()
    for events, labels in replay_batches(frame, 500):
        in_order.transform(events, labels)

    rng = np.random.default_rng(5)
    rows = frame[rng.permutation(frame.height)]  # many events arrive days late for their terminal
    # The labels replay_batches hands out: those known by the last event.
    fraud = rows.filter(pl.col("is_fraud") & (pl.col("label_ts") <= frame["ts"].max()))
    halves = [StreamingFeaturizer(), StreamingFeaturizer()]
    for half in halves:
        half.terminal_journal = []
    for start in range(0, rows.height, 333):
        part = rows.slice(start, 333)
        half = halves[(start // 333) % 2]
        half.transform(
            EventBatch(
                part["account_id"].to_list(),
                part["terminal_id"].to_list(),
                part["ts"].dt.epoch("us").to_numpy(),
                part["amount"].to_numpy(),
            )
        )
    labels = LabelBatch(
        fraud["terminal_id"].to_list(),
        fraud["label_ts"].dt.epoch("us").to_numpy(),
        np.ones(fraud.height, bool),
        fraud["event_id"].to_list(),
        fraud["account_id"].to_list(),
    )
    halves[1].observe_labels(labels)
    merged = StreamingFeaturizer()
    for half in reversed(halves):
        merged.apply_terminal_ops(half.take_terminal_journal())

    late = rows["ts"].dt.epoch("us").to_numpy() // DAY_US < np.maximum.accumulate(
        rows["ts"].dt.epoch("us").to_numpy() // DAY_US
    )
    assert late.mean() > 0.5 and fraud.height > 0  # the shuffle does bring late events; labels are in
    assert terminal_records(merged) == terminal_records(in_order)


def test_state_snapshot_of_another_version_is_refused():
    data = bytearray(StreamingFeaturizer().to_bytes())
    data[4] = 99  # state version
    with pytest.raises(ValueError, match="state v99"):
        StreamingFeaturizer.from_bytes(bytes(data))


def test_a_snapshot_whose_records_are_of_another_size_is_refused_by_name():
    featurizer = StreamingFeaturizer()
    featurizer.transform(EventBatch(["a"], ["t"], np.array([DAY_US]), np.ones(1)))
    data = featurizer.to_bytes()
    assert StreamingFeaturizer.from_bytes(data).terminals.get_bytes("t") == featurizer.terminals.get_bytes(
        "t"
    )
    # As written before snapshots said their record sizes, when a terminal's record was 484 bytes.
    magic, state, feature, length = struct.unpack_from("<4sHHI", data)
    header = json.loads(data[12 : 12 + length])
    del header["record_bytes"]
    text = json.dumps(header).encode()
    older = struct.pack("<4sHHI", magic, state, feature, len(text)) + text + data[12 + length :]
    with pytest.raises(ValueError, match="terminals records of 484 bytes; this txsentinel's are 996 bytes"):
        StreamingFeaturizer.from_bytes(older)


def snapshot(edit_records=None, edit_header=None, edit_bytes=None) -> bytes:
    """The snapshot of a featurizer that saw one event of account "a" at terminal "t", edited: its records
    in place (edit_records(account records [1], terminal records [1])), its JSON header (edit_header returns the new
    header's text, or edits it in place and returns None), or its bytes."""
    featurizer = StreamingFeaturizer()
    featurizer.transform(EventBatch(["a"], ["t"], np.array([20_500 * DAY_US]), np.array([12.5])))
    if edit_records is not None:
        edit_records(featurizer.accounts.records[:1], featurizer.terminals.records[:1])
    data = featurizer.to_bytes()
    if edit_header is not None:
        magic, state, feature, length = struct.unpack_from("<4sHHI", data)
        header = json.loads(data[12 : 12 + length])
        text = edit_header(header) or json.dumps(header).encode()
        data = struct.pack("<4sHHI", magic, state, feature, len(text)) + text + data[12 + length :]
    return data if edit_bytes is None else edit_bytes(data)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (
            {"edit_records": lambda a, t: np.put(a["day_amount"], 20_500 % RING_DAYS, np.nan)},
            "the accounts record of 'a' holds day_amount = nan, expected a finite sum >= 0, which no events "
            "give",
        ),
        (
            {"edit_records": lambda a, t: np.put(a["count"], 0, -3)},
            "the accounts record of 'a' holds count = -3, expected a count >= 0",
        ),
        (
            {"edit_records": lambda a, t: np.put(t["day"], 0, 2**30)},
            "the terminals record of 't' holds day = 1073741824, expected an epoch day in 0..1048575",
        ),
        (
            {"edit_bytes": lambda d: d[:-1]},
            "1 terminals take 996 bytes, 995 follow: the snapshot is truncated",
        ),
        ({"edit_bytes": lambda d: d + b"x"}, "has 1 trailing bytes"),
        ({"edit_bytes": lambda d: d[:7]}, "not a txsentinel featurizer state snapshot .*7 bytes"),
        ({"edit_bytes": lambda d: d[:12] + b"x" + d[13:]}, "its header is not JSON"),
        ({"edit_header": lambda h: b"[" * 100_000}, "its header is not JSON"),
        ({"edit_header": lambda h: b"[1, 2]"}, "its header is list, expected a JSON object"),
        ({"edit_header": lambda h: h.update(accounts=5)}, "its accounts are 5, expected a list of keys"),
        ({"edit_header": lambda h: h.update(accounts=["a", "a"])}, "accounts key 'a' appears more than once"),
    ],
    ids=[
        "nan amount",
        "negative count",
        "day out of range",
        "truncated",
        "trailing",
        "short",
        "garbled header",
        "deep header",
        "header a list",
        "keys not a list",
        "repeated key",
    ],
)
def test_a_snapshot_holding_what_no_events_give_is_refused_naming_what(corrupt, message):
    assert StreamingFeaturizer.from_bytes(snapshot()).to_bytes() == snapshot()
    with pytest.raises(ValueError, match=message):
        StreamingFeaturizer.from_bytes(snapshot(**corrupt))


def test_late_event_in_the_stream_is_featurized_without_going_back_in_time():
    featurizer = StreamingFeaturizer()
    ts = np.array([10 * DAY_US, 12 * DAY_US, 11 * DAY_US])  # third event arrives late
    raw = featurizer.raw_aggregates(EventBatch(["a"] * 3, ["t"] * 3, ts, np.array([1.0, 2.0, 3.0])))
    assert raw["gap_s"].tolist() == [0.0, 2 * 86400.0, 0.0]  # clipped, not negative
    assert raw["account_count_1d"].tolist() == [1, 1, 2]  # its window ends on the newest day seen


@pytest.mark.parametrize("batches", [[4], [1, 1, 1, 1], [2, 2], [3, 1]])
def test_a_late_event_counts_on_its_own_day_in_later_events_windows(batches):
    # Days 10 and 12, then one from day 2 for a million, then day 13: the day-13 event's 7-day windows (days
    # 7..13) hold days 10 and 12 and itself, not day 2, however the four are cut into batches; its 30-day
    # windows hold all four. At its account and at its terminal alike.
    ts = np.array([10, 12, 2, 13]) * DAY_US
    amounts = np.array([1.0, 2.0, 1e6, 3.0])
    featurizer, rows, start = StreamingFeaturizer(), [], 0
    for size in batches:
        part = slice(start, start + size)
        rows.append(
            featurizer.raw_aggregates(EventBatch(["a"] * size, ["t"] * size, ts[part], amounts[part]))
        )
        start += size
    last = {name: np.concatenate([r[name] for r in rows])[-1] for name in rows[0]}
    assert last["account_count_7d"] == 3 and last["account_amount_7d"] == 6.0
    assert last["account_count_30d"] == 4 and last["account_amount_30d"] == 1e6 + 6.0
    assert last["terminal_count_7d"] == 3 and last["terminal_count_30d"] == 4


def test_features_do_not_depend_on_how_a_stream_with_late_events_is_cut_into_batches(generated):
    """One event in twenty arrives up to a few days late: every batching gives the features of events one
    at a time (no in-batch windows at all), so the service's features never depend on how polls fall."""
    frame = generated.head(6_000)
    rng = np.random.default_rng(3)
    arrival = np.arange(frame.height, dtype=np.float64)
    delayed = rng.random(frame.height) < 0.05
    arrival[delayed] += rng.integers(50, 3_000, int(delayed.sum()))
    rows = frame[np.argsort(arrival, kind="stable")]
    ts = rows["ts"].dt.epoch("us").to_numpy()
    assert (ts < np.maximum.accumulate(ts)).sum() > 200  # late events, many days behind some of them
    events = EventBatch(
        rows["account_id"].to_list(), rows["terminal_id"].to_list(), ts, rows["amount"].to_numpy()
    )

    def featurized(batch_events: int) -> np.ndarray:
        featurizer = StreamingFeaturizer()
        parts = [
            featurizer.transform(take_events(events, np.arange(i, min(i + batch_events, len(ts)))))[0]
            for i in range(0, len(ts), batch_events)
        ]
        return np.concatenate(parts)

    one_at_a_time = featurized(1)
    for batch_events in (64, 500):
        np.testing.assert_allclose(featurized(batch_events), one_at_a_time, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("batches", [[2, 1, 1], [4], [1, 3]], ids=["one a batch", "one batch", "late first"])
def test_a_late_event_changes_no_later_events_gap(batches):
    # Hourly events, then one from years before, then the next hour's: that one's gap is an hour, as in
    # time order, however the stream is cut into batches (the late event moves no account's clock back).
    hour = 3600 * 10**6
    t0 = 20_000 * DAY_US
    ts = np.array([t0, t0 + hour, 10_957 * DAY_US, t0 + 2 * hour])
    featurizer, gaps, start = StreamingFeaturizer(), [], 0
    for size in batches:
        part = slice(start, start + size)
        batch = EventBatch(["a"] * size, ["t"] * size, ts[part], np.ones(size))
        gaps += featurizer.raw_aggregates(batch)["gap_s"].tolist()
        start += size
    assert gaps == [0.0, 3600.0, 0.0, 3600.0]


def test_labels_between_batches_are_applied_by_observe_labels():
    featurizer = StreamingFeaturizer()
    featurizer.observe_labels(LabelBatch(["t"], np.array([DAY_US]), np.array([True]), ["e"], ["a"]))
    raw = featurizer.raw_aggregates(EventBatch(["a"], ["t"], np.array([DAY_US + 1]), np.array([1.0])))
    assert raw["terminal_reports_1d"].tolist() == [1]


# -- nothing from the future ---------------------------------------------------------------------------


def test_features_do_not_see_later_events_or_later_labels(generated):
    cutoff = generated["ts"].min() + timedelta(days=40)
    full = compute_features(generated)
    # Remove every later event, and flip every label that became known after the cutoff.
    past = generated.filter(pl.col("ts") < cutoff).with_columns(
        pl.when(pl.col("label_ts") > cutoff)
        .then(~pl.col("is_fraud"))
        .otherwise(pl.col("is_fraud"))
        .alias("is_fraud")
    )
    truncated = compute_features(past)
    full_past = full.filter(pl.col("ts") < cutoff)
    assert truncated["event_id"].to_list() == full_past["event_id"].to_list()
    np.testing.assert_array_equal(
        truncated.select(FEATURE_NAMES).to_numpy(), full_past.select(FEATURE_NAMES).to_numpy()
    )


def test_state_written_in_a_batch_that_grows_the_tables_is_not_lost():
    # 1,100 fraud labels at terminals never seen before grow the terminal table past its initial capacity in
    # the middle of a batch; what the batch writes must land in the grown table.
    featurizer = StreamingFeaturizer()
    label_terminals = [f"L{i}" for i in range(1_100)]
    labels = LabelBatch(
        label_terminals,
        np.full(1_100, DAY_US),
        np.ones(1_100, bool),
        [f"e{i}" for i in range(1_100)],
        ["a"] * 1_100,
    )
    featurizer.transform(EventBatch(["a"], ["t0"], np.array([DAY_US + 5]), np.array([3.0])), labels)
    record = np.frombuffer(featurizer.terminals.get_bytes("t0"), dtype=featurizer.terminals.dtype)[0]
    assert record["day_count"].sum() == 1
    reported = np.frombuffer(featurizer.terminals.get_bytes("L1099"), dtype=featurizer.terminals.dtype)[0]
    assert reported["report_count"].sum() == 1
    raw = featurizer.raw_aggregates(EventBatch(["b"], ["t0"], np.array([DAY_US + 9]), np.array([3.0])))
    assert raw["terminal_count_1d"].tolist() == [2]


# -- one account's input never reaches another's features ------------------------------------------


def test_grouped_running_sums_add_each_groups_own_values_only():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 40, size=60)
    groups = np.repeat(np.arange(len(lengths)), lengths)
    first = np.r_[True, groups[1:] != groups[:-1]]
    values = rng.lognormal(3.0, 2.0, size=len(groups))
    sums = grouped_cumsum(values, first)
    for g in range(len(lengths)):
        mine = groups == g
        np.testing.assert_allclose(sums[mine], np.cumsum(values[mine]), rtol=1e-12)
        alone = grouped_cumsum(values[mine], first[mine])  # the group alone, at another place
        np.testing.assert_array_equal(sums[mine], alone)
    extreme = np.where(groups == 7, 1e308, values)  # one group overflows to inf ...
    with np.errstate(over="ignore"):
        poisoned = grouped_cumsum(extreme, first)
    assert np.isinf(poisoned[groups == 7]).any()
    np.testing.assert_array_equal(poisoned[groups != 7], sums[groups != 7])  # ... and no other group sees it


def stream_features(frame: pl.DataFrame, batch_events: int) -> tuple[np.ndarray, StreamingFeaturizer]:
    featurizer = StreamingFeaturizer()
    parts = [featurizer.transform(e, labels)[0] for e, labels in replay_batches(frame, batch_events)]
    return np.concatenate(parts), featurizer


def test_one_accounts_extreme_amounts_leave_every_other_accounts_features_bit_for_bit(generated):
    frame = generated.head(6_000)
    chosen = frame["account_id"].value_counts(sort=True)["account_id"][0]
    # The chosen account on a terminal of its own: terminal counts are shared by design, amounts are not.
    extreme = frame.with_columns(
        pl.when(pl.col("account_id") == chosen)
        .then(pl.lit(1e15))
        .otherwise(pl.col("amount"))
        .alias("amount"),
        pl.when(pl.col("account_id") == chosen)
        .then(pl.lit("own"))
        .otherwise(pl.col("terminal_id"))
        .alias("terminal_id"),
    )
    normal = extreme.with_columns(
        pl.when(pl.col("account_id") == chosen).then(pl.lit(1.0)).otherwise(pl.col("amount")).alias("amount")
    )
    others = (frame["account_id"] != chosen).to_numpy()
    got, _ = stream_features(extreme, 500)
    expected, _ = stream_features(normal, 500)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[others], expected[others])


def test_an_event_whose_features_are_not_finite_is_left_out_and_changes_no_state():
    ts = T0.timestamp() * 1e6 + np.arange(6) * 1e6
    batch = EventBatch(
        ["a", "x", "a", "x", "a", "b"],
        ["t1", "tx", "t1", "tx", "t2", "t1"],
        ts.astype(np.int64),
        np.array([5.0, 1e308, 7.0, 1e308, 2.0, 3.0]),  # x's second event: its 30-day sum is inf
    )
    featurizer = StreamingFeaturizer()
    with np.errstate(over="ignore", invalid="ignore"):
        features, buckets, kept, left_out = featurizer.transform_finite(batch)
    assert kept.tolist() == [0, 1, 2, 4, 5] and np.isfinite(features).all() and len(buckets) == 5
    assert left_out == {
        3: ["account_log_mean_amount_1d", "account_log_mean_amount_7d", "account_log_mean_amount_30d"]
    }
    # As if x's second event had never come: the same features and the same state, byte for byte.
    without = StreamingFeaturizer()
    alone = EventBatch(
        [batch.account_ids[i] for i in kept],
        [batch.terminal_ids[i] for i in kept],
        batch.ts_us[kept],
        batch.amounts[kept],
    )
    np.testing.assert_array_equal(features, without.transform(alone)[0])
    assert featurizer.to_bytes() == without.to_bytes()


def test_a_window_sum_adds_the_amounts_in_the_window_only():
    # Account a: 1e15 (the largest amount an event may hold) forty days before, then one come late from a
    # year before; b: the late one only, its windows otherwise holding all its events of the batch. Neither
    # 1e15 is in the windows of the small amounts of today, whose sums hold no trace of them, whether the
    # events come in one batch or one at a time.
    day = 20_500
    days = np.array([day - 40, day, day, day, day - 400, day, day, day - 400, day])
    batch = EventBatch(
        ["a"] * 6 + ["b"] * 3,
        ["t"] * 9,
        days * DAY_US + np.arange(9),
        np.array([1e15, 0.1, 0.2, 0.3, 1e15, 0.7, 0.1, 1e15, 0.7]),
    )
    together = StreamingFeaturizer().raw_aggregates(batch)
    alone = StreamingFeaturizer()
    one_by_one = [alone.raw_aggregates(take_events(batch, np.array([i]))) for i in range(9)]
    today = [1, 2, 3, 5, 6, 8]
    expected = [0.1, 0.1 + 0.2, 0.1 + 0.2 + 0.3, 0.1 + 0.2 + 0.3 + 0.7, 0.1, 0.1 + 0.7]
    for d in WINDOW_DAYS:
        name = f"account_amount_{d}d"
        assert together[name][0] == one_by_one[0][name][0] == 1e15
        np.testing.assert_allclose(together[name][today], expected, rtol=1e-15, atol=0, err_msg=name)
        np.testing.assert_allclose([one_by_one[i][name][0] for i in today], expected, rtol=1e-15, atol=0)
