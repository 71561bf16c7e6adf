"""One core for a benchmark, set before polars starts: it sizes its thread pool when it is imported.

Kept apart from the benchmarks (which import polars) so that the CLI can pin first and import them after.
"""

import os
import sys


def pin_to_one_core() -> None:
    """Run on one core: polars sizes its thread pool from the CPUs this process may use."""
    if "polars" in sys.modules:
        raise RuntimeError("pin_to_one_core must run before polars is imported")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    os.environ["POLARS_MAX_THREADS"] = "1"
