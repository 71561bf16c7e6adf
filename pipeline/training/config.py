"""What a training run needs to know, as one frozen dataclass; YAML files and `--set` overrides fill it.

Precedence: dataclass defaults < `--config FILE` (YAML) < `--set key=value` (dotted keys reach into
`model_config`, e.g. `--set model_config.d_model=32`). The detector's own config travels with its weights;
this file is about the run.
"""

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

import configs
from models.checks import is_finite_number, is_integer, read_number, read_setting, read_yaml_file
from models.registry import REGISTRY, config_class
from pipeline.data.splits import DAY, Period, Split, dataset_days
from pipeline.evaluation.protocol import MAX_K
from pipeline.registry.names import experiment_name_problem, registered_name_problem

SEQUENCE_MODELS = ("lstm", "transformer", "linear_transformer", "hybrid")

PROFILES_DIR = configs.packaged("train")  # inside the installed package, the repository's configs/train here
QUICK_PROFILE = PROFILES_DIR / "quick.yaml"  # a quick CPU run: the demo's and the notebooks' training


@dataclass(frozen=True)
class TrainConfig:
    data: Path
    model: str = "linear_transformer"
    model_config: dict[str, Any] = field(default_factory=dict)  # overrides of the detector's config
    hybrid_base: str = "linear_transformer"  # `model: hybrid`: the sequence detector under its trees

    # Periods: explicit, or the last `test_days` of the data for test, `delay_days` before it unused, and
    # (up to `train_days` of) everything before that for training, its last `validation_days` for validation.
    train_period: Period | None = None
    test_period: Period | None = None
    delay_days: int = 7
    test_days: int = 14
    train_days: int | None = None
    validation_days: int = 7

    # Truncated back-propagation through time: accounts are cut in chunks of this many events, the state
    # carried (detached) from one chunk to the next.
    chunk_events: int = 64
    # 16: four times the optimizer steps of 64 in the same epochs. At the Handbook's scale, over three seeds,
    # 32 rather than 64 lifted the test AP by 0.007 for the linear Transformer, 0.004 for the softmax one and
    # 0.002 for the LSTM, and 16 rather than 32 by 0.005, 0.005 and 0.006 (docs/benchmarks.md, "Detection
    # quality"). On a GPU, where a step of 256 accounts costs about what one of 16 does, use more.
    batch_accounts: int = 16
    max_epochs: int = 8
    learning_rate: float | None = None  # None: the detector's own, default_learning_rate
    weight_decay: float = 0.01
    warmup_steps: int = 30
    gradient_clip: float = 1.0
    pos_weight: float | None = None  # None: sqrt(legit / fraud) over the training targets
    early_stopping_patience: int = 3
    # Epochs of self-supervised next-event prediction over every event before the validation week, labels
    # unused, before the fraud objective (pipeline/training/pretraining.py); 0: none.
    pretrain_epochs: int = 0

    accelerator: str = "cpu"
    devices: int = 1  # per machine; more than one in all (devices x num_nodes) trains with DDP
    num_nodes: int = 1  # machines, each running the same command with its own NODE_RANK
    precision: str | None = None  # None: bf16-mixed on GPU, 32-true on CPU
    num_workers: int = 0
    seed: int = 0

    cp_k: int = 100
    alert_budget_per_day: float = 50.0  # the alert threshold is chosen to raise this many alerts a day
    experiment: str = "txsentinel"
    registered_model: str = "txsentinel"
    out_dir: Path = Path("runs/train")
    progress_bar: bool = True

    def __post_init__(self):
        _check_kinds(self)
        for name, minimum in _INTEGER_MINIMUMS.items():
            if not (name in _OPTIONAL and getattr(self, name) is None):
                _check_integer(name, getattr(self, name), minimum)
        for name, most, why in _INTEGER_MAXIMUMS:
            if getattr(self, name) > most:
                raise ValueError(
                    f"train config: {name} = {getattr(self, name)}, expected at most {most:,} ({why})"
                )
        if self.num_workers > CPUS:  # each worker is a process holding a copy of the batches
            raise ValueError(
                f"train config: num_workers = {self.num_workers}, expected at most {CPUS} (this machine's CPUs)"
            )
        _check_model_config(self)
        if self.hybrid_base not in SEQUENCE_MODELS or self.hybrid_base == "hybrid":
            bases = [m for m in SEQUENCE_MODELS if m != "hybrid"]
            raise ValueError(f"train config: hybrid_base = {self.hybrid_base!r}, expected one of {bases}")
        if self.learning_rate is None:  # frozen: resolved once, so the run logs the rate it trained at
            rate = default_learning_rate(self.trained_detector, self.batch_accounts * self.ranks)
            object.__setattr__(self, "learning_rate", rate)
        for name, (bound, inclusive) in _NUMBER_BOUNDS.items():
            if not (name in _OPTIONAL and getattr(self, name) is None):
                _check_number(name, getattr(self, name), bound, inclusive)

    @property
    def ranks(self) -> int:
        """Training processes in all (devices x num_nodes): more than one trains with DDP, each optimizer step
        then seeing batch_accounts accounts from every rank."""
        return self.devices * self.num_nodes

    @property
    def trained_detector(self) -> str:
        """The detector Lightning trains: the model itself, or under a hybrid its base (its trees come after)."""
        return self.hybrid_base if self.model == "hybrid" else self.model


