"""`txsentinel bench restore` at a small size on the project's broker: one row per detector and scale, every
account restored, and configurations it cannot run refused with what to change."""

import os
import subprocess
import sys

import pytest

from pipeline.bench.broker import REPO_ROOT
from pipeline.bench.restore import RestoreBenchConfig


def test_scales_that_cut_a_partition_or_exceed_the_accounts_are_refused():
    assert RestoreBenchConfig().unit == 100_000
    with pytest.raises(ValueError, match=r"refused: \[5000\]"):
        RestoreBenchConfig(accounts=3000, scales=(1000, 5000))
    with pytest.raises(ValueError, match="at most 100 partitions"):
        RestoreBenchConfig(accounts=10_001, scales=(10_000,))


@pytest.mark.slow
def test_the_bench_restores_every_account_of_each_scale(kafka_bootstrap):
    argv = ["bench", "restore", "lstm", "--accounts", "3000", "--scales", "1000", "3000"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TXS_KAFKA_PORT": kafka_bootstrap.rsplit(":", 1)[1]}
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout.split("detector ")[-1]  # each row is printed as it comes, then the table
    rows = [line.split() for line in table.splitlines() if line.startswith("lstm ")]
    assert [(row[1], row[2]) for row in rows] == [("1,000", "1,802"), ("3,000", "1,802")], done.stdout
    assert all(float(row[3]) > 0 for row in rows) and "target: <= 60 s" in done.stdout
