"""Train settings: defaults in code, profiles of what differs, and errors that name the file and the key."""

import re
import subprocess
import sys

import polars as pl
import pytest
import torch
import yaml

from models.registry import REGISTRY, config_class
from pipeline.cli.main import main
from pipeline.data.splits import Period
from pipeline.training.config import (
    PROFILES_DIR,
    QUICK_PROFILE,
    TrainConfig,
    load_train_config,
    resolve_split,
    split_dataset,
)
from pipeline.training.train import train

PROFILES = sorted(PROFILES_DIR.glob("*.yaml"))


def test_reading_the_train_config_does_not_import_mlflow():
    # The registry name checks imported MLflow (seconds) with the config module; they now do so when they run.
    code = "import sys, pipeline.training.config; print(sorted(m for m in sys.modules if m.startswith('mlflow')))"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "[]"


def test_the_profile_the_demo_and_notebooks_train_with_is_shipped():
    assert QUICK_PROFILE in PROFILES


def test_without_a_file_the_settings_are_the_defaults(tmp_path):
    assert load_train_config(tmp_path) == TrainConfig(data=tmp_path)


@pytest.mark.parametrize("profile", PROFILES, ids=lambda path: path.name)
def test_a_shipped_profile_holds_only_what_differs_and_each_value_reaches_the_config(profile, tmp_path):
    written = yaml.safe_load(profile.read_text())
    cfg, defaults = load_train_config(tmp_path, profile), TrainConfig(data=tmp_path)
    detector_settings = written.pop("model_config", {})
    for key, value in written.items():
        assert getattr(cfg, key) == value, key
        assert getattr(defaults, key) != value, f"{profile.name}: {key} = {value!r} is the default already"
    assert cfg.model_config == detector_settings
    for name in REGISTRY:  # every detector builds from the profile
        config_class(name)(**detector_settings)
    for key, value in detector_settings.items():  # and each setting changes some detector's default
        defaults = {getattr(config_class(name)(), key) for name in REGISTRY}
        assert defaults != {value}, f"{profile.name}: model_config.{key} is every detector's default"


def test_an_unknown_key_is_named_with_where_it_was_given_the_file_or_the_flag(tmp_path):
    path = tmp_path / "profile.yaml"
    path.write_text("max_epochs: 3\nmax_epoch: 4\n")  # one letter short
    with pytest.raises(
        ValueError, match=r"unknown train setting\(s\) \['max_epoch'\] \('max_epoch' from .*profile\.yaml\)"
    ):
        load_train_config(tmp_path, path)
    path.write_text("max_epochs: 3\n")
    with pytest.raises(ValueError, match=r"\['max_epoch'\] \('max_epoch' from --set max_epoch=1\)"):
        load_train_config(tmp_path, path, ["max_epoch=1"])  # the flag's typo, not the file's


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("max_epochs: [1\n", "not valid YAML"),
        ("- max_epochs: 3\n", "expected a mapping of train settings, got list"),
        ("!!python/object/apply:os.system ['true']\n", "not valid YAML"),
        (b"max_epochs: \xff\xfe3\n", r"not UTF-8 text \(byte 12\)"),
    ],
)
def test_a_file_that_is_not_a_mapping_of_settings_is_refused_naming_it(tmp_path, text, complaint):
    path = tmp_path / "profile.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: {complaint}"):
        load_train_config(tmp_path, path)
    with pytest.raises(FileNotFoundError, match=r"--config .*missing\.yaml: no such file"):
        load_train_config(tmp_path, tmp_path / "missing.yaml")


def test_numbers_written_with_an_exponent_are_numbers(tmp_path):
    # YAML 1.1 reads 5e-4 (no dot) as a string; a typed setting takes it as the number it is.
    cfg = load_train_config(tmp_path, overrides=["learning_rate=5e-4", "model_config.input_clip=1e3"])
    assert cfg.learning_rate == 0.0005
    assert config_class("lstm")(**cfg.model_config).input_clip == 1000.0
    with pytest.raises(ValueError, match=r"train setting learning_rate = 'fast': expected a number"):
        load_train_config(tmp_path, overrides=["learning_rate=fast"])
    with pytest.raises(ValueError, match=r"LSTMConfig.input_clip = 'wide': expected a number"):
        config_class("lstm")(input_clip="wide")


