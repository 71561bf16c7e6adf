"""What the notebooks need when they are not handed a dataset or a model: make small ones, the library way.

MLflow goes wherever `MLFLOW_TRACKING_URI` points (default `sqlite:///mlflow.db` in the working directory).
"""

from pathlib import Path

from pipeline.cli.commands import run_generate
from pipeline.data.dataset import TRANSACTIONS_FILE
from pipeline.data.generate import GenerateConfig
from pipeline.training.config import QUICK_PROFILE, load_train_config

# On top of the quick CPU profile: shorter still, and no progress bars in the cells' output.
NOTEBOOK_RUN = ["max_epochs=2", "progress_bar=false"]


def ensure_dataset(
    data_dir: str | Path | None, workdir: Path, accounts: int, days: int, seed: int = 7
) -> Path:
    """`data_dir` if given; else a generated dataset under `workdir` (made once, reused after)."""
    if data_dir is not None:
        return Path(data_dir)
    path = workdir / "data"
    if not (path / TRANSACTIONS_FILE).exists():
        run_generate(GenerateConfig(accounts=accounts, days=days, seed=seed), path)
    return path


def ensure_model(model_uri: str | None, data_dir: Path, workdir: Path) -> str:
    """`model_uri` if given; else train an LSTM on the quick CPU profile (and a logistic-regression baseline
    beside it, so the comparison notebook has something to compare) and return the LSTM's runs:/ URI."""
    if model_uri is not None:
        return model_uri
    # Only here, where a model must be trained: a notebook handed a model never needs Lightning, whose import
    # adds about half again to what the backtest notebook imports anyway (measured with -X importtime).
    from pipeline.training.train import train

    train(load_train_config(data_dir, None, NOTEBOOK_RUN, model="logreg", out_dir=workdir / "train"))
    result = train(
        load_train_config(data_dir, QUICK_PROFILE, NOTEBOOK_RUN, model="lstm", out_dir=workdir / "train")
    )
    return f"runs:/{result.run_id}/model"
