"""The file MLflow runs to build the model when it loads one ("models from code": nothing is pickled).

log_and_register (pyfunc_model.py) logs this file as the python_model; on load, MLflow puts the model's code
on sys.path first (code_paths), then runs it.
"""

import mlflow

from pipeline.registry.pyfunc_model import TransactionScorer

mlflow.models.set_model(TransactionScorer())