def test_a_set_flag_that_does_not_read_is_refused_naming_the_flag(tmp_path):
    # Malformed YAML and a date that does not exist raise inside the YAML reader; the flag is named all the same.
    for item in ("max_epochs=[1", "seed=2026-13-01"):
        with pytest.raises(ValueError, match=re.escape(f"--set {item!r}: the value is not valid YAML")):
            load_train_config(tmp_path, overrides=[item])
    with pytest.raises(
        ValueError, match=r"--set 'max_epochs': expected key=value, e\.g\. --set max_epochs=3"
    ):
        load_train_config(tmp_path, overrides=["max_epochs"])


@pytest.mark.parametrize("value", ["-1", "1.5"])
def test_pretraining_epochs_below_zero_or_fractional_are_refused_with_the_value(value, tmp_path):
    with pytest.raises(
        ValueError, match=rf"train config: pretrain_epochs = {value}, expected an integer >= 0"
    ):
        load_train_config(tmp_path, None, [f"pretrain_epochs={value}"])
    assert load_train_config(tmp_path, None, ["pretrain_epochs=0"]).pretrain_epochs == 0


@pytest.mark.parametrize("setting", ["devices=0", "num_nodes=0", "num_nodes=1.5"])
def test_a_count_of_devices_or_machines_below_one_is_refused_with_its_name(setting, tmp_path):
    name, _, value = setting.partition("=")
    with pytest.raises(ValueError, match=rf"train config: {name} = {value}, expected an integer >= 1"):
        load_train_config(tmp_path, None, [setting])


@pytest.mark.parametrize(
    "setting, expected",
    [
        ("max_epochs=true", "max_epochs = True, expected an integer >= 1"),  # YAML's true is not 1 epoch
        ("delay_days=-1", "delay_days = -1, expected an integer >= 0"),
        ("train_days=0", "train_days = 0, expected an integer >= 1"),
        ("early_stopping_patience=1.5", "early_stopping_patience = 1.5, expected an integer >= 0"),
        ("seed=-3", "seed = -3, expected an integer >= 0"),
        ("warmup_steps=no", "warmup_steps = False, expected an integer >= 0"),
        ("weight_decay=-0.1", "weight_decay = -0.1, expected a finite number >= 0"),
        ("gradient_clip=nan", "gradient_clip = nan, expected a finite number >= 0"),
        ("pos_weight=0", "pos_weight = 0, expected a finite number > 0"),
        ("alert_budget_per_day=inf", "alert_budget_per_day = inf, expected a finite number > 0"),
        ("alert_budget_per_day=true", "alert_budget_per_day = True, expected a finite number > 0"),
    ],
)
def test_a_setting_of_the_wrong_kind_or_out_of_range_is_refused_with_its_name_and_value(
    setting, expected, tmp_path
):
    with pytest.raises(ValueError, match=f"train config: {re.escape(expected)}"):
        load_train_config(tmp_path, None, [setting])


def test_optional_settings_take_null_and_the_bounds_that_mean_off_are_allowed(tmp_path):
    settings = ["train_days=null", "pos_weight=null", "gradient_clip=0", "weight_decay=0", "delay_days=0"]
    cfg = load_train_config(tmp_path, None, settings)
    assert (cfg.train_days, cfg.pos_weight, cfg.gradient_clip, cfg.weight_decay) == (None, None, 0, 0)