def default_learning_rate(detector: str, accounts_per_step: int) -> float:
    """The AdamW learning rate `detector` trains at unless one is given: the best measured at the Handbook's
    scale for the accounts an optimizer step sees, over every DDP rank (test AP; docs/benchmarks.md, "Detection
    quality"). A hybrid's base trains at its own.
    """
    if detector == "transformer":
        # At 32 accounts a batch 0.786 against 0.780 at 2e-3 (three seeds); at 16, seeds 0 and 1: 0.792 against
        # 0.786 at 5e-4.
        return 1e-3
    if detector == "linear_transformer" and accounts_per_step < 32:
        # At 16 accounts a batch 0.794 against 0.791 at 2e-3 (three seeds); at 32 and above 2e-3 (seed 0 at 32:
        # 0.793 against 0.785 at 1e-3).
        return 1e-3
    return 2e-3  # the LSTM at 16 accounts a batch: 0.796 against 0.791 at 1e-3 (three seeds)


# The least value each integer setting takes (a bool is refused: YAML reads `yes` as True, which is 1).
_INTEGER_MINIMUMS = {
    **dict.fromkeys(("chunk_events", "batch_accounts", "max_epochs", "test_days", "validation_days"), 1),
    **dict.fromkeys(("cp_k", "devices", "num_nodes", "train_days"), 1),
    **dict.fromkeys(("delay_days", "warmup_steps", "early_stopping_patience", "pretrain_epochs"), 0),
    **dict.fromkeys(("num_workers", "seed"), 0),
}
# The most some integer settings take: beyond, they fail late, deep in numpy or torch, naming nothing.
_INTEGER_MAXIMUMS = (
    ("seed", 2**32 - 1, "numpy's and torch's seeds"),
    ("chunk_events", 65_536, "a chunk is a [accounts, events, features] tensor"),
    ("batch_accounts", 65_536, "a batch is a [accounts, events, features] tensor"),
    ("cp_k", MAX_K, "accounts a day"),
)
# Each number setting's bound, and whether the bound itself is allowed (gradient_clip 0: no clipping).
_NUMBER_BOUNDS = {
    "learning_rate": (0.0, False),
    "pos_weight": (0.0, False),
    "alert_budget_per_day": (0.0, False),
    "weight_decay": (0.0, True),
    "gradient_clip": (0.0, True),
}
_OPTIONAL = {"train_days", "pos_weight"}  # None: derived from the data (see the fields' comments)


