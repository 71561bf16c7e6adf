"""The synthetic generator: determinism, schema, the Handbook's shape, every scenario and its labels."""

import re
from datetime import UTC, date, datetime, timedelta

import numpy as np
import polars as pl
import pytest

from pipeline.data.dataset import read_dataset, write_dataset
from pipeline.data.generate import (
    FRAUD_SCENARIOS,
    SCENARIOS,
    GenerateConfig,
    build_world,
    generate,
    scenario_summary,
)
from pipeline.data.scenarios import terminals_within
from pipeline.data.schema import EVENT_ORDER, TRANSACTION_SCHEMA

INJECTED = ("account_takeover", "card_testing")
# Default rates on a small dataset: what a quick `txsentinel generate` gives.
SMALL = GenerateConfig(accounts=200, days=30, seed=7)
# Rates boosted far above the Handbook's so that every scenario shows up many times in a small dataset.
BUSY = GenerateConfig(
    accounts=300,
    days=40,
    seed=11,
    compromised_terminals_per_day=20.0,
    compromised_accounts_per_day=30.0,
    takeover_accounts_per_day=30.0,
    card_testing_accounts_per_day=40.0,
    drift_account_fraction=0.3,
)


@pytest.fixture(scope="module")
def small() -> pl.DataFrame:
    return generate(SMALL)


@pytest.fixture(scope="module")
def busy() -> pl.DataFrame:
    return generate(BUSY)


def _index(ids: pl.Series) -> np.ndarray:
    return ids.str.slice(1).cast(pl.Int64).to_numpy()


def _day_and_seconds(frame: pl.DataFrame, cfg: GenerateConfig) -> tuple[np.ndarray, np.ndarray]:
    start = datetime(cfg.start_date.year, cfg.start_date.month, cfg.start_date.day, tzinfo=UTC)
    us = (frame["ts"] - start).dt.total_microseconds().to_numpy()
    return us // 86_400_000_000, (us % 86_400_000_000) / 1e6


def test_same_seed_same_frame_and_different_seeds_differ(small):
    assert generate(SMALL).equals(small)
    other = generate(GenerateConfig(accounts=200, days=30, seed=8))
    assert not other.equals(small)
    assert other.height != small.height or not np.array_equal(other["amount"], small["amount"])


def test_schema_order_and_ids(small, tmp_path):
    assert small.height > 1000
    for name, dtype in small.schema.items():
        assert TRANSACTION_SCHEMA[name] == dtype, name
    assert small.columns == [n for n in TRANSACTION_SCHEMA if n in small.columns]
    assert {
        "event_id",
        "account_id",
        "ts",
        "amount",
        "terminal_id",
        "is_fraud",
        "label_ts",
        "scenario",
    } == set(small.columns)
    assert small.null_count().sum_horizontal().item() == 0
    assert small.equals(small.sort(EVENT_ORDER))
    assert small["event_id"].n_unique() == small.height
    assert small["event_id"].str.contains(r"^E\d{9}$").all()
    assert small["account_id"].str.contains(r"^A\d{5}$").all()
    assert small["terminal_id"].str.contains(r"^T\d{5}$").all()
    assert _index(small["account_id"]).max() < SMALL.accounts
    assert _index(small["terminal_id"]).max() < SMALL.n_terminals
    # The shared dataset writer takes the frame as it is.
    write_dataset(small, tmp_path, {"generator": "test"})
    assert read_dataset(tmp_path).equals(small)


def test_amounts_positive_finite_in_cents(busy):
    amount = busy["amount"].to_numpy()
    assert np.isfinite(amount).all()
    assert (amount > 0).all()
    np.testing.assert_allclose(np.round(amount * 100), amount * 100, atol=1e-6)


