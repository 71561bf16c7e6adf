"""The notebooks run end to end on a small generated dataset, in a real kernel, and fail on any error."""

import json
import os

import nbformat
import pytest
from nbclient import NotebookClient

from pipeline.bench.broker import REPO_ROOT

NOTEBOOKS = REPO_ROOT / "notebooks"


def run_notebook(name: str, parameters: str, workdir) -> nbformat.NotebookNode:
    book = nbformat.read(NOTEBOOKS / name, as_version=4)
    first_code = next(c for c in book.cells if c.cell_type == "code")
    assert first_code.source.startswith("# Parameters"), (
        f"{name}: the first code cell must hold the parameters"
    )
    first_code.source = parameters
    NotebookClient(
        book, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    ).execute()
    return book


def outputs(book: nbformat.NotebookNode) -> str:
    return json.dumps([c.get("outputs", []) for c in book.cells if c.cell_type == "code"])


@pytest.mark.slow
def test_backtest_then_comparison_notebooks_run_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("PYTHONPATH", f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    backtest = run_notebook(
        "backtest.ipynb",
        f'WORKDIR = "{tmp_path}"\nDATA_DIR = None\nMODEL_URI = None\nACCOUNTS, DAYS = 250, 45\nFOLDS = 2',
        tmp_path,
    )
    text = outputs(backtest)
    assert "cp_at_100" in text and "image/png" in text
    assert "reason 1" in text and "history" in text  # the alerted accounts' reasons
    assert (tmp_path / "backtest" / "backtest.json").exists()

    comparison = run_notebook(
        "model_comparison.ipynb",
        f'WORKDIR = "{tmp_path}"\nEXPERIMENT = "txsentinel"\nMETRIC = "test/ap"\nDATA_DIR = "{tmp_path / "data"}"',
        tmp_path,
    )
    text = outputs(comparison)
    assert "lstm" in text and "logreg" in text and "image/png" in text


def test_notebooks_are_committed_without_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        book = nbformat.read(path, as_version=4)
        for cell in book.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs committed"
