"""Plain functions behind the data commands: each does the work, prints what a person wants to see, and
returns what a test wants to check."""

import time
from pathlib import Path

import polars as pl

from pipeline.data.dataset import DatasetSummary, read_dataset, write_dataset
from pipeline.data.generate import GenerateConfig, generate, scenario_summary
from pipeline.features import FEATURE_NAMES, compute_features


def _table(frame: pl.DataFrame) -> str:
    with pl.Config(
        tbl_rows=-1, tbl_cols=-1, tbl_hide_dataframe_shape=True, tbl_width_chars=140, fmt_str_lengths=40
    ):
        return str(frame)


def run_generate(cfg: GenerateConfig, out: Path) -> DatasetSummary:
    started = time.perf_counter()
    frame = generate(cfg)
    if frame.is_empty():
        raise ValueError(
            f"these settings made no transactions (accounts={cfg.accounts}, terminals={cfg.n_terminals}, "
            f"radius={cfg.radius}, days={cfg.days}): an account transacts only at terminals within radius of "
            f"its home. Raise radius, terminals, accounts or days; nothing was written to {out}"
        )
    summary = write_dataset(frame, out, source={"generator": "txsentinel generate", "config": cfg.__dict__})
    elapsed = time.perf_counter() - started
    print(
        f"wrote {out}: {summary.transactions:,} transactions, {summary.accounts:,} accounts, "
        f"{summary.terminals:,} terminals, {summary.first_ts:%Y-%m-%d} .. {summary.last_ts:%Y-%m-%d} "
        f"in {elapsed:.1f} s"
    )
    print(
        _table(
            scenario_summary(frame)
            .with_columns(
                (pl.col("share") * 100).round(3).alias("share_%"),
                (pl.col("fraud_share") * 100).round(3).alias("fraud_%"),
            )
            .drop("share", "fraud_share")
        )
    )
    return summary


def summarize_features(features: pl.DataFrame) -> pl.DataFrame:
    """One row per feature: mean, std, min, max, and mean among fraud vs legit events when labelled."""
    rows = []
    labelled = "is_fraud" in features.columns
    for name in FEATURE_NAMES:
        column = features[name]
        row = {
            "feature": name,
            "mean": column.mean(),
            "std": column.std(),
            "min": column.min(),
            "max": column.max(),
        }
        if labelled:
            row["mean_fraud"] = features.filter(pl.col("is_fraud"))[name].mean()
            row["mean_legit"] = features.filter(~pl.col("is_fraud"))[name].mean()
        rows.append(row)
    return pl.DataFrame(rows).with_columns(pl.selectors.float().round(4))


def run_features(data: Path, out: Path | None) -> pl.DataFrame:
    frame = read_dataset(data)
    started = time.perf_counter()
    features = compute_features(frame)
    elapsed = time.perf_counter() - started
    print(
        f"{features.height:,} events x {len(FEATURE_NAMES)} features (+ terminal bucket) "
        f"in {elapsed:.2f} s ({features.height / max(elapsed, 1e-9):,.0f} events/s)"
    )
    print(_table(summarize_features(features)))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        features.write_parquet(out)
        print(f"wrote {out}")
    return features
