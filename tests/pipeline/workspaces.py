"""Set-up that the batch-side tests share: a generated dataset with fraud well above the defaults (so a few
test days of a small history hold every scenario), a fresh SQLite MLflow store to log into, and a process that
can only read a directory."""

import os
import shlex
import shutil
import subprocess
import sys
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


def run_read_only(directory: Path, code: str) -> subprocess.CompletedProcess:
    """Runs Python `code` in a process that cannot write in `directory`: chmod for a user; for root, whom
    permission bits do not stop, a read-only bind mount in a mount namespace of its own."""
    python = [sys.executable, "-c", code]
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            return subprocess.run(python, capture_output=True, text=True, timeout=300)
        finally:
            directory.chmod(0o755)
    where = shlex.quote(str(directory))
    mount = f"mount --bind {where} {where} && mount -o remount,ro,bind {where} {where}"
    if not shutil.which("unshare") or subprocess.run(["unshare", "-m", "sh", "-c", mount]).returncode != 0:
        pytest.skip("root is refused a write only on a read-only mount, and this machine lets it make none")
    command = ["unshare", "-m", "sh", "-c", f'{mount} && exec "$@"', "sh", *python]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)
