"""The signals of the long-running commands, sent to a real process: the first SIGTERM/SIGINT stops it
cleanly, the same again exits at once, SIGUSR1 writes the stacks and changes nothing."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Enters stop_on_signals, says so, then waits: for the stop (exit 0) or for a slow way out (the shutdown
# takes 60 s, as one stuck on an unreachable broker might).
CHILD = """
import sys, threading, time
from consumers.runtime.signals import stop_on_signals
stop = threading.Event()
with stop_on_signals(stop):
    print("ready", flush=True)
    while not stop.wait(0.05):
        pass
    print("stopping", flush=True)
    if sys.argv[1] == "slow":
        time.sleep(60)
print("stopped", flush=True)
"""


ROOT = Path(__file__).resolve().parents[3]


def child(mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline() == "ready\n"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_first_stop_signal_stops_cleanly(sig):
    proc = child("quick")
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out == "stopping\nstopped\n"


def test_the_same_signal_again_while_stopping_exits_at_once():
    proc = child("slow")
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline() == "stopping\n"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - started < 10
    assert proc.returncode == 128 + signal.SIGTERM
    assert "SIGTERM again while stopping: exiting now" in err


def test_sigusr1_dumps_every_threads_stack_and_the_process_goes_on():
    proc = child("quick")
    proc.send_signal(signal.SIGUSR1)
    time.sleep(1.0)
    assert proc.poll() is None  # still running
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.endswith("stopped\n")
    assert "Current thread" in err and "(most recent call first)" in err
