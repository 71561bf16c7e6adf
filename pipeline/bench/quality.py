"""`txsentinel bench quality`: every detector and baseline trained and tested on one dataset, one table.

Each model is trained by the same `train(cfg)` as `txsentinel train`, on the same split, and scored with the
published protocol (pipeline/evaluation/protocol.py): a 7-day test week after a 7-day delay. The sequence
detectors train with several seeds; `folds` > 1 repeats everything with the test week shifted back a week
at a time (prequential), and each cell is then the mean +- std over seeds and folds.

Columns: AUC, AP, CP@100 (published protocol), AP of each fraud scenario against all legit events, the drift
alert rate (share of a drifting, legit account's events in the top 1% of scores: lower is better) and the
training seconds. A last row, "perfect ranking", scores each event by its label: CP@100's ceiling on the same
weeks (fewer fraudulent cards a day than 100, and each caught once), against which a model's CP@100 reads.
The JSON written beside the table holds every run's metrics, and each week's ceiling.
"""

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import polars as pl

from pipeline.data.dataset import read_dataset, write_dataset
from pipeline.data.generate import FRAUD_SCENARIOS, generate
from pipeline.data.splits import DAY, Period, dataset_days, prequential_test_periods
from pipeline.data.world import GenerateConfig
from pipeline.evaluation.protocol import detection_metrics
from pipeline.training.baselines import BASELINES
from pipeline.training.config import SEQUENCE_MODELS, load_train_config
from pipeline.training.train import train

TEST_DAYS = 7  # the published protocol's test week
PERFECT = "perfect ranking"  # the table's row of the labels as scores
DEFAULT_BASELINES = ("logreg", "random_forest", "hist_gbdt")
# --quick: a dataset and a training profile small enough for CI (about a minute a model on 2 cores).
QUICK_DATA = GenerateConfig(accounts=300, days=50, seed=0)
QUICK_SET = ("model_config.d_model=16", "model_config.num_layers=1", "max_epochs=2", "chunk_events=32")

COLUMNS = (
    ("auc", "test/auc"),
    ("ap", "test/ap"),
    ("cp@100", "test/cp_at_100"),
    *((f"ap {s}", f"test/ap/{s}") for s in FRAUD_SCENARIOS),
    ("drift alert", "test/alert_rate_top1pct/drift"),
    ("train s", "train/seconds"),
)


@dataclass(frozen=True)
class QualityConfig:
    data: Path | None = None  # None: generate `generate` into out/data
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    models: tuple[str, ...] = (*SEQUENCE_MODELS, *DEFAULT_BASELINES)
    seeds: int = 3  # per sequence detector; the baselines train once a fold
    folds: int = 1
    train_config: Path | None = None  # a YAML training profile for every model
    overrides: tuple[str, ...] = ()  # `--set key=value` for every model
    out: Path = Path("runs/bench-quality")

    def __post_init__(self):
        unknown = sorted(set(self.models) - set(SEQUENCE_MODELS) - set(BASELINES))
        if unknown:
            raise ValueError(
                f"bench quality: unknown model(s) {unknown}; choose from {SEQUENCE_MODELS + BASELINES}"
            )
        if self.seeds < 1 or self.folds < 1:
            raise ValueError(f"bench quality: seeds = {self.seeds}, folds = {self.folds}; both must be >= 1")

    @classmethod
    def quick(cls, **overrides) -> "QualityConfig":
        """The CI-sized run: a small dataset, small detectors, one seed."""
        values = {"generate": QUICK_DATA, "seeds": 1, "overrides": QUICK_SET, **overrides}
        return cls(**values)


@dataclass(frozen=True)
class Run:
    model: str
    seed: int
    fold: int
    test_period: str
    metrics: dict[str, float]


def prequential_weeks(data_days: Period, folds: int) -> list[Period]:
    """The last full week of the data, then each earlier week: the prequential folds, most recent first."""
    return prequential_test_periods(Period(data_days.end - TEST_DAYS * DAY, data_days.end), folds, data_days)


def run_quality(cfg: QualityConfig) -> tuple[pl.DataFrame, list[Run]]:
    """Train and test every model on every fold (and seed); returns the table and every run."""
    data = cfg.data
    if data is None:
        data = cfg.out / "data"
        write_dataset(generate(cfg.generate), data, source={"generator": "txsentinel bench quality"})
    frame = read_dataset(data)
    weeks = prequential_weeks(dataset_days(frame), cfg.folds)
    runs = []
    for fold, week in enumerate(weeks):
        for model in cfg.models:
            for seed in range(cfg.seeds if model in SEQUENCE_MODELS else 1):
                started = time.perf_counter()
                train_cfg = load_train_config(
                    data,
                    cfg.train_config,
                    [f"test_days={TEST_DAYS}", *cfg.overrides],
                    model=model,
                    seed=seed,
                    test_period=week,
                    out_dir=cfg.out / "train",
                    progress_bar=False,
                )
                result = train(train_cfg)
                metrics = dict(result.metrics)
                metrics.setdefault("train/seconds", time.perf_counter() - started)
                runs.append(Run(model, seed, fold, str(week), metrics))
    ceilings = [perfect_ranking(frame, week, fold) for fold, week in enumerate(weeks)]
    table = quality_table(runs + ceilings, (*cfg.models, PERFECT))
    saved = {"config": _jsonable(cfg), "runs": [asdict(r) for r in runs]}
    saved["ceilings"] = [asdict(r) for r in ceilings]
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "quality.json").write_text(json.dumps(saved, indent=2) + "\n")
    return table, runs


def perfect_ranking(frame: pl.DataFrame, week: Period, fold: int) -> Run:
    """The labels as scores on one test week: the ceiling of CP@100 under the published protocol's
    exclusions (AUC and AP are 1 by construction, and left out)."""
    scored = frame.select("account_id", "ts", "is_fraud", score=pl.col("is_fraud").cast(pl.Float64))
    ceiling = detection_metrics(scored, frame, week).cp_at_k
    return Run(PERFECT, 0, fold, str(week), {"test/cp_at_100": ceiling})


def quality_table(runs: list[Run], models: tuple[str, ...]) -> pl.DataFrame:
    """One row per model: each column's mean over its runs, "+-std" when there is more than one run."""
    rows = []
    for model in models:
        mine = [r for r in runs if r.model == model]
        row = {"model": model, "runs": len(mine)}
        for column, key in COLUMNS:
            values = [r.metrics[key] for r in mine if not math.isnan(r.metrics.get(key, math.nan))]
            row[column] = _cell(values, digits=0 if key == "train/seconds" else 3)
        rows.append(row)
    return pl.DataFrame(rows)


def _cell(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    mean = f"{statistics.fmean(values):.{digits}f}"
    return mean if len(values) == 1 else f"{mean} +-{statistics.stdev(values):.{digits}f}"


def _jsonable(cfg: QualityConfig) -> dict:
    return json.loads(json.dumps(asdict(cfg), default=str))


def print_table(table: pl.DataFrame, cfg: QualityConfig) -> None:
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_hide_dataframe_shape=True, tbl_width_chars=250):
        print(table)
    print(
        f"published protocol, {TEST_DAYS}-day test week(s), {cfg.folds} fold(s); runs in {cfg.out / 'quality.json'}"
    )
