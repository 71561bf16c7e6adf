"""A terminal's fraud reports: each labelled event counted once, a withdrawal taking it back, in bounded state.

A terminal record (state.TERMINAL_STATE) counts its fraud reports in a ring of day buckets and remembers, for
at most REMEMBERED_REPORTS events (LabelBatch.report_keys: account and event id hashed), the day its report
counts on and its VERDICT: the newest label of the event, as 2 * its label day + 1 when it says not fraud.

What a label does, folded one at a time (fold_reports):
- for an event the terminal remembers: the report counts on the earliest day a fraud label gave, unless the
  newest label says not fraud (the verdict is the greatest of 2 * day + (0 fraud, 1 not fraud): on one day
  a withdrawal outranks a fraud label). So a repeat changes nothing, a repeat dated earlier moves the report
  to its day, a later `is_fraud: false` withdraws it (uncounts it), and a fraud label dated after that
  counts it again. For the events it remembers, the record is the same whatever order the labels came in;
- for an event it does not remember: a fraud label is counted and remembered, unless the memory is full
  and the label is older than every remembered event (by (verdict, event key), the order the memory is kept
  in): then it is NOT counted. A label of `is_fraud: false` changes nothing (there is no report to withdraw;
  most labels are of this kind, and remembering them would push the reports out).

The bound, and why not counting is the choice. A full memory makes room by letting its oldest event go
(its count stays in the ring), and keys only grow (a verdict never goes down), so every event let go is
older than every event remembered. A label the terminal cannot find among what it remembers is either new
or repeats one let go, and no bounded state can tell which. Counting it would count a re-published labels
topic once more on every pass, without end; not counting it loses a report only when a terminal holds
REMEMBERED_REPORTS events whose newest label is newer than it. Hence:
- the same label, sent any number of times, in any order, is counted at most once: a repeat of an event let
  go is older than the memory's oldest and is refused, however many reports the terminal has;
- a terminal's count is exact while its labels come in time order (the batch form's order: a new label is
  then the newest) and no day brings it more than REMEMBERED_REPORTS of them; labels that come late by more
  than its REMEMBERED_REPORTS newest are undercounted, never overcounted;
- a label for an event let go, dated after the memory's oldest, counts again (it reads as a new report): at
  most once per (event, label day), and only after REMEMBERED_REPORTS newer labels pushed the event out;
- a withdrawal takes back what the terminal remembers: for an event let go, the report stays counted (the
  batch form, holding the final label only, has none). One that comes before any fraud label of its event
  finds nothing to withdraw, and the fraud label, though dated before it, then counts. The labels of one
  event share a partition of the labels topic (keyed by account), so every reader folds them in one order
  and agrees; the withdrawal sent again takes effect.

The memory costs REMEMBERED_REPORTS x 16 bytes a terminal (key, day, verdict), 512 of its 996. A larger one
moves the bound for 16 bytes an event; small per-day filters of the events reported would undercount by
their false positives and could not take a report back.

The ring holds, bucket by bucket, the newest day of the reports counted there and how many are on that
day (state.add_to_ring's rule, one report at a time); a report uncounted from a bucket it leaves empty gives
the bucket back to the other remembered reports that fall in it, which the newer day had hidden.
"""

import numpy as np

from pipeline.features.definitions import RING_DAYS


def fold_reports(
    rec: np.ndarray, slots: np.ndarray, days: np.ndarray, events: np.ndarray, fraud: np.ndarray
) -> np.ndarray:
    """Fold labels [L] into terminal records `rec` (TERMINAL_STATE), one at a time in the order given: label i
    of event key events[i] (uint64), on epoch day days[i] at record slots[i], fraud[i] its verdict.

    Returns [K, 3] int64 (label index, day, +1 or -1): each change a label made to what its terminal's report
    ring counts, in order (the streaming featurizer shows them to the events of a batch that come after the
    label)."""
    changes: list[tuple[int, int, int]] = []
    rows = zip(
        slots.tolist(), days.tolist(), events.tolist(), np.asarray(fraud, dtype=bool).tolist(), strict=True
    )
    for i, (slot, day, event, is_fraud) in enumerate(rows):
        changes += [(i, changed, delta) for changed, delta in _fold_label(rec, slot, day, event, is_fraud)]
    return np.array(changes, dtype=np.int64).reshape(-1, 3)