@pytest.mark.parametrize(
    "model, hybrid_base, step, expected",
    [
        ("transformer", "linear_transformer", ["batch_accounts=16"], 1e-3),
        ("transformer", "linear_transformer", ["batch_accounts=64"], 1e-3),
        ("linear_transformer", "linear_transformer", ["batch_accounts=16"], 1e-3),
        # A larger step, a larger rate: 32 accounts a step, in one process or over two ranks.
        ("linear_transformer", "linear_transformer", ["batch_accounts=32"], 2e-3),
        ("linear_transformer", "linear_transformer", ["batch_accounts=16", "devices=2"], 2e-3),
        ("linear_transformer", "linear_transformer", ["batch_accounts=8", "devices=2"], 1e-3),
        ("lstm", "linear_transformer", ["batch_accounts=16"], 2e-3),
        ("hybrid", "transformer", ["batch_accounts=16"], 1e-3),  # a hybrid's base trains at the base's rate
        ("hybrid", "linear_transformer", ["batch_accounts=16"], 1e-3),
        ("hybrid", "lstm", ["batch_accounts=16"], 2e-3),
    ],
)
def test_each_detector_trains_at_its_own_learning_rate_unless_one_is_given(
    tmp_path, model, hybrid_base, step, expected
):
    base = [f"hybrid_base={hybrid_base}", *step]
    assert load_train_config(tmp_path, None, base, model=model).learning_rate == expected
    assert load_train_config(tmp_path, None, [*base, "learning_rate=5e-4"], model=model).learning_rate == 5e-4
    quick = load_train_config(tmp_path, QUICK_PROFILE, base, model=model)
    assert quick.learning_rate == 0.002  # the profile's rate, for every detector


def test_the_thorough_profile_trains_each_detector_at_the_rate_its_figures_were_measured_at(tmp_path):
    rates = {
        model: load_train_config(tmp_path, PROFILES_DIR / "thorough.yaml", model=model).learning_rate
        for model in ("lstm", "linear_transformer", "transformer")
    }
    assert rates == {"lstm": 2e-3, "linear_transformer": 2e-3, "transformer": 1e-3}


@pytest.mark.parametrize("rate", ["0", "-1e-3", "nan", "inf"])
def test_a_learning_rate_that_is_not_a_finite_positive_number_is_refused_with_its_value(rate, tmp_path):
    with pytest.raises(ValueError, match=r"train config: learning_rate = .*, expected a finite number > 0"):
        load_train_config(tmp_path, None, [f"learning_rate={rate}"])


@pytest.mark.parametrize(
    "setting, expected",
    [
        (
            "model_config.nope=3",
            "model_config ['nope'] not settings of the linear_transformer detector; known: [",
        ),
        (
            "model_config.num_features=5",
            "model_config ['num_features'] not settings of the linear_transformer detector (num_features: "
            "set from the dataset's features)",
        ),
        ("model_config=5", "model_config = 5 (a int), expected a mapping of the detector's settings"),
        ("model_config=[1]", "model_config = [1] (a list), expected a mapping"),
        (
            "model_config.dropout=[1]",
            "model_config: LinearTransformerConfig.dropout = [1]: expected a number",
        ),
        (
            "model_config.d_model=0",
            "model_config: LinearTransformerConfig.d_model = 0: expected an integer >= 1",
        ),
        ("train_period=2026-01-01", "train_period = 2026-01-01 (a date), expected START:END ISO dates"),
        ("test_period=7", "test_period = 7 (a int), expected START:END ISO dates"),
        ("out_dir=", "out_dir = null, expected a directory"),
        ("out_dir=[1]", "out_dir = [1] (a list), expected a directory"),
        ("experiment=", "experiment = null, expected a name"),
        ("experiment=[1]", "experiment = [1] (a list), expected a name"),
        ("registered_model=' '", "registered_model = ' ', expected a name"),
        # MLflow's registry refused these only when it registered the model, after the training.
        (
            "registered_model=bad/name",
            "registered_model = 'bad/name': Invalid model name 'bad/name'. Names cannot",
        ),
        ('registered_model="it\'s"', "registered_model = \"it's\": a registered model's name holds no quote"),
        (
            "experiment=" + "x" * 501,
            "experiment = '" + "x" * 501 + "': 'name' exceeds the maximum length of 500",
        ),
        ("progress_bar=maybe", "progress_bar = 'maybe', expected true or false"),
        ("accelerator=tpu", "accelerator = 'tpu', expected one of ('cpu', 'gpu', 'cuda')"),
        ("precision=8-bit", "precision = '8-bit', expected one of ("),
        ("num_workers=100000", "num_workers = 100000, expected at most"),
        ("seed=99999999999999999999", "seed = 99999999999999999999, expected at most 4,294,967,295"),
        ("chunk_events=1000000000", "chunk_events = 1000000000, expected at most 65,536"),
        ("batch_accounts=1000000000", "batch_accounts = 1000000000, expected at most 65,536"),
    ],
)
def test_a_setting_that_is_not_a_value_of_its_kind_is_refused_before_any_data_is_read(
    setting, expected, tmp_path
):
    # Each of these used to pass, then fail as a TypeError or AttributeError deep in training, or be ignored.
    with pytest.raises(ValueError, match=re.escape(f"train config: {expected}")):
        load_train_config(tmp_path, None, [setting])


