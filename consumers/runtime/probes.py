"""What /healthz and /readyz answer (consumers/runtime/endpoints.py serves them).

Ready: nothing is awaited. The service awaits its start (topics, producer, terminal table), then its
partitions (an assignment, and their states restored); a rebalance, a producer being replaced or the stop
await again. Each awaited thing has a reason, and /readyz says which are pending.

Alive: the loop of the command has come round within `stall_after_s`. A loop stuck longer than anything it
may wait on (a restore, a batch inside max_poll_interval_ms) will not recover by itself; a liveness probe
that fails restarts it.
"""

import threading
import time
from collections.abc import Callable


class Probes:
    """Readiness as named things awaited, each with its reason; liveness as the age of the last beat."""

    def __init__(self, stall_after_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._awaited: dict[str, str] = {}  # name -> why it is awaited
        self._stall_after_s = stall_after_s  # None: alive while the process answers
        self._clock = clock
        self._last_beat = clock()

    def wait_for(self, name: str, why: str) -> None:
        """Not ready until done(name)."""
        with self._lock:
            self._awaited[name] = why

    def done(self, name: str) -> None:
        with self._lock:
            self._awaited.pop(name, None)

    def beat(self) -> None:
        """The loop has come round: called once a cycle."""
        self._last_beat = self._clock()

    def ready(self) -> tuple[bool, str]:
        """(ready, what to say): "ready", or every awaited thing with its reason."""
        with self._lock:
            awaited = dict(self._awaited)
        if not awaited:
            return True, "ready"
        return False, "not ready: " + "; ".join(f"{name}: {why}" for name, why in awaited.items())

    def alive(self) -> tuple[bool, str]:
        """(alive, what to say)."""
        if self._stall_after_s is None:
            return True, "alive"
        silent_s = self._clock() - self._last_beat
        if silent_s > self._stall_after_s:
            return False, (
                f"stalled: the loop has not come round for {silent_s:.0f} s (limit {self._stall_after_s:.0f} s)"
            )
        return True, "alive"