ACCELERATORS = ("cpu", "gpu", "cuda")
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true")  # Lightning's names
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
PERIOD_EXAMPLE = "START:END ISO dates, end exclusive, e.g. 2026-03-01:2026-03-15"
# What moves the test period: for a line that asks for another one.
TEST_PERIOD_SETTINGS = "--test-period, --set test_days=N"
# The detector config's fields that the dataset's features set: a value given for them would not fit the data.
FROM_THE_FEATURES = ("num_features", "terminal_buckets")


def _check_kinds(cfg: TrainConfig) -> None:
    """Each setting that is not a number holds a value of its kind (the numbers: _INTEGER_MINIMUMS and
    _NUMBER_BOUNDS). YAML gives whatever it reads: `test_period: 2026-01-01` a date, `experiment:` null."""
    for name in ("train_period", "test_period"):
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, Period):
            raise ValueError(f"train config: {name} = {_shown(value)}, expected {PERIOD_EXAMPLE}")
    for name in ("model", "hybrid_base", "experiment", "registered_model"):
        value = getattr(cfg, name)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"train config: {name} = {_shown(value)}, expected a name")
    # MLflow's rules, checked now: MLflow itself checks the name when it registers the model, after the training.
    for name, problem in (
        ("experiment", experiment_name_problem),
        ("registered_model", registered_name_problem),
    ):
        if why := problem(getattr(cfg, name)):
            raise ValueError(f"train config: {name} = {_shown(getattr(cfg, name))}: {why}")
    if cfg.accelerator not in ACCELERATORS:
        raise ValueError(
            f"train config: accelerator = {_shown(cfg.accelerator)}, expected one of {ACCELERATORS}"
        )
    if cfg.precision is not None and cfg.precision not in PRECISIONS:
        raise ValueError(
            f"train config: precision = {_shown(cfg.precision)}, expected one of {PRECISIONS} or null "
            "(bf16-mixed on GPU, 32-true on CPU)"
        )
    if not isinstance(cfg.progress_bar, bool):
        raise ValueError(f"train config: progress_bar = {_shown(cfg.progress_bar)}, expected true or false")
    if not isinstance(cfg.out_dir, Path):
        raise ValueError(f"train config: out_dir = {_shown(cfg.out_dir)}, expected a directory")
    if not isinstance(cfg.model_config, dict) or not all(isinstance(key, str) for key in cfg.model_config):
        raise ValueError(
            f"train config: model_config = {_shown(cfg.model_config)}, expected a mapping of the detector's "
            "settings, e.g. --set model_config.d_model=32"
        )


def _check_model_config(cfg: TrainConfig) -> None:
    """model_config names fields of the detector trained, with values it takes: refused now, not as a
    TypeError once the data is read. (The per-event baselines have no detector config to check against.)"""
    if cfg.trained_detector not in REGISTRY:
        return
    config_type = config_class(cfg.trained_detector)
    known = sorted({f.name for f in dataclasses.fields(config_type)} - set(FROM_THE_FEATURES))
    unknown = sorted(set(cfg.model_config) - set(known))
    if unknown:
        features = [key for key in unknown if key in FROM_THE_FEATURES]
        because = f" ({', '.join(features)}: set from the dataset's features)" if features else ""
        raise ValueError(
            f"train config: model_config {unknown} not settings of the {cfg.trained_detector} detector"
            f"{because}; known: {known}"
        )
    try:
        config_type(**{**config_type().to_dict(), **cfg.model_config})
    except ValueError as error:
        raise ValueError(f"train config: model_config: {error}") from None


def _shown(value: Any) -> str:
    """A value as the operator wrote it (a YAML date as 2026-01-01, not datetime.date(2026, 1, 1)), with its
    kind when it is not text."""
    if value is None:
        return "null"
    return repr(value) if isinstance(value, str) else f"{value} (a {type(value).__name__})"


def _check_integer(name: str, value: Any, minimum: int) -> None:
    if not is_integer(value) or value < minimum:
        raise ValueError(f"train config: {name} = {value!r}, expected an integer >= {minimum}")


