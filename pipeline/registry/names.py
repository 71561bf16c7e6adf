"""Names the MLflow registry takes, checked before any work: MLflow itself checks a registered model's name
only when it registers the model, after the training."""

from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.utils.validation import _validate_experiment_name, _validate_model_name


def registered_name_problem(name: str) -> str | None:
    """What the registry would refuse in a registered model's name, or None: MLflow's own check (the one its
    SQL stores and tracking server apply), and a quote, which promote's search filter cannot hold."""
    if "'" in name:
        return "a registered model's name holds no quote (')"
    return _mlflow_refusal(_validate_model_name, name)


def experiment_name_problem(name: str) -> str | None:
    """What MLflow would refuse in an experiment's name (its own check), or None."""
    return _mlflow_refusal(_validate_experiment_name, name)


def _mlflow_refusal(check: Any, name: str) -> str | None:
    # MLflow's checks are private functions; tests/pipeline/registry/test_tracking.py holds them to their rules.
    try:
        check(name)
    except MlflowException as error:
        return error.message.splitlines()[0].strip().rstrip(".")
    return None