def test_times_inside_period_and_handbook_time_of_day(small):
    day, seconds = _day_and_seconds(small, SMALL)
    assert day.min() >= 0
    assert day.max() < SMALL.days
    own = small["scenario"].is_in(["legit", "drift"]).to_numpy()
    # N(43200, 20000) truncated to the day: mean noon, std about 0.91 x 20000.
    assert abs(seconds[own].mean() - 43_200) < 1_500
    assert 16_500 < seconds[own].std() < 20_000
    # Each day has events, roughly the Handbook's 2 per account and day on average.
    per_day = np.bincount(day, minlength=SMALL.days)
    assert per_day.min() > 0
    assert 1.2 < small.height / (SMALL.accounts * SMALL.days) < 2.2


def test_terminals_within_radius_of_home_except_injected(busy):
    world = build_world(BUSY)
    assert np.any(world.drift_home_per_day != 0)  # moving homes are exercised
    acc, term = _index(busy["account_id"]), _index(busy["terminal_id"])
    day, _ = _day_and_seconds(busy, BUSY)
    gap = world.terminal_xy[term] - world.home_xy(acc, day)
    distance = np.hypot(gap[:, 0], gap[:, 1])
    injected = busy["scenario"].is_in(list(INJECTED)).to_numpy()
    assert (distance[~injected] <= BUSY.radius + 1e-9).all()
    # Takeover and card testing happen near a terminal at least 25 from home, so at least 20 away.
    assert injected.sum() > 100
    assert (distance[injected] >= BUSY.unusual_terminal_distance_min - BUSY.radius).all()


@pytest.mark.parametrize(
    ("points", "terminals", "radius"), [(400, 1000, 5.0), (200, 60, 0.7), (50, 300, 150.0)]
)
def test_terminals_within_matches_brute_force(points, terminals, radius):
    rng = np.random.default_rng(points)
    xy = np.concatenate([[[0.0, 0.0], [100.0, 100.0], [100.0, 0.0]], rng.uniform(0, 100, (points, 2))])
    terminal_xy = rng.uniform(0, 100, (terminals, 2))
    reach = terminals_within(xy, terminal_xy, radius)
    # The slow reference: every (point, terminal) distance.
    near = np.hypot(*(xy[:, None, :] - terminal_xy[None, :, :]).transpose(2, 0, 1)) <= radius  # (P, M)
    np.testing.assert_array_equal(reach.counts(), near.sum(axis=1))
    np.testing.assert_array_equal(reach.indices, np.nonzero(near)[1])  # row-major: by point, then terminal


def test_accounts_without_terminals_make_no_own_transactions():
    cfg = GenerateConfig(accounts=200, days=20, terminals=30, seed=3, drift_account_fraction=0.0)
    frame = generate(cfg)
    world = build_world(cfg)
    gap = world.account_xy[:, None, :] - world.terminal_xy[None, :, :]  # (A, M, 2)
    lonely = ~(np.hypot(gap[..., 0], gap[..., 1]) <= cfg.radius).any(axis=1)
    assert 50 < lonely.sum() < cfg.accounts  # 30 terminals leave most accounts with none in reach
    own = frame.filter(~pl.col("scenario").is_in(list(INJECTED)))
    assert not lonely[_index(own["account_id"])].any()
    assert own.height > 0


def test_every_scenario_appears_with_consistent_labels(busy):
    assert set(busy["scenario"].unique()) == set(SCENARIOS)
    assert busy["is_fraud"].equals(busy["scenario"].is_in(list(FRAUD_SCENARIOS)), check_names=False)
    by = {s: busy.filter(pl.col("scenario") == s) for s in SCENARIOS}
    assert not by["drift"]["is_fraud"].any()
    assert not by["legit"]["is_fraud"].any()
    assert (by["high_amount"]["amount"] > BUSY.high_amount_threshold).all()
    assert (by["legit"]["amount"] <= BUSY.high_amount_threshold).all()
    # Card testing: tiny probes and large cash-outs, more probes than cash-outs.
    card = by["card_testing"]["amount"]
    tiny, large = (card <= BUSY.card_testing_probe_amount_max), (card >= BUSY.card_testing_cashout_amount_min)
    assert (tiny | large).all()
    assert tiny.sum() > large.sum() > 0


