"""`txsentinel bench restore`: how long the service takes to read N account states back from a real changelog on
the project's broker, and how much memory that takes, per detector at its default size.

One changelog topic per detector holds N accounts' records (each a real state record of that detector, the
same bytes under N keys: decoding costs the same whatever the values), spread over partitions of
`unit` accounts each (the scales' greatest common divisor), so restoring k partitions restores k * unit accounts: the scales. Each scale is
restored by a fresh process (pinned to the caller's core, its own peak memory) through the service's own
path: changelog partitions read read_committed to their ends and applied in chunks
(consumers/service/state_restore.py), the accounts' places noted (consumers/service/dormant.py).

    txsentinel bench restore [--accounts 1000000] [--scales 100000 300000 1000000] [DETECTOR ...]
"""

import json
import math
import resource
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

TARGET_S = 60.0  # for 1M accounts on one core
MAX_PARTITIONS = 100
SEED = 0


@dataclass(frozen=True)
class RestoreBenchConfig:
    accounts: int = 1_000_000
    scales: tuple[int, ...] = (100_000, 300_000, 1_000_000)
    detectors: tuple[str, ...] = ("lstm", "linear_transformer", "transformer")

    def __post_init__(self):
        bad = [s for s in self.scales if not 0 < s <= self.accounts]
        if bad or self.accounts // self.unit > MAX_PARTITIONS:
            raise ValueError(
                f"bench restore: scales {list(self.scales)} must lie in 1..accounts ({self.accounts}), and each "
                f"be a multiple of their greatest common divisor with the accounts ({self.unit}, the accounts of "
                f"one changelog partition) that leaves at most {MAX_PARTITIONS} partitions; refused: {bad or '-'}"
            )

    @property
    def unit(self) -> int:
        """Accounts per changelog partition: every scale is a whole number of partitions."""
        return math.gcd(self.accounts, *self.scales)


def _scorer(name: str):
    import torch

    from consumers.scoring.scorer import Scorer
    from models.registry import build_detector
    from pipeline.features.definitions import FEATURE_NAMES
    from pipeline.features.spec import FeatureSpec
    from pipeline.registry.artifact import LoadedModel

    n = len(FEATURE_NAMES)
    torch.manual_seed(SEED)  # the same weights in every process: the records' model fingerprint matches
    detector = build_detector(name, {"num_features": n})
    return Scorer(LoadedModel(detector=detector, spec=FeatureSpec(mean=(0.0,) * n, std=(1.0,) * n)))


def _one_record(name: str) -> bytes:
    """A state record of `name` after a few events: what every key of the bench changelog holds."""
    from consumers.scoring.messages import Transaction

    scorer = _scorer(name)
    events = [
        Transaction(f"e{i}", "a", 1_700_000_000_000_000 + i * 60_000_000, 10.0 + i, "t") for i in range(5)
    ]
    scorer.score(events, [(0, i) for i in range(5)])
    return scorer.account_state_bytes("a")


def _fill(bootstrap: str, topic: str, cfg: RestoreBenchConfig, value: bytes) -> float:
    from kafka import KafkaAdminClient, KafkaProducer
    from kafka.admin import NewTopic

    partitions = cfg.accounts // cfg.unit
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, partitions, 1, topic_configs={"cleanup.policy": "compact"})])
    finally:
        admin.close()
    started = time.monotonic()
    producer = KafkaProducer(
        bootstrap_servers=bootstrap, acks=1, linger_ms=20, batch_size=1_048_576, max_request_size=8_388_608
    )
    for i in range(cfg.accounts):
        producer.send(topic, key=f"acct-{i:08d}".encode(), value=value, partition=i // cfg.unit)
    producer.flush()
    producer.close()
    return time.monotonic() - started


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(name: str, bootstrap: str, topic: str, partitions: int) -> dict:
    """One restore of `partitions` changelog partitions, in this process: the child's side of the bench."""
    from consumers.runtime.compacted import RESTORE_FETCH, Reader
    from consumers.service.dormant import DormantStates
    from consumers.service.state_restore import restore_partitions

    scorer = _scorer(name)
    reader = Reader.connect(bootstrap, "txsentinel-bench-restore", **RESTORE_FETCH)
    reader.watermarks.partitions_for_topic(
        topic
    )  # metadata before the clock starts, as a running service has
    before = _rss_bytes()
    started, cpu = time.monotonic(), time.process_time()
    done = restore_partitions(scorer, reader, topic, list(range(partitions)), 3600.0, keep=10**9)
    dormant = DormantStates(10**9)
    dormant.restored(done.where, done.accounts, 0)
    seconds, cpu_seconds = time.monotonic() - started, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reader.close()
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,  # every thread of the process: the restore and kafka-python's network thread
        "accounts": len(scorer.accounts_in_memory),
        "records": done.read,
        "rss_before": before,
        "rss_peak": peak,
    }


def run_restore_bench(cfg: RestoreBenchConfig, bootstrap: str) -> list[dict]:
    """One row per detector and scale (module docstring); each topic is deleted after its detector."""
    from kafka import KafkaAdminClient

    rows = []
    for name in cfg.detectors:
        value = _one_record(name)
        topic = f"bench-restore-{uuid.uuid4().hex[:8]}-{name}"
        fill_s = _fill(bootstrap, topic, cfg, value)
        print(f"{name}: {cfg.accounts} records of {len(value)} bytes written in {fill_s:.0f} s", flush=True)
        try:
            for scale in cfg.scales:
                child = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "pipeline.bench.restore",
                        name,
                        bootstrap,
                        topic,
                        str(scale // cfg.unit),
                    ],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if child.returncode != 0:
                    raise RuntimeError(f"restore of {scale} {name} states failed:\n{child.stderr[-3000:]}")
                row = {
                    "detector": name,
                    "scale": scale,
                    "record_bytes": len(value),
                    **json.loads(child.stdout),
                }
                rows.append(row)
                print(format_row(row), flush=True)
        finally:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap)
            try:
                admin.delete_topics([topic])
            finally:
                admin.close()
    return rows


HEADER = (
    f"{'detector':<20}{'accounts':>10}{'record B':>10}{'seconds':>9}{'CPU s':>8}{'per s':>10}{'peak RSS MB':>13}"
    f"{'+ MB':>8}"
)


def format_row(row: dict) -> str:
    mb = 1024 * 1024
    return (
        f"{row['detector']:<20}{row['accounts']:>10,}{row['record_bytes']:>10,}{row['seconds']:>9.1f}"
        f"{row['cpu_seconds']:>8.1f}"
        f"{row['accounts'] / row['seconds']:>10,.0f}{row['rss_peak'] / mb:>13,.0f}"
        f"{(row['rss_peak'] - row['rss_before']) / mb:>8,.0f}"
    )


def format_table(rows: list[dict]) -> str:
    """The rows as printed by `txsentinel bench restore`, with the target for 1M accounts."""
    lines = [
        HEADER,
        *map(format_row, rows),
        f"target: <= {TARGET_S:.0f} s for 1,000,000 accounts on one core",
    ]
    return "\n".join(lines)


if __name__ == "__main__":  # the child: detector, bootstrap, topic, partitions -> one JSON line
    print(json.dumps(measure(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))))