def test_the_detector_settings_are_checked_against_the_detector_trained(tmp_path):
    # A hybrid's model_config is its base's; a per-event baseline has no detector config to check against.
    load_train_config(tmp_path, None, ["model_config.num_heads=2"], model="hybrid", hybrid_base="transformer")
    with pytest.raises(ValueError, match=r"not settings of the lstm detector"):
        load_train_config(tmp_path, None, ["model_config.num_heads=2"], model="hybrid", hybrid_base="lstm")
    load_train_config(tmp_path, None, ["model_config.d_model=16"], model="logreg")


def test_a_file_is_checked_as_the_flags_are(tmp_path):
    path = tmp_path / "profile.yaml"
    path.write_text("model_config: {nope: 1}\n")
    with pytest.raises(ValueError, match=r"model_config \['nope'\] not settings"):
        load_train_config(tmp_path, path)
    path.write_text("test_period: 2026-01-01\n")  # YAML reads it as a date
    with pytest.raises(ValueError, match=r"test_period = 2026-01-01 \(a date\), expected START:END"):
        load_train_config(tmp_path, path)


def test_the_dataset_is_given_by_data_alone_never_as_a_setting(tmp_path):
    # It was accepted and then ignored: the run trained on --data's dataset while the file named another.
    with pytest.raises(ValueError, match=r"--set data=/nonexistent: the dataset is given by --data DIR"):
        load_train_config(tmp_path, None, ["data=/nonexistent"])
    path = tmp_path / "profile.yaml"
    path.write_text("data: elsewhere\n")
    with pytest.raises(
        ValueError, match=r"train setting data in .*profile\.yaml: the dataset is given by --data"
    ):
        load_train_config(tmp_path, path)


def test_gpus_asked_for_that_the_machine_lacks_are_named_before_the_data_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_train_config(tmp_path / "never-read", accelerator="gpu", devices=2)
    with pytest.raises(
        ValueError, match=r"accelerator = 'gpu' with devices = 2, but this machine has 0 CUDA GPU"
    ):
        train(cfg)


@pytest.mark.parametrize(
    "setting", ["model_config.nope=3", "experiment=[1]", "accelerator=tpu", "registered_model=bad/name"]
)
def test_the_command_line_refuses_a_bad_setting_in_one_line_with_exit_code_2(setting, tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path), "--set", setting]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("txsentinel train: train config: ")


FOUR_WEEKS = Period.parse("2026-01-01:2026-01-29")  # the days of a dataset