def test_drift_accounts_are_marked_and_their_amounts_grow(busy):
    world = build_world(BUSY)
    drift_accounts = set(np.unique(_index(busy.filter(pl.col("scenario") == "drift")["account_id"])))
    assert drift_accounts <= set(np.flatnonzero(world.drift))
    assert len(drift_accounts) > 0.8 * world.drift.sum()
    # Accounts whose amounts drift: late events are larger than early ones by about the planned factor.
    day, _ = _day_and_seconds(busy, BUSY)
    frame = busy.with_columns(day=pl.Series(day), acc=pl.Series(_index(busy["account_id"])))
    growing = np.flatnonzero(world.drift_amount_per_day > 0)
    ratio = (
        frame.filter(pl.col("scenario") == "drift", pl.col("acc").is_in(growing))
        .group_by("acc")
        .agg(
            early=pl.col("amount").filter(pl.col("day") < 10).mean(),
            late=pl.col("amount").filter(pl.col("day") >= BUSY.days - 10).mean(),
        )
        .drop_nulls()
        .select((pl.col("late") / pl.col("early")).median())
        .item()
    )
    assert 1.3 < ratio < 2.6


def test_takeover_spends_more_than_usual(busy):
    world = build_world(BUSY)
    takeover = busy.filter(pl.col("scenario") == "account_takeover")
    day, _ = _day_and_seconds(takeover, BUSY)
    usual = world.mean_amount_at(_index(takeover["account_id"]), day)
    factor = np.median(takeover["amount"].to_numpy() / usual)
    assert BUSY.takeover_amount_factor_min * 0.8 < factor < BUSY.takeover_amount_factor_max


def test_label_times(busy):
    delay = (busy["label_ts"] - busy["ts"]).dt.total_seconds(fractional=True).to_numpy()
    fraud = busy["is_fraud"].to_numpy()
    assert (delay >= 0).all()
    np.testing.assert_allclose(delay[~fraud], timedelta(days=BUSY.legit_label_delay_days).total_seconds())
    assert (delay[fraud] >= 3600 - 1e-3).all()
    assert (delay[fraud] <= timedelta(days=BUSY.label_delay_days_max).total_seconds() + 1e-3).all()
    # 1 h plus a gamma with mean 3.5 days, over thousands of frauds.
    assert 3.0 < delay[fraud].mean() / 86_400 < 4.2


def test_rates_scale_with_size(small):
    cfg = GenerateConfig(accounts=500)
    assert (cfg.n_terminals, cfg.account_scale, cfg.terminal_scale) == (1000, 0.1, 0.1)
    assert GenerateConfig(accounts=500, terminals=4000).terminal_scale == 0.4
    # Rates scale with the dataset, so the fraud rate stays near the Handbook's ~1% at any size,
    # and a small dataset still gets fraud.
    rates = {}
    for accounts in (1000, 4000):
        frame = generate(GenerateConfig(accounts=accounts, days=60, seed=5))
        rates[accounts] = frame["is_fraud"].mean()
    rates[SMALL.accounts] = small["is_fraud"].mean()
    assert all(0.003 < r < 0.025 for r in rates.values()), rates
    assert 0.5 < rates[1000] / rates[4000] < 2.0, rates
    # Switching a scenario off removes it.
    quiet = generate(GenerateConfig(accounts=200, days=30, seed=7, card_testing_accounts_per_day=0.0))
    assert "card_testing" not in set(quiet["scenario"])


def test_scenario_summary(busy):
    summary = scenario_summary(busy)
    assert summary["scenario"].to_list() == [*SCENARIOS, "all"]
    rows = summary.filter(pl.col("scenario") != "all")
    total = summary.filter(pl.col("scenario") == "all").row(0, named=True)
    assert rows["transactions"].sum() == total["transactions"] == busy.height
    assert rows["frauds"].sum() == total["frauds"] == busy["is_fraud"].sum()
    assert total["fraud_share"] == pytest.approx(busy["is_fraud"].mean())
    assert rows["share"].sum() == pytest.approx(1.0)
    high = rows.filter(pl.col("scenario") == "compromised_terminal").row(0, named=True)
    assert high["frauds"] == high["transactions"] > 0


