"""The tracking store as several jobs meet it: opened by processes that start together."""

import subprocess
import sys

from mlflow.tracking import MlflowClient

OPEN_STORE = """
from pipeline.registry.tracking import configure_tracking
configure_tracking()
import mlflow
mlflow.set_experiment("opened-together")
"""


def test_jobs_that_open_a_new_sqlite_store_together_all_succeed_and_leave_it_usable(tmp_path):
    # Unguarded, MLflow's first-use migration races: every process failed and the store stayed broken.
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PATH": "/usr/bin:/bin"}
    jobs = [
        subprocess.Popen([sys.executable, "-c", OPEN_STORE], env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    failures = [err for job in jobs if (err := job.communicate(timeout=300)[1]) and job.returncode != 0]
    assert not failures, failures[0][-2000:]
    names = [e.name for e in MlflowClient(env["MLFLOW_TRACKING_URI"]).search_experiments()]
    assert sorted(names) == ["Default", "opened-together"]  # the store opens afterwards, each created once
