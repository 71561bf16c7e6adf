"""Names the MLflow registry takes, checked before any work: MLflow itself checks a registered model's name
only when it registers the model, after the training.

MLflow's own checks are private functions, imported where they run rather than at the top: a renamed one falls
back to the rules MLflow documents (held to what a real store accepts by tests/pipeline/registry/
test_tracking.py) instead of breaking the import of the train config and the service, and the train config
does not wait seconds for MLflow when it is only read.
"""

import posixpath
from collections.abc import Callable

from pipeline.data.error_text import first_line

MAX_EXPERIMENT_NAME_CHARS = 500  # MLflow's MAX_EXPERIMENT_NAME_LENGTH


def registered_name_problem(name: str) -> str | None:
    """What the registry would refuse in a registered model's name, or None: MLflow's own check (the one its
    SQL stores and tracking server apply), and a quote, which promote's search filter cannot hold."""
    if "'" in name:
        return "a registered model's name holds no quote (')"
    return _mlflow_refusal("_validate_model_name", _model_name_rule, name)


def experiment_name_problem(name: str) -> str | None:
    """What MLflow would refuse in an experiment's name (its own check), or None."""
    return _mlflow_refusal("_validate_experiment_name", _experiment_name_rule, name)


def _mlflow_refusal(check_name: str, rule: Callable[[str], str | None], name: str) -> str | None:
    from mlflow.exceptions import MlflowException
    from mlflow.utils import validation

    check = getattr(validation, check_name, None)
    if check is None:  # renamed in this MLflow version
        return rule(name)
    try:
        check(name)
    except MlflowException as error:
        return first_line(error.message)
    return None


def _model_name_rule(name: str) -> str | None:
    if not name.strip():
        return "a registered model's name is not blank"
    if "/" in name or ":" in name:
        return f"Invalid model name {name!r}. Names cannot contain '/' or ':'"
    resolved = posixpath.normpath(name)  # a name is used as a path in places: it must stay the same one
    if resolved != name or resolved == "." or resolved.startswith(("..", "/")):
        return f"Invalid value {name!r} for parameter 'name': This name would resolve to {resolved!r}"
    return None


def _experiment_name_rule(name: str) -> str | None:
    if not name:
        return "Invalid experiment name: ''"
    if len(name) > MAX_EXPERIMENT_NAME_CHARS:
        return f"'name' exceeds the maximum length of {MAX_EXPERIMENT_NAME_CHARS}"
    return None
