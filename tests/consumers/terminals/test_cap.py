"""The cap on terminals held (consumers/terminals/idle.py): over max_terminals_in_memory those with the least
history go at once (no report, the fewest events in the windows, the least recently active), down to the
mark; under it nothing goes between scans; it is never silent; and the table writer deletes what it lets
go with tombstones. A scorer's batches: tests/consumers/service/test_batch_scoring.py;
the whole service: tests/integration/test_service_labels.py."""

import logging
import re

import pytest

from consumers.runtime.metrics import Metrics
from consumers.runtime.settings import load_serve_config
from consumers.terminals.idle import CAP_LOG_EVERY_S, TerminalEviction
from consumers.terminals.table import POSITIONS_KEY, Positions
from consumers.terminals.writer import TerminalTableWriter
from pipeline.features.stream import StreamingFeaturizer
from tests.consumers.terminals.test_idle import DAY0, events, fraud, history
from tests.consumers.terminals.test_writer import ScriptedProducer


def busy_days(days: dict[str, int], order: list[str] | None = None) -> StreamingFeaturizer:
    """One event at each terminal, on its day (after DAY0), in `order` (default: the dict's)."""
    featurizer = StreamingFeaturizer()
    for terminal in order or list(days):
        featurizer.transform(events([terminal], [days[terminal]]))
    return featurizer


def test_over_the_cap_among_equal_histories_the_least_recently_active_go_first_down_to_the_mark():
    # T-00 .. T-10 last active on days 0 .. 10, none with an event inside the windows of day 50; but T-00 was
    # reported on day 50: its report is inside them.
    featurizer = busy_days({f"T-{d:02d}": d for d in range(11)})
    featurizer.transform(events(["T-late"], [50]), fraud("T-00", 50))
    table = featurizer.terminals
    eviction = TerminalEviction(90, max_terminals=10)  # 12 held: over; the mark is 9
    gone = eviction.cap(table, now=0.0)
    assert gone == ["T-01", "T-02", "T-03"]
    assert sorted(table) == ["T-00", *(f"T-{d:02d}" for d in range(4, 11)), "T-late"]
    assert len(table) == eviction.keep == 9 and eviction.capped == 3


def test_ties_on_the_day_at_the_mark_go_by_terminal_id_whatever_order_they_came_in():
    days = {
        "T-c": 1,
        "T-a": 1,
        "T-d": 1,
        "T-b": 1,
        "T-old": 0,
        "T-x": 2,
        "T-y": 2,
        "T-z": 2,
        "T-w": 2,
        "T-v": 2,
    }
    kept = []
    for order in (list(days), sorted(days), sorted(days, reverse=True)):
        table = busy_days(days, order).terminals
        gone = TerminalEviction(90, max_terminals=8).cap(table, now=0.0)  # 10 held, the mark is 8
        assert sorted(gone) == ["T-a", "T-old"]  # day 0, then the first of day 1 by id
        kept.append(sorted(table))
    assert kept[0] == kept[1] == kept[2]


def test_under_the_cap_nothing_goes_between_scans_and_the_mark_leaves_room_for_new_terminals():
    featurizer = busy_days({f"T-{d:02d}": d for d in range(11)})
    eviction = TerminalEviction(90, max_terminals=10, every_s=3600)
    eviction.evict(featurizer.terminals, now=0.0)  # the idle scan (none idle), not due again for an hour
    assert eviction.cap(featurizer.terminals, now=1.0) == ["T-00", "T-01"]  # 11 -> 9
    featurizer.transform(events(["T-new1"], [20]))  # 10 held: at the cap, not over it
    assert eviction.cap(featurizer.terminals, now=2.0) == [] == eviction.evict(featurizer.terminals, now=2.0)
    assert len(featurizer.terminals) == 10
    featurizer.transform(events(["T-new2"], [21]))  # over: back to the mark
    assert eviction.cap(featurizer.terminals, now=3.0) == ["T-02", "T-03"]
    assert len(featurizer.terminals) == 9 and eviction.capped == 4


def test_the_idle_rule_still_works_beside_the_cap_and_a_cap_of_zero_keeps_everything():
    table = history().terminals
    eviction = TerminalEviction(90, max_terminals=100)
    assert eviction.cap(table) == [] and eviction.evict(table) == ["T-old"] and eviction.capped == 0
    table = history().terminals
    assert TerminalEviction(90, max_terminals=0).cap(table) == [] and len(table) == 3
    assert TerminalEviction(90, max_terminals=0).row_limit is None