@pytest.mark.parametrize(
    "settings, expected",
    [
        # Outside the data: the validation week held no events, and Lightning's early stopping failed on a
        # metric it never saw.
        (["test_period=2030-01-01:2030-01-03"], "test_period 2030-01-01:2030-01-03 is not inside the data"),
        (["train_period=2025-12-01:2026-01-10"], "train_period 2025-12-01:2026-01-10 is not inside the data"),
        (["test_days=21"], "the test period 2026-01-08:2026-01-29 with the delay before it leaves no days"),
        (["test_days=28"], "test period 2026-01-01:2026-01-29 leaves no days before it to train on"),
        (["test_days=40"], "test period 2025-12-20:2026-01-29 leaves no days before it to train on"),
        (["validation_days=7", "test_days=14"], "has 7 days, not more than validation_days = 7"),
    ],
)
def test_a_split_that_does_not_fit_the_data_names_the_data_span_and_the_settings_that_carve_it(
    settings, expected, tmp_path
):
    with pytest.raises(ValueError) as refused:
        resolve_split(load_train_config(tmp_path, None, settings), FOUR_WEEKS)
    message = str(refused.value)
    assert expected in message
    assert "The dataset spans 2026-01-01:2026-01-29 (28 days), carved by " in message
    assert "validation_days = " in message and "\n" not in message


def events_every_six_hours(period: Period, gap: Period | None = None) -> pl.DataFrame:
    ts = pl.datetime_range(period.start, period.end, "6h", closed="left", eager=True).alias("ts")
    frame = pl.DataFrame(ts)
    return frame if gap is None else frame.filter(~gap.contains())


EIGHT_WEEKS = Period.parse("2026-01-01:2026-02-26")  # 28 train (7 of them validation), 7 delay, 14 test


@pytest.mark.parametrize(
    "gap, model, settings, refused",
    [
        (
            "2026-01-28:2026-02-06",
            "lstm",
            [],
            "the validation period (the last validation_days = 7 of training)",
        ),
        (
            "2026-01-09:2026-01-19",
            "lstm",
            ["train_period=2026-01-10:2026-01-25", "test_period=2026-02-01:2026-02-08"],
            "the training period 2026-01-10:2026-01-18",
        ),
        ("2026-01-19:2026-01-28", "hist_gbdt", ["test_period=2026-01-20:2026-01-27"], "the test period"),
    ],
)
def test_a_period_in_a_gap_in_the_data_is_refused_naming_the_gap(gap, model, settings, refused, tmp_path):
    frame = events_every_six_hours(EIGHT_WEEKS, Period.parse(gap))
    with pytest.raises(ValueError) as error:
        split_dataset(load_train_config(tmp_path, None, settings, model=model), frame, model == "lstm")
    message = str(error.value)
    assert refused in message and "holds no events: the dataset has none from " in message, message
    assert "carved by " in message and "validation_days = 7" in message


def test_a_gap_outside_the_periods_used_is_no_error(tmp_path):
    # The per-event baselines train up to the delay: a validation week in a gap leaves them data.
    frame = events_every_six_hours(EIGHT_WEEKS, Period.parse("2026-01-28:2026-02-06"))
    split, _ = split_dataset(load_train_config(tmp_path, model="hist_gbdt"), frame, validated=False)
    assert str(split.train) == "2026-01-01:2026-02-05"


def test_the_settings_named_are_those_that_carved_the_split(tmp_path):
    with pytest.raises(ValueError, match=r"carved by test_days = 40, delay_days = 7, validation_days = 7:"):
        resolve_split(load_train_config(tmp_path, None, ["test_days=40"]), FOUR_WEEKS)
    periods = ["train_period=2026-01-01:2026-01-05", "test_period=2026-01-10:2026-01-12"]
    with pytest.raises(ValueError, match=r"carved by train_period = 2026-01-01:2026-01-05, test_period = "):
        resolve_split(load_train_config(tmp_path, None, periods), FOUR_WEEKS)
    five_weeks = Period.parse("2026-01-01:2026-02-05")  # 14 train (7 of them validation), 7 delay, 14 test
    split, validation = resolve_split(load_train_config(tmp_path), five_weeks)
    assert (str(split.train), str(validation), str(split.test)) == (
        "2026-01-01:2026-01-15",
        "2026-01-08:2026-01-15",
        "2026-01-22:2026-02-05",
    )