def _fold_label(rec: np.ndarray, slot: int, day: int, event: int, fraud: bool) -> list[tuple[int, int]]:
    """One label into record `slot` (module docstring): the (day, +1 or -1) changes it made to the ring."""
    memory = rec["reported_event"][slot]  # views, [REMEMBERED_REPORTS], kept sorted by (verdict, event)
    counted_on, verdict = rec["reported_day"][slot], rec["reported_verdict"][slot]
    code = 2 * day + (0 if fraud else 1)
    j = int((memory == event).argmax())
    if memory[j] == event:
        was_day, was_code = int(counted_on[j]), int(verdict[j])
        now_day, now_code = (min(was_day, day) if fraud else was_day), max(was_code, code)
        if (now_day, now_code) == (was_day, was_code):
            return []
        was_counted, now_counted = was_code % 2 == 0, now_code % 2 == 0
        changes = []
        if was_counted and (not now_counted or now_day != was_day):
            counted = verdict % 2 == 0  # the others' days: a bucket this report leaves empty shows them
            counted[j] = False
            if _uncount_report(rec, slot, was_day, counted_on[counted]):
                changes.append((was_day, -1))
        if now_counted and (not was_counted or now_day != was_day) and _count_report(rec, slot, now_day):
            changes.append((now_day, 1))
        _place(memory, counted_on, verdict, j, event, now_day, now_code)
        return changes
    if not fraud:
        return []  # nothing remembered to withdraw
    if memory[0] != 0 and (code, event) < (int(verdict[0]), int(memory[0])):
        return []  # full, and older than all it remembers: it may repeat a report let go
    _place(memory, counted_on, verdict, 0, event, day, code)  # an empty place, or the oldest event, makes way
    return [(day, 1)] if _count_report(rec, slot, day) else []


def _place(memory, counted_on, verdict, j: int, event: int, day: int, code: int) -> None:
    """Put (event, day, code) in place of place j, where the memory holds a lower (verdict, event), and move
    it up past the places above j with a lower one: the memory stays sorted (empty places, verdict -1, first)."""
    above_code, above_event = verdict[j + 1 :], memory[j + 1 :]
    to = j + int(np.count_nonzero((above_code < code) | ((above_code == code) & (above_event < event))))
    for field, value in ((memory, event), (counted_on, day), (verdict, code)):
        field[j:to] = field[j + 1 : to + 1]
        field[to] = value


def _count_report(rec: np.ndarray, slot: int, day: int) -> bool:
    """One report into the ring: a bucket keeps its newest day (add_to_ring's rule, for one report). Whether
    the ring counts it (not when its bucket holds a newer day)."""
    bucket = day % RING_DAYS
    held = int(rec["report_day"][slot, bucket])
    if day > held:
        rec["report_day"][slot, bucket], rec["report_count"][slot, bucket] = day, 1
    elif day == held:
        rec["report_count"][slot, bucket] += 1
    return day >= held


def _uncount_report(rec: np.ndarray, slot: int, day: int, other_days: np.ndarray) -> bool:
    """Take one report on `day` back out of the ring; whether the ring counted it. A bucket it leaves empty
    is rebuilt from the other remembered reports (`other_days`): a newer day had hidden any of them that fall
    in it, and they show again."""
    bucket = day % RING_DAYS
    if rec["report_day"][slot, bucket] != day:  # a newer day holds the bucket: the report was not counted
        return False
    rec["report_count"][slot, bucket] -= 1
    if rec["report_count"][slot, bucket] == 0:
        rest = other_days[other_days % RING_DAYS == bucket]
        newest = int(rest.max()) if rest.size else -1
        rec["report_day"][slot, bucket] = newest
        rec["report_count"][slot, bucket] = int((rest == newest).sum())
    return True
