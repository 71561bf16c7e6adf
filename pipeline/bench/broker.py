"""The project's own Apache Kafka broker, for Python callers (the demo, the tests' fixtures).

`scripts/kafka.sh` does the work (jars from Maven Central, KRaft format, start, stop); this module runs it,
knows the address it serves on, and offers a context manager that starts it only when nothing serves there.
"""

import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
KAFKA_SCRIPT = REPO_ROOT / "scripts" / "kafka.sh"
# A first start may download the jars (tens of seconds); kafka.sh itself gives the broker 60 s to come up.
START_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60


def kafka_port() -> int:
    return int(os.environ.get("TXS_KAFKA_PORT", "39092"))


def default_bootstrap() -> str:
    return f"127.0.0.1:{kafka_port()}"


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def run_kafka_script(command: str, timeout_s: float = START_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Runs `scripts/kafka.sh COMMAND`; a failure raises with the script's own explanation."""
    result = subprocess.run(
        [str(KAFKA_SCRIPT), command], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"scripts/kafka.sh {command} failed (exit {result.returncode}):\n{result.stdout}{result.stderr}"
        )
    return result


@contextmanager
def project_broker() -> Iterator[str]:
    """A broker for the duration of the block: whatever serves on the port is reused and left running;
    otherwise the project's broker is started and stopped again at the end (also on Ctrl-C)."""
    if port_open(kafka_port()):
        yield default_bootstrap()
        return
    run_kafka_script("install")
    run_kafka_script("start")
    try:
        yield default_bootstrap()
    finally:
        run_kafka_script("stop", STOP_TIMEOUT_S)