def _check_number(name: str, value: Any, bound: float, inclusive: bool) -> None:
    if not (is_finite_number(value) and (value >= bound if inclusive else value > bound)):
        expected = f"{'>=' if inclusive else '>'} {bound:g}"
        raise ValueError(f"train config: {name} = {value!r}, expected a finite number {expected}")


def _coerce(name: str, value: Any) -> Any:
    if name in ("data", "out_dir") and isinstance(value, str | os.PathLike) and str(value).strip():
        return Path(value)  # anything else is refused by name (_check_kinds)
    if name in ("train_period", "test_period") and isinstance(value, str):
        return Period.parse(value)
    if name in _FLOAT_SETTINGS and isinstance(value, str):
        return _as_float(f"train setting {name}", value)
    return value


def _as_float(what: str, value: str) -> float:
    """A number written as text (models.checks.read_number), or a ValueError naming the setting."""
    number = read_number(value)
    if isinstance(number, str):
        raise ValueError(f"{what} = {value!r}: expected a number, e.g. 0.0005 or 5e-4")
    return number


_FLOAT_SETTINGS = {f.name for f in dataclasses.fields(TrainConfig) if f.type in (float, float | None)}


def _set_dotted(values: dict[str, Any], key: str, value: Any) -> None:
    head, _, rest = key.partition(".")
    if rest:
        if head != "model_config":
            raise ValueError(f"--set {key}: only model_config.<field> takes a dotted key")
        values.setdefault("model_config", {})
        values["model_config"] = {**values["model_config"], rest: value}
    else:
        values[head] = value


def _refuse_data(values: dict[str, Any], where: str) -> None:
    # The dataset is --data's alone: a second one given here was ignored.
    if "data" in values:
        raise ValueError(f"{where}: the dataset is given by --data DIR, not as a setting")


def load_train_config(
    data: Path, config_file: Path | None = None, overrides: list[str] = (), **explicit: Any
) -> TrainConfig:
    """Defaults < YAML file < explicit keyword arguments (CLI flags) < `key=value` overrides."""
    values: dict[str, Any] = {}
    given_by: dict[str, str] = {}  # each top-level setting: where it was given last, for an error about it
    where = f" in {config_file}" if config_file else ""
    if config_file is not None:
        values.update(read_yaml_file(config_file, "train settings"))
        given_by |= dict.fromkeys(values, str(config_file))
        _refuse_data(values, f"train setting data{where}")
    values.update({k: v for k, v in explicit.items() if v is not None})
    for item in overrides:
        key, value = read_setting(item, "max_epochs=3")
        _set_dotted(values, key, value)
        given_by[key.split(".", 1)[0]] = f"--set {item}"
        _refuse_data(values, f"--set {item}")
    known = {f.name for f in dataclasses.fields(TrainConfig)} - {"data"}
    unknown = sorted(set(values) - known)
    if unknown:
        given = "; ".join(f"{key!r} from {given_by.get(key, 'the command line')}" for key in unknown)
        raise ValueError(f"unknown train setting(s) {unknown} ({given}); known: {sorted(known)}")
    values["data"] = data
    return TrainConfig(**{k: _coerce(k, v) for k, v in values.items()})


def flatten(cfg: TrainConfig, detector_config: dict[str, Any] | None = None) -> dict[str, str]:
    """MLflow params: every setting as a string, the detector's config under `model.`."""
    out = {}
    for f in dataclasses.fields(cfg):
        if f.name == "model_config":
            continue
        out[f.name] = str(getattr(cfg, f.name))
    for key, value in (detector_config or cfg.model_config).items():
        out[f"model.{key}"] = str(value)
    return out


@dataclass(frozen=True)
class TrainResult:
    run_id: str
    model: str
    model_uri: str
    version: int
    metrics: dict[str, float] = field(default_factory=dict)


