"""Operator mistakes as one line that says what is wrong and what to do, instead of a library's traceback
(`--debug` prints it as well). Errors the operator cannot fix, bugs, keep their traceback.

Exit codes: 2 for a setting, flag or input the operator got wrong (argparse's own code); 1 for a model store,
Kafka cluster or file system that refused or did not answer.

An MLflow or Kafka exception can only come from a library already loaded, so these look their exception
classes up in sys.modules instead of importing them: `txsentinel --help` must not wait seconds for MLflow.
"""

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.data.error_text import first_line
from pipeline.data.output_paths import unwritable, unwritable_file

EXIT_INPUT = 2
EXIT_OUTSIDE = 1


class OperatorError(Exception):
    """A mistake an operator can fix: the message is one line saying what is wrong and what to do."""

    def __init__(self, message: str, exit_code: int = EXIT_OUTSIDE):
        super().__init__(" ".join(message.split()))
        self.exit_code = exit_code


def _notes(error: BaseException) -> str:
    notes = getattr(error, "__notes__", [])
    return f" ({'; '.join(notes)})" if notes else ""


def check_output(path: Path | None, setting: str, directory: bool = True) -> None:
    """Refuse an output path (given by `setting`, e.g. "--out") that cannot be written, before any work is
    done: a file where a directory goes, a directory where a file goes, a path under a file, or one in a
    place this user cannot write (nothing is left behind by asking). A file (`directory=False`) is written in
    place: one that exists is asked whether it opens for writing, a new one whether its directory takes it.
    None: no output asked for."""
    if path is None:
        return
    for parent in Path(path).parents:
        if parent.exists() and not parent.is_dir():
            raise OperatorError(
                f"{setting} {path}: {parent} is a file, so nothing can be written under it", EXIT_INPUT
            )
    if directory and path.exists() and not path.is_dir():
        raise OperatorError(f"{setting} {path} is a file; expected a directory to write into", EXIT_INPUT)
    if not directory and path.is_dir():
        raise OperatorError(
            f"{setting} {path} is a directory; expected the path of a file to write", EXIT_INPUT
        )
    if directory:
        problem = unwritable(path)
    elif path.exists():  # a file is written in place (features: polars opens the path itself), not beside it
        problem = unwritable_file(path)
    else:
        problem = unwritable(path.parent)
    if problem:
        raise OperatorError(f"{setting} {path}: {problem}; choose a place this user can write", EXIT_INPUT)


@contextmanager
def tracking_errors() -> Iterator[None]:
    """A tracking store that cannot be used (pipeline.registry.tracking_store.TrackingStoreError, raised where a
    command first opens it) becomes an OperatorError: exit 1 for a server that refused or did not answer, else 2."""
    try:
        yield
    except Exception as error:
        tracking = sys.modules.get("pipeline.registry.tracking_store")
        if tracking is None or not isinstance(error, tracking.TrackingStoreError):
            raise
        raise OperatorError(str(error), EXIT_OUTSIDE if error.unavailable else EXIT_INPUT) from error


@contextmanager
def model_errors(uri: str) -> Iterator[None]:
    """MLflow failing to resolve `uri` becomes an OperatorError naming the URI and the store it was looked up in:
    the model registry for a models:/ URI, the tracking store for a run's."""
    try:
        yield
    except Exception as error:
        exceptions = sys.modules.get("mlflow.exceptions")
        if exceptions is None or not isinstance(error, exceptions.MlflowException):
            raise
        tracking = sys.modules["pipeline.registry.tracking_store"]  # loaded: load_model raised the error
        store, setting = (
            tracking.described_registry() if uri.startswith("models:/") else tracking.described_tracking()
        )
        raise OperatorError(
            f"model {uri!r} did not resolve in the MLflow {store}: {first_line(error.message)}. Check the name "
            f"and version or alias (`mlflow ui` lists them), or point {setting} at the store the model was "
            "registered in"
        ) from error


@contextmanager
def kafka_errors(cfg: Any) -> Iterator[None]:
    """A Kafka error of the service or the table writer becomes an OperatorError that names the cluster
    (`cfg`: the ServeConfig) and the settings to look at."""
    try:
        yield
    except Exception as error:
        errors = sys.modules.get("kafka.errors")
        if errors is None or not isinstance(error, errors.KafkaError):
            raise
        raise OperatorError(_kafka_line(error, errors, cfg)) from error


def _kafka_line(error: Exception, errors: Any, cfg: Any) -> str:
    cluster = f"the Kafka cluster at {cfg.bootstrap_servers}"
    said = f"{first_line(str(error)) or type(error).__name__}{_notes(error)}"
    protocol = cfg.kafka_security_protocol or "PLAINTEXT"
    if isinstance(error, errors.KafkaTimeoutError | errors.KafkaConnectionError):
        return (
            f"no answer from {cluster} ({said}). Check that a broker listens there for {protocol} clients; "
            "set bootstrap_servers (--bootstrap-servers, TXS_BOOTSTRAP_SERVERS) and kafka_security_protocol "
            "(TXS_KAFKA_SECURITY_PROTOCOL) to match its listener"
        )
    if isinstance(
        error,
        errors.SaslAuthenticationFailedError
        | errors.UnsupportedSaslMechanismError
        | errors.IllegalSaslStateError,
    ):
        return (
            f"{cluster} refused the credentials ({said}). Check kafka_sasl_mechanism "
            "(TXS_KAFKA_SASL_MECHANISM), TXS_KAFKA_SASL_USERNAME and TXS_KAFKA_SASL_PASSWORD or "
            "TXS_KAFKA_SASL_PASSWORD_FILE"
        )
    if isinstance(error, errors.AuthorizationError):
        return (
            f"{cluster} refused this client ({said}). Grant its principal the ACLs listed in "
            "docs/operations.md (topics, group, transactional id), or create the topics in advance"
        )
    if isinstance(
        error,
        errors.InvalidReplicationFactorError
        | errors.InvalidPartitionsError
        | errors.InvalidTopicError
        | errors.PolicyViolationError
        | errors.InvalidConfigurationError
        | errors.UnknownTopicOrPartitionError,
    ):
        return (
            f"{cluster} refused a topic ({said}). Set replication_factor (at most the broker count) or "
            "transactions_partitions, fix the *_topic names and topic_prefix, or create the topics in advance "
            "as docs/operations.md lists them"
        )
    return f"{cluster}: {said}. Rerun with --debug for the traceback"