def test_invalid_config_is_refused_with_the_field_named():
    with pytest.raises(ValueError, match="accounts=0"):
        GenerateConfig(accounts=0)
    with pytest.raises(ValueError, match="takeover_days_min=9 > takeover_days_max=4"):
        GenerateConfig(takeover_days_min=9, takeover_days_max=4)
    with pytest.raises(ValueError, match="drift_account_fraction"):
        GenerateConfig(drift_account_fraction=1.5)
    # A count must be an integer (YAML's true is not 1 account), a rate a number.
    for bad, message in (
        ({"accounts": True}, "accounts=True, expected an integer >= 1"),
        ({"days": 30.5}, "days=30.5, expected an integer >= 1"),
        ({"terminals": "many"}, "terminals='many', expected an integer >= 1 or None"),
        ({"radius": True}, "radius=True, expected a finite number >= 0"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            GenerateConfig(**bad)


def test_settings_reach_every_field_as_yaml_values():
    cfg = SMALL.with_settings(
        ["takeover_accounts_per_day=0", "takeover_days_max=4", "terminals=null", "start_date=2026-03-01"]
    )
    assert cfg.takeover_accounts_per_day == 0
    assert cfg.takeover_days_max == 4
    assert cfg.terminals is None
    assert cfg.start_date == datetime(2026, 3, 1).date()
    assert (cfg.accounts, cfg.seed) == (SMALL.accounts, SMALL.seed)  # the rest as it was
    assert SMALL.with_settings(["seed=8", "seed=9"]).seed == 9  # applied in order


def test_bad_settings_name_the_setting_and_what_was_expected():
    for item, message in (
        ("nope=1", "GenerateConfig has no field 'nope'"),
        ("accounts", "expected key=value"),
        ("takeover_days_min=abc", "takeover_days_min='abc', expected an integer >= 1"),
        ("card_testing_probes_max=2.5", "card_testing_probes_max=2.5, expected an integer >= 0"),
        ("start_date=soon", "start_date='soon', expected a date"),
        ("radius=[1", "--set 'radius=[1': the value is not valid YAML"),
        ("start_date=2026-13-01", "--set 'start_date=2026-13-01': the value is not valid YAML"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            SMALL.with_settings([item])


def test_numbers_with_an_exponent_are_numbers_as_train_reads_them(tmp_path):
    # YAML 1.1 reads 5e0, 1e9 and 5e-1 (no dot) as strings, which were refused as "expected a finite number".
    cfg = SMALL.with_settings(["radius=5e0", "high_amount_threshold=1e9", "drift_account_fraction=5e-1"])
    assert (cfg.radius, cfg.high_amount_threshold, cfg.drift_account_fraction) == (5.0, 1e9, 0.5)
    profile = tmp_path / "mine.yaml"
    profile.write_text("label_delay_days_mean: 35e-1\n")
    assert SMALL.with_file(profile).label_delay_days_mean == 3.5
    with pytest.raises(ValueError, match=re.escape("radius='wide', expected a finite number >= 0")):
        SMALL.with_settings(["radius=wide"])


@pytest.mark.parametrize("setting", ["label_delay_gamma_shape=0", "radius=0"])
def test_a_parameter_that_must_be_positive_is_refused_at_zero(setting):
    # A Gamma shape of 0 passed the check, then divided by zero drawing the label delays.
    name, _, value = setting.partition("=")
    with pytest.raises(ValueError, match=re.escape(f"{name}={value}, expected > 0")):
        SMALL.with_settings([setting])


def test_an_unusual_terminal_distance_no_home_can_reach_is_refused_naming_the_grid_s_distances():
    # At 1000 no terminal is ever that far, and every takeover silently got a random terminal instead.
    with pytest.raises(ValueError) as refused:
        SMALL.with_settings(["unusual_terminal_distance_min=1000"])
    message = str(refused.value)
    assert "unusual_terminal_distance_min=1000, expected at most 70.71" in message
    assert "the diagonal, is 141.42" in message
    assert SMALL.with_settings(["unusual_terminal_distance_min=70"]).unusual_terminal_distance_min == 70


def test_generate_command_applies_settings(tmp_path):
    from pipeline.cli.main import main

    out = tmp_path / "data"
    argv = ["generate", "--out", str(out), "--accounts", "200", "--days", "30", "--seed", "7"]
    assert (
        main([*argv, "--set", "takeover_accounts_per_day=0", "--set", "card_testing_accounts_per_day=40"])
        == 0
    )
    frame = read_dataset(out)
    counts = frame.group_by("scenario").len()
    per = dict(zip(counts["scenario"], counts["len"], strict=True))
    assert "account_takeover" not in per
    assert per["card_testing"] > 0
    assert main([*argv, "--set", "nope=1"]) == 2  # refused with the field named, nothing written over


def test_generate_command_reads_a_profile_then_the_flags_then_settings(tmp_path):
    from pipeline.cli.main import main

    out = tmp_path / "data"
    # The packaged profile by name; --days given beats the profile, --set beats both.
    argv = ["generate", "--out", str(out), "--config", "handbook", "--accounts", "300", "--days", "40"]
    assert main([*argv, "--set", "compromised_accounts_per_day=30"]) == 0
    frame = read_dataset(out)
    assert frame["ts"].dt.date().n_unique() == 40
    assert set(frame["scenario"]) == {"legit", "high_amount", "compromised_terminal", "compromised_account"}
    # Every label, fraud or legit, is known 7 days after its event (the Handbook's protocol), give or take
    # the profile's spread of about ten minutes.
    delay_days = (frame["label_ts"] - frame["ts"]).dt.total_seconds(fractional=True).to_numpy() / 86_400
    np.testing.assert_allclose(delay_days, 7.0, atol=1 / 24)
    # A file of settings of one's own, and the errors that name the file.
    profile = tmp_path / "mine.yaml"
    profile.write_text("days: 12\nseed: 3\ntakeover_accounts_per_day: 0\n")
    cfg = GenerateConfig().with_file(profile)
    assert (cfg.days, cfg.seed, cfg.takeover_accounts_per_day, cfg.accounts) == (12, 3, 0, 5000)
    for text, message in (
        ("nope: 1\n", "mine.yaml: GenerateConfig has no field 'nope'"),
        ("- days\n", "mine.yaml: expected a mapping of generator settings, got list"),
        ("days: [1\n", "mine.yaml: not valid YAML"),
        ("days: 0\n", "days=0, expected an integer >= 1"),
    ):
        profile.write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)):
            GenerateConfig().with_file(profile)
    assert main([*argv, "--config", str(tmp_path / "missing.yaml")]) == 2


@pytest.mark.slow
def test_handbook_size_has_the_handbooks_shape():
    # The time it takes is printed by `txsentinel generate`, not asserted here: a timed test flakes under load.
    frame = generate(GenerateConfig(accounts=5000, days=180, seed=0))
    assert 1_500_000 < frame.height < 2_100_000
    assert 0.005 < frame["is_fraud"].mean() < 0.015


def test_a_period_outside_the_years_a_dataset_holds_is_refused_before_generating(tmp_path, capsys):
    from pipeline.cli.main import main

    for start, days in ((date(9999, 12, 30), 180), (date(1969, 12, 31), 1), (date(2099, 12, 2), 31)):
        with pytest.raises(
            ValueError, match=f"start_date={start} with days={days}, expected days within 1970"
        ):
            GenerateConfig(start_date=start, days=days)
    # The last day 2099-12-31 held events, and their labels, up to 30 days later, a time no dataset holds.
    with pytest.raises(
        ValueError,
        match=r"start_date=2099-12-02 with days=30 and labels up to 30 days later \(legit_label_delay_days, "
        r"label_delay_days_max\), expected label times within 1970",
    ):
        GenerateConfig(start_date=date(2099, 12, 2), days=30)
    assert GenerateConfig(start_date=date(2099, 11, 2), days=30).days == 30  # labels by 2099-12-31
    out = tmp_path / "data"
    assert main(["generate", "--out", str(out), "--start-date", "9999-12-30", "--accounts", "5"]) == 2
    assert "start_date=9999-12-30 with days=180" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("setting", ["radius=0.0001", "terminals=1"])
def test_settings_that_make_no_transactions_are_refused_before_writing(setting, tmp_path, capsys):
    from pipeline.cli.main import main

    out = tmp_path / "data"
    argv = ["generate", "--out", str(out), "--accounts", "5", "--days", "2", "--set", setting]
    assert (
        main([*argv, "--set", "takeover_accounts_per_day=0", "--set", "card_testing_accounts_per_day=0"]) == 2
    )
    err = capsys.readouterr().err
    assert "txsentinel generate: these settings made no transactions (accounts=5," in err
    assert "Traceback" not in err and f"nothing was written to {out}" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (["accounts=1000000000000"], "terminals in reach of a home: accounts=1,000,000,000,000's homes x"),
        (["terminals=100000000000"], "day cells: (accounts=200 + terminals=100,000,000,000) x days=30"),
        (["takeover_accounts_per_day=1e12"], "events of takeovers: takeover_accounts_per_day x days x"),
        (["card_testing_probes_max=1000000000000"], "events of card tests: card_testing_accounts_per_day x"),
        (["compromised_terminals_per_day=1e15"], "compromised windows: (compromised_terminals_per_day +"),
    ],
    ids=["accounts", "terminals", "takeover rate", "probes", "compromised rate"],
)
def test_settings_too_big_for_memory_are_refused_before_generating_with_the_estimate(
    settings, named, tmp_path, capsys
):
    # Each failed deep in numpy ("Unable to allocate 14.6 TiB for an array with shape ..."), naming no setting.
    from pipeline.cli.main import main

    out = tmp_path / "data"
    argv = ["generate", "--out", str(out), "--accounts", "200", "--days", "30"]
    assert main([*argv, *(f"--set={s}" for s in settings)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "of memory to generate, more than this machine's " in err and named in err
    assert re.search(r"these settings need about [\d.,e+]+ [TPE]iB", err), err
    assert not out.exists()


def test_the_size_check_counts_against_the_memory_it_is_given():
    from pipeline.data.world import size_problem

    assert size_problem(SMALL, memory_bytes=2**30) == ""
    assert size_problem(SMALL, memory_bytes=None) == ""  # a system that does not say: no check
    said = size_problem(SMALL, memory_bytes=2**20)
    assert said.startswith(
        "these settings need about 0.0 GiB of memory to generate, more than this machine's 0.0 GiB"
    )
    assert "events: accounts=200 x days=30 x 2 a day: 1.2e+04" in said


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("legit_label_delay_days=1e300", "legit_label_delay_days=1e+300, expected at most 3650 (3650 days)"),
        ("label_delay_hours_min=1e6", "label_delay_hours_min=1000000.0, expected at most 87600 (3650 days)"),
        (
            "card_testing_probe_gap_seconds_max=1e300",
            "card_testing_probe_gap_seconds_max=1e+300, expected at most",
        ),
        ("takeover_amount_factor_max=1e308", "takeover_amount_factor_max=1e+308, expected at most 1000"),
        (
            "compromised_account_amount_factor=1e308",
            "compromised_account_amount_factor=1e+308, expected at most",
        ),
        (
            "card_testing_cashout_amount_max=1e308",
            "expected at most 1e+09 (the service's default max_amount)",
        ),
    ],
)
def test_a_duration_or_amount_past_what_a_dataset_holds_is_refused_by_name(setting, message):
    # Each made timestamps that overflowed (a polars panic), amounts of inf written to the dataset, or an
    # OverflowError in numpy's uniform.
    with pytest.raises(ValueError, match=re.escape(message)):
        SMALL.with_settings([setting])