def resolve_split(cfg: TrainConfig, days: Period) -> tuple[Split, Period]:
    """(train / delay / test split, validation period = the last validation_days of training) over `days`, the
    dataset's. A split that does not fit the data is refused naming the data's span and the settings that
    carve it."""
    try:
        return _carve(cfg, days)
    except ValueError as error:
        raise ValueError(
            f"{error}. The dataset spans {days} ({days.days} days), carved by {_carving(cfg)}: give more data, "
            "or change those settings (--set test_days=N, --train-period, --test-period)"
        ) from None


def split_dataset(cfg: TrainConfig, frame: pl.DataFrame, validated: bool = True) -> tuple[Split, Period]:
    """resolve_split over the dataset's days, refusing a period that holds none of its events (it falls in a
    gap in the data) before anything trains on it. `validated`: training stops where validation starts (the
    detectors); otherwise it runs to the delay (the per-event baselines)."""
    days = dataset_days(frame)
    split, validation = resolve_split(cfg, days)
    periods = {"training period": split.train, "test period": split.test}
    if validated:
        periods = {
            "training period": Period(split.train.start, validation.start),
            f"validation period (the last validation_days = {cfg.validation_days} of training)": validation,
            "test period": split.test,
        }
    ts = frame.lazy().select("ts")
    for name, period in periods.items():
        if ts.filter(period.contains()).select(pl.len()).collect().item():
            continue
        before = ts.filter(pl.col("ts") < period.start).select(pl.col("ts").max()).collect().item()
        after = ts.filter(pl.col("ts") >= period.end).select(pl.col("ts").min()).collect().item()
        gap = f"from {before:%Y-%m-%d %H:%M} to {after:%Y-%m-%d %H:%M}" if before and after else "there"
        raise ValueError(
            f"the {name} {period} holds no events: the dataset has none {gap}. The dataset spans {days}, "
            f"carved by {_carving(cfg)}: move the periods off the gap (--train-period, --test-period) or "
            "change those settings"
        )
    return split, validation


def _carve(cfg: TrainConfig, days: Period) -> tuple[Split, Period]:
    for name in ("train_period", "test_period"):
        period = getattr(cfg, name)
        if period is not None and (period.start < days.start or period.end > days.end):
            raise ValueError(f"{name} {period} is not inside the data")
    if cfg.test_period is not None and cfg.train_period is not None:
        split = Split.from_periods(cfg.train_period, cfg.test_period)
    else:
        test = cfg.test_period or Period(days.end - cfg.test_days * DAY, days.end)
        if test.start <= days.start:
            raise ValueError(f"test period {test} leaves no days before it to train on")
        train_end = test.start - cfg.delay_days * DAY
        if cfg.train_period is None and train_end <= days.start:
            raise ValueError(
                f"the test period {test} with the delay before it leaves no days to train on (training would "
                f"end {train_end.date()})"
            )
        train_start = (
            days.start if cfg.train_days is None else max(days.start, train_end - cfg.train_days * DAY)
        )
        split = Split.from_periods(cfg.train_period or Period(train_start, train_end), test)
    if split.train.days <= cfg.validation_days:
        raise ValueError(
            f"training period {split.train} has {split.train.days} days, not more than validation_days = "
            f"{cfg.validation_days}"
        )
    validation = Period(split.train.end - cfg.validation_days * DAY, split.train.end)
    return split, validation


def _carving(cfg: TrainConfig) -> str:
    """The settings that carve a dataset into train / delay / test, as they stand."""
    given = [
        f"{name} = {getattr(cfg, name)}" for name in ("train_period", "test_period") if getattr(cfg, name)
    ]
    if cfg.train_period is None or cfg.test_period is None:
        counts = ["test_days", "delay_days"] if cfg.test_period is None else ["delay_days"]
        counts += ["train_days"] if cfg.train_period is None and cfg.train_days is not None else []
        given += [f"{name} = {getattr(cfg, name)}" for name in counts]
    return ", ".join([*given, f"validation_days = {cfg.validation_days}"])
