"""Which events of a micro-batch an account has applied already, from the bookkeeping beside its store row.

Two checks, steps 1 and 2 of the scorer's batch (scorer.py): a redelivery is an event at or before its
account's last applied (partition, offset), e.g. after a crash between producing the scores and committing
the offsets; a replay is an event whose event_id hash is among its account's last RECENT_EVENT_IDS, or at an
earlier event of the same batch, i.e. the same event at another offset, e.g. a producer's retry.
"""

import numpy as np

from consumers.scoring.state_store import StateStore


def not_yet_applied(
    store: StateStore, rows: np.ndarray, pos: np.ndarray, newest: dict[int, int]
) -> tuple[np.ndarray, dict, list[int]]:
    """rows [N] (store rows), pos [N, 2] (partition, offset), newest {partition: the highest offset read
    from it so far, this batch's included} -> keep [N] bool, {row: (partition, offset)} of each account's
    last kept event, and the events whose account's last applied position was past `newest`.

    An event is kept when its offset is past its account's last applied one in the same partition, events
    kept earlier in this batch included. An account's events come from one partition (the topic is keyed by
    account); an event from another partition is applied and moves the account there. A last applied
    position past every offset read from its partition is one no event gave (a corrupt state record): it
    would drop every later event of the account as applied already, so the event is kept, and named in the
    third list, and its position replaces that one.
    """
    # A plain loop over plain ints: a few hundred events, well under a millisecond.
    last: dict[int, tuple[int, int]] = {}
    keep = np.ones(len(rows), dtype=bool)
    ahead: list[int] = []
    partitions, offsets = pos[:, 0].tolist(), pos[:, 1].tolist()
    known = zip(store.partition[rows].tolist(), store.offset[rows].tolist(), strict=True)
    for i, (row, partition, offset, before) in enumerate(
        zip(rows.tolist(), partitions, offsets, known, strict=True)
    ):
        last_partition, last_offset = last.get(row, before)
        if partition == last_partition and offset <= last_offset:
            if last_offset <= newest[partition]:
                keep[i] = False
                continue
            ahead.append(i)
        last[row] = (partition, offset)
    return keep, last, ahead


def replayed(store: StateStore, rows: np.ndarray, hashes: np.ndarray, keep: np.ndarray) -> list[int]:
    """Kept events (keep [N] bool) whose id hash (hashes [N] uint64) is in their account's ring, or at an
    earlier event of this batch: their indexes, ascending."""
    index = np.flatnonzero(keep)
    if len(index) == 0:
        return []
    known = (store.recent_ids[rows[index]] == hashes[index, None]).any(axis=1)
    found = set(index[known].tolist())
    seen: set[tuple[int, int]] = set()
    for i, pair in zip(
        index.tolist(), zip(rows[index].tolist(), hashes[index].tolist(), strict=True), strict=True
    ):
        if pair in seen:
            found.add(i)
        seen.add(pair)
    return sorted(found)
