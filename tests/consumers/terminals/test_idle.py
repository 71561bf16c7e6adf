"""Idle terminals (consumers/terminals/idle.py): which go, that their going changes no feature of the events
that come later, and that the table writer deletes them from the table with tombstones."""

import numpy as np
import pytest

from consumers.runtime.metrics import Metrics
from consumers.runtime.settings import load_serve_config
from consumers.terminals.idle import TerminalEviction, idle_terminals
from consumers.terminals.table import POSITIONS_KEY, Positions
from consumers.terminals.writer import TerminalTableWriter
from pipeline.features.definitions import FEATURE_NAMES, RING_DAYS
from pipeline.features.stream import StreamingFeaturizer
from pipeline.features.stream_batches import EventBatch, LabelBatch
from tests.consumers.terminals.test_writer import ScriptedProducer

DAY_US = 86_400 * 1_000_000
DAY0 = 20_000  # an epoch day (2024-10-04)


def events(terminals: list[str], days: list[int], account: str = "A") -> EventBatch:
    n = len(terminals)
    ts = np.array([(DAY0 + d) * DAY_US + 3_600_000_000 for d in days], dtype=np.int64)
    return EventBatch([account] * n, list(terminals), ts, np.full(n, 20.0))


def fraud(terminal: str, day: int) -> LabelBatch:
    at = np.array([(DAY0 + day) * DAY_US], dtype=np.int64)
    return LabelBatch([terminal], at, np.array([True]), [f"{terminal}-{day}"], ["A"])


def history() -> StreamingFeaturizer:
    """T-old: events on days 0-5, T-reported: events on day 0 and a fraud report on day 80, T-busy: every
    ten days up to day 100 (the newest day)."""
    featurizer = StreamingFeaturizer()
    featurizer.transform(events(["T-old"] * 6 + ["T-reported"], [0, 1, 2, 3, 4, 5, 0]))
    featurizer.transform(events(["T-busy"] * 11, list(range(0, 101, 10))), fraud("T-reported", 80))
    return featurizer


def test_a_terminal_idle_longer_than_the_setting_before_the_newest_day_goes_and_a_reported_one_stays():
    table = history().terminals
    assert idle_terminals(table, 90) == ["T-old"]  # last event on day 5, the newest is 100
    assert idle_terminals(table, 95) == []
    assert sorted(idle_terminals(table, 31)) == ["T-old"]  # T-reported's report on day 80 keeps it


def test_an_evicted_terminal_reads_as_it_would_have_for_every_later_event_within_the_bound():
    kept, evicted = history(), history()
    eviction = TerminalEviction(90)
    assert eviction.evict(evicted.terminals) == ["T-old"] and "T-old" not in evicted.terminals
    # Later events at T-old: on the newest day, after it, and late ones down to 90 - 30 days before it.
    later = events(["T-old", "T-old", "T-old", "T-old"], [100, 104, 40, 70], account="B")
    want, _ = kept.transform(later)
    got, _ = evicted.transform(later)
    terminal_columns = [i for i, name in enumerate(FEATURE_NAMES) if name.startswith("terminal")]
    assert np.array_equal(got[:, terminal_columns], want[:, terminal_columns])
    assert np.array_equal(got, want)
    assert evicted.terminals.get_bytes("T-busy") == kept.terminals.get_bytes("T-busy")  # the others untouched
    # Beyond the bound (an event at T-old more than 90 - 30 days late) the windows would still see day 5.
    kept, evicted = history(), history()
    TerminalEviction(90).evict(evicted.terminals)
    too_late = events(["T-old"], [20], account="B")
    assert not np.array_equal(kept.transform(too_late)[0], evicted.transform(too_late)[0])


def test_eviction_runs_at_most_every_interval_and_never_when_off():
    eviction = TerminalEviction(90, every_s=3600)
    table = history().terminals
    assert eviction.evict(table) == ["T-old"]
    table = history().terminals
    assert eviction.evict(table) == []  # not due yet
    assert eviction.evict(table, force=True) == ["T-old"] and eviction.evicted == 2
    assert TerminalEviction(0).evict(history().terminals, force=True) == []


@pytest.mark.parametrize("days", [1, RING_DAYS])
def test_an_idle_time_within_the_longest_window_is_refused_at_start(days):
    cfg = load_serve_config(None, overrides={"terminal_idle_days": days}, env={})
    with pytest.raises(ValueError, match=f"terminal_idle_days = {days}: expected 0 .* more than {RING_DAYS}"):
        TerminalTableWriter(cfg, "unused:9092", Metrics())  # as the service's batch scorer does, at start


def test_the_writer_deletes_idle_terminals_from_the_table_with_tombstones_before_the_positions():
    cfg = load_serve_config(None, overrides={"topic_prefix": "p-", "group_id": "g"}, env={})
    assert cfg.terminal_idle_days == 90
    metrics = Metrics()
    writer = TerminalTableWriter(cfg, "unused:9092", metrics)
    featurizer = history()
    evicted = writer.eviction.evict(featurizer.terminals, force=True)
    producer = ScriptedProducer()
    changed = {"T-busy"}
    writer._flush(
        producer, featurizer, changed, [], Positions(labels={0: 3}), True, evicted, table_at=Positions()
    )

    sends = [(entry[1], entry[2], entry[3]) for entry in producer.log if entry[0] == "send"]
    assert [(key, value is None) for _, key, value in sends] == [
        ("T-old", True), ("T-busy", False), (POSITIONS_KEY, False)
    ]  # fmt: skip
    assert {topic for topic, _, _ in sends} == {"p-terminal-risk-table"}
    assert writer.stats.terminals_evicted == 1 and metrics.get("txsentinel_terminals_evicted_total") == 1