def test_letting_go_over_the_cap_is_an_error_the_first_time_then_at_most_once_a_minute(caplog):
    featurizer = busy_days({f"T-{d:02d}": d for d in range(11)})
    eviction = TerminalEviction(90, max_terminals=10, holder="scorer")
    with caplog.at_level(logging.ERROR, logger="consumers.terminals.idle"):
        eviction.cap(featurizer.terminals, now=100.0)
        (first,) = caplog.messages
        assert "holder=scorer max_terminals_in_memory=10 let_go=2 with_history=0 since_start=2" in first
        # T-01 was the most recently active of those let go: day 1, 9 days before the newest (T-10's).
        assert "newest_let_go_active=2024-10-05 days_before_newest_held=9" in first
        assert "Raise max_terminals_in_memory" in first and "so many new terminal ids" in first
        featurizer.transform(events(["T-a", "T-b"], [30, 30]))
        eviction.cap(featurizer.terminals, now=100.0 + CAP_LOG_EVERY_S / 2)  # 11 -> 9 again: not logged yet
        eviction.cap(featurizer.terminals, now=100.0 + CAP_LOG_EVERY_S / 2 + 1)  # nothing new, not due
        assert len(caplog.messages) == 1 and eviction.capped == 4
        eviction.cap(featurizer.terminals, now=100.0 + CAP_LOG_EVERY_S)  # due: what went since the first
        assert len(caplog.messages) == 2
        assert "let_go=2 with_history=0 since_start=4 newest_let_go_active=2024-10-07" in caplog.messages[1]
        eviction.cap(featurizer.terminals, now=1_000.0)  # nothing went since: nothing to say
        assert len(caplog.messages) == 2
    assert all(record.levelno == logging.ERROR for record in caplog.records)


@pytest.mark.parametrize("value", [-1, 2.5, True, "lots"])
def test_a_cap_that_is_not_a_count_is_refused_naming_the_setting(value):
    with pytest.raises(
        ValueError, match=re.escape(f"max_terminals_in_memory = {value!r}, expected an integer >= 0")
    ):
        load_serve_config(None, overrides={"max_terminals_in_memory": value}, env={})


def test_the_default_cap_and_what_memory_holds_for_it():
    cfg = load_serve_config(None, env={})
    eviction = TerminalEviction(cfg.terminal_idle_days, cfg.max_terminals_in_memory)
    assert (eviction.max_terminals, eviction.keep, eviction.row_limit) == (5_000_000, 4_500_000, 5_500_000)


def test_the_writer_lets_go_over_the_cap_at_once_and_deletes_them_with_tombstones_unless_they_came_back():
    cfg = load_serve_config(
        None, overrides={"topic_prefix": "p-", "group_id": "g", "max_terminals_in_memory": 2}, env={}
    )
    metrics = Metrics()
    writer = TerminalTableWriter(cfg, "unused:9092", metrics)
    featurizer = history()  # T-old (days 0-5), T-reported (reported on day 80), T-busy (days 0-100)
    featurizer.transform(events(["T-new"], [100]))  # 4 held, the cap is 2: two go
    capped = writer._cap(featurizer, set())
    # T-old has no event inside the 30-day windows, T-new one against T-busy's three (days 80, 90, 100), and
    # T-reported's report on day 80 is inside them.
    assert capped == {"T-old", "T-new"} and sorted(featurizer.terminals) == ["T-busy", "T-reported"]
    assert writer.stats.terminals_capped == 2
    assert 'txsentinel_terminals_capped_total{holder="writer"} 2.0' in metrics.render()
    featurizer.transform(events(["T-new"] * 5, [101] * 5))  # back, with five new events only
    writer._cap(featurizer, capped)  # over again: T-busy (three events in the windows) goes
    assert capped == {"T-old", "T-new", "T-busy"} and sorted(featurizer.terminals) == ["T-new", "T-reported"]

    producer = ScriptedProducer()
    read_to = Positions(labels={0: 3})
    writer._flush(
        producer, featurizer, {"T-busy", "T-new"}, [], read_to, True, (), capped, table_at=Positions()
    )
    sends = [(entry[1], entry[2], entry[3]) for entry in producer.log if entry[0] == "send"]
    assert [(key, value is None) for _, key, value in sends] == [
        ("T-busy", True), ("T-old", True), ("T-new", False), (POSITIONS_KEY, False)
    ]  # fmt: skip
    assert {topic for topic, _, _ in sends} == {"p-terminal-risk-table"}
    assert writer.stats.terminals_written == 1 and writer.stats.terminals_evicted == 0
    record = featurizer.terminals.records[featurizer.terminals.slot_of["T-new"]]
    assert record["max_day"] == DAY0 + 101
    assert record["day_count"].sum() == 5  # its event on day 100 went with it: the cap changes features


