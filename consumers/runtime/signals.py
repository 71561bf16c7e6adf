"""The signals the long-running commands (serve, terminal-writer) obey.

SIGTERM or SIGINT: stop cleanly (set the stop event; the command finishes what is in flight and exits 0).
The same signal again while stopping: exit at once with 128 + the signal's number, as a crash would (nothing
uncommitted was ever visible; the group redelivers it). SIGUSR1: write every thread's stack to stderr and go
on (a stuck instance explains itself). docs/operations.md#signals has the whole table.
"""

import faulthandler
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM/SIGINT set `stop` while inside (a second one exits at once), SIGUSR1 dumps the threads'
    stacks; the previous handlers come back on the way out. Python allows handlers in the main thread only:
    from another thread this does nothing and the caller owns `stop`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_stop(signum, frame):
        if not stop.is_set():
            stop.set()
            return
        # Not through logging: a handler runs between two bytecodes of the main thread, which may be inside
        # a logging handler already.
        os.write(2, f"{signal.Signals(signum).name} again while stopping: exiting now\n".encode())
        os._exit(128 + signum)

    previous = {sig: signal.signal(sig, on_stop) for sig in STOP_SIGNALS}
    # fd 2, not sys.stderr: a test runner may have replaced sys.stderr by an object with no descriptor
    faulthandler.register(signal.SIGUSR1, file=2, all_threads=True, chain=False)
    try:
        yield
    finally:
        faulthandler.unregister(signal.SIGUSR1)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
