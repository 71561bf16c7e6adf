"""SIGTERM and SIGINT set a stop event, for the long-running commands (serve, terminal-writer)."""

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM/SIGINT set `stop` while inside; the previous handlers come back on the way out. Python allows
    handlers in the main thread only: from another thread this does nothing and the caller owns `stop`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
