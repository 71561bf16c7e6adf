"""Set-up that the batch-side tests share: a generated dataset with fraud well above the defaults (so a few
test days of a small history hold every scenario) and a fresh SQLite MLflow store to log into."""

from pathlib import Path

import polars as pl
import pytest

from pipeline.cli.commands import run_generate
from pipeline.data.dataset import read_dataset
from pipeline.data.generate import GenerateConfig
from pipeline.registry.tracking import configure_tracking

# Fraud per day well above the defaults; a test lowers a rate by passing it to busy_dataset.
BUSY_RATES = {
    "compromised_accounts_per_day": 40.0,
    "card_testing_accounts_per_day": 20.0,
    "takeover_accounts_per_day": 10.0,
    "compromised_terminals_per_day": 10.0,
}


def busy_dataset(out: Path, accounts: int, days: int, seed: int, **rates: float) -> pl.DataFrame:
    """Generates the dataset into `out` as `txsentinel generate` writes it and returns it as read back."""
    run_generate(GenerateConfig(accounts=accounts, days=days, seed=seed, **{**BUSY_RATES, **rates}), out)
    return read_dataset(out)


def use_fresh_store(patch: pytest.MonkeyPatch, folder: Path) -> Path:
    """Points MLflow at a new SQLite store in `folder`, run from `folder` (MLflow's default artifact root
    is relative to the working directory); undone with `patch`."""
    patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{folder / 'mlflow.db'}")
    patch.chdir(folder)
    configure_tracking()  # an earlier test's set_tracking_uri would otherwise win over the variable
    return folder