def test_a_flood_of_made_up_terminals_lets_its_own_go_and_keeps_every_terminal_with_a_history(caplog):
    featurizer = StreamingFeaturizer()
    days = list(range(20, 30))  # the ten days before the flood's
    busy = [f"busy-{i}" for i in range(10)]  # an event a day each
    featurizer.transform(events([t for t in busy for _ in days], [d for _ in busy for d in days]))
    quiet = [f"quiet-{i}" for i in range(10)]  # one event each, ten days ago
    featurizer.transform(events(quiet, [20] * 10))
    reported = [f"hit-{i}" for i in range(5)]  # one event each, then a fraud report
    featurizer.transform(events(reported, [25] * 5))
    for terminal in reported:
        featurizer.transform(events([], []), fraud(terminal, 26))
    eviction = TerminalEviction(90, max_terminals=100)
    flood = [f"flood-{i}" for i in range(1_000)]  # one event each, all on the newest day
    let_go = []
    with caplog.at_level(logging.ERROR, logger="consumers.terminals.idle"):
        for start in range(0, len(flood), 50):
            featurizer.transform(events(flood[start : start + 50], [30] * 50))
            let_go += eviction.cap(featurizer.terminals, now=0.0)
    held = set(featurizer.terminals)
    assert set(busy) | set(reported) <= held  # least recently active first would have let every one go
    assert set(quiet) <= set(let_go)  # as little history as a flood's terminal, and older
    assert len(held) <= 100 and set(let_go) <= set(quiet) | set(flood)
    assert "with_history=0" in caplog.messages[0]  # all one-event terminals: ids made up, not a cap too low


def test_labels_for_terminals_no_event_has_named_protect_nothing_and_a_history_let_go_is_counted():
    featurizer = busy_days({f"T-{d:02d}": 20 + d for d in range(5)})  # an event each, days 20-24
    for terminal in ["made-up-1", "made-up-2", "made-up-3"]:  # fraud labels for events that never were
        featurizer.transform(events([], []), fraud(terminal, 24))
    featurizer.transform(events(["T-00"], [24]))  # two events inside the windows
    featurizer.transform(events(["T-busy"] * 3, [22, 23, 24]))  # three
    eviction = TerminalEviction(90, max_terminals=7)  # 9 held, the mark is 7
    assert sorted(eviction.cap(featurizer.terminals, now=0.0)) == ["made-up-1", "made-up-2"]
    assert eviction.unlogged_with_history == 0
    eviction.max_terminals, eviction.keep = 2, 2  # 7 held: the one-event terminals go, the newest too
    assert sorted(eviction.cap(featurizer.terminals, now=0.0)) == [
        "T-01",
        "T-02",
        "T-03",
        "T-04",
        "made-up-3",
    ]
    assert eviction.unlogged_with_history == 0 and sorted(featurizer.terminals) == ["T-00", "T-busy"]
    eviction.max_terminals, eviction.keep = 1, 1
    assert eviction.cap(featurizer.terminals, now=0.0) == ["T-00"] and eviction.unlogged_with_history == 1


def test_a_flood_of_new_terminals_grows_the_records_to_the_row_limit_and_no_further():
    featurizer = StreamingFeaturizer()
    eviction = TerminalEviction(90, max_terminals=1_000)
    featurizer.terminals.row_limit = eviction.row_limit  # as every holder sets it on the table it folds into
    for start in range(0, 5_000, 50):
        featurizer.transform(events([f"flood-{i}" for i in range(start, start + 50)], [0] * 50))
        eviction.cap(featurizer.terminals, now=0.0)
        assert len(featurizer.terminals) <= 1_000
    assert len(featurizer.terminals.records) == eviction.row_limit == 1_100  # doubling would have made 2,048
    assert eviction.capped == 5_000 - len(featurizer.terminals)
