"""Bounded per-key state for the streaming featurizer: fixed-size numpy records keyed by account or terminal.

A record's size never depends on history length, and its bytes are the unit the stream stores and restores
(state changelog, restore on partition assignment). Each day-ring holds RING_DAYS daily buckets: bucket
`day % RING_DAYS` belongs to `day`, and a bucket holding an older day is recycled when a newer day arrives.
"""

import json
import struct
from collections import Counter

import numpy as np

from pipeline.features.definitions import (
    DAY_US,
    FEATURE_VERSION,
    REMEMBERED_REPORTS,
    RING_DAYS,
    SEEN_TERMINAL_BITS,
    WINDOW_DAYS,
)

STATE_VERSION = 1
# The last day (in 4840) the stream's composite keys hold: callers keep days within.
MAX_EPOCH_DAY = (1 << 20) - 1
MAX_TS_US = (MAX_EPOCH_DAY + 1) * DAY_US - 1
_MAGIC = b"TXSF"
_HEADER = struct.Struct("<4sHHI")  # magic, state version, feature version, json header length

ACCOUNT_STATE = np.dtype(
    [
        ("count", "<i8"),  # events seen, all history
        ("sum_log_amount", "<f8"),
        ("sumsq_log_amount", "<f8"),
        ("last_ts_us", "<i8"),
        ("max_day", "<i4"),  # latest day seen; a late event's windows end here
        ("day", "<i4", (RING_DAYS,)),  # epoch day of each bucket, -1 = empty
        ("day_count", "<i4", (RING_DAYS,)),
        ("day_amount", "<f8", (RING_DAYS,)),
        ("seen_terminals", "u1", (SEEN_TERMINAL_BITS // 8,)),  # bitset of seen_bucket(terminal)
    ]
)
TERMINAL_STATE = np.dtype(
    [
        ("max_day", "<i4"),
        ("day", "<i4", (RING_DAYS,)),
        ("day_count", "<i4", (RING_DAYS,)),
        ("report_day", "<i4", (RING_DAYS,)),  # day of label_ts of fraud reports
        ("report_count", "<i4", (RING_DAYS,)),
        # The events reported here (LabelBatch.report_keys: account and event id hashed, 0 = empty), the label
        # day each report counts on, and each event's verdict: its newest label, 2 * label day + 1 when it says
        # not fraud (-1 = empty). Kept sorted by (verdict, event): a repeated label finds its event here and is
        # not counted again, a withdrawal uncounts it (pipeline/features/report_memory.py).
        ("reported_event", "<u8", (REMEMBERED_REPORTS,)),
        ("reported_day", "<i4", (REMEMBERED_REPORTS,)),
        ("reported_verdict", "<i4", (REMEMBERED_REPORTS,)),
    ]
)


def empty_record(dtype: np.dtype) -> np.ndarray:
    record = np.zeros((), dtype=dtype)
    for name in dtype.names:
        if name.endswith(("day", "verdict")):
            record[name] = -1
    return record


class StateTable:
    """Records of one dtype in a growable array, addressed by key through a dict of slots."""

    def __init__(self, dtype: np.dtype, capacity: int = 1024):
        self.dtype = dtype
        self._empty = empty_record(dtype)
        self.records = np.repeat(self._empty[None], capacity, axis=0)
        self.slot_of: dict[str, int] = {}
        self._free: list[int] = []
        # Doubling stops here once (None: never); should more records still be needed, it doubles on from
        # there. A holder that caps its keys sets it (consumers/terminals/idle.py), so that the records of
        # 5M terminals do not take the 8.4M a power of two would.
        self.row_limit: int | None = None

    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, key: str) -> bool:
        return key in self.slot_of

    def __iter__(self):
        return iter(list(self.slot_of))

    def slots(self, keys: list[str]) -> np.ndarray:
        """[N] slot of each key, creating empty records for new keys."""
        found = list(map(self.slot_of.get, keys))  # C-speed look-ups; None for keys never seen
        if None in found:
            for i, slot in enumerate(found):
                if slot is None:
                    # A key repeated within `keys` is allocated once, at its first occurrence.
                    found[i] = self.slot_of.get(keys[i])
                    if found[i] is None:
                        found[i] = self._allocate(keys[i])
        return np.array(found, dtype=np.int64)

    def add(self, keys: list[str]) -> np.ndarray:
        """[N] slots with empty records for N distinct keys not in the table, in one block where the free
        list runs out (a restore adds a million keys)."""
        start = len(self.slot_of) + len(self._free)  # slots below it are handed out or free
        reused = [self._free.pop() for _ in range(min(len(self._free), len(keys)))]
        block = len(keys) - len(reused)
        if start + block > len(self.records):
            self._grow(start + block - len(self.records))
        slots = np.concatenate(
            [np.asarray(reused, dtype=np.int64), np.arange(start, start + block, dtype=np.int64)]
        )
        self.records[slots] = self._empty
        self.slot_of.update(zip(keys, slots.tolist(), strict=True))
        return slots

    def _allocate(self, key: str) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self.slot_of)
            if slot >= len(self.records):
                self._grow(1)
        self.records[slot] = self._empty
        self.slot_of[key] = slot
        return slot

    def _grow(self, at_least: int) -> None:
        # Doubling (or `at_least` records more at once: a block), stopping at row_limit.
        added = max(len(self.records), at_least)
        if self.row_limit is not None and len(self.records) < self.row_limit:
            added = min(added, max(self.row_limit - len(self.records), at_least))
        self.records = np.concatenate([self.records, np.repeat(self._empty[None], added, axis=0)])

    def get_bytes(self, key: str) -> bytes | None:
        slot = self.slot_of.get(key)
        return None if slot is None else self.records[slot].tobytes()

    def put_bytes(self, key: str, data: bytes) -> None:
        if len(data) != self.dtype.itemsize:
            raise ValueError(
                f"state record for {key!r} is {len(data)} bytes; this featurizer's records are "
                f"{self.dtype.itemsize} bytes (state version {STATE_VERSION})"
            )
        slot = self.slots([key])[0]
        self.records[slot] = np.frombuffer(data, dtype=self.dtype)[0]

    def evict(self, key: str) -> None:
        slot = self.slot_of.pop(key)
        self._free.append(slot)


def add_to_ring(
    records: np.ndarray,
    slots: np.ndarray,
    days: np.ndarray,
    values: dict[str, np.ndarray],
    day_field: str = "day",
) -> None:
    """Add per-(slot, day) totals into day-rings: values[name] is added to the bucket of `day` in field `name`.

    Rows for the same slot and bucket would race in a vectorised write, so per slot only the newest day of
    each bucket is kept: an older day in the same bucket is >= RING_DAYS older, outside every window of
    every later event.
    """
    if len(slots) == 0:
        return
    bucket = days % RING_DAYS
    order = np.lexsort((-days, bucket, slots))  # by slot, bucket, newest day first
    slots, bucket, days = slots[order], bucket[order], days[order]
    first = np.ones(len(slots), dtype=bool)
    first[1:] = (slots[1:] != slots[:-1]) | (bucket[1:] != bucket[:-1])
    slots, bucket, days = slots[first], bucket[first], days[first]
    held = records[day_field][slots, bucket]
    newer = days > held
    same = days == held
    for name, value in values.items():
        field = records[name]
        value = value[order][first].astype(field.dtype)
        field[slots[newer], bucket[newer]] = value[newer]
        field[slots[same], bucket[same]] += value[same]
    records[day_field][slots[newer], bucket[newer]] = days[newer]


def ring_window_sums(
    records: np.ndarray, slots: np.ndarray, days: np.ndarray, fields: tuple[str, ...], day_field: str
) -> dict[int, list[np.ndarray]]:
    """For each window d in WINDOW_DAYS: [sum over buckets with day in D-d+1 .. D of each field], per (slot, D).

    One masked contraction for all windows and fields: masks [windows, N, RING_DAYS] against values
    [fields, N, RING_DAYS]. Sums are float64 (counts stay exact far beyond any real count).
    """
    held = records[day_field][slots]  # [N, R]
    age = days[:, None] - held  # 0 = today; negative = a newer day (a late event); empty buckets are huge
    windows = np.asarray(WINDOW_DAYS)[:, None, None]
    masks = ((age[None] >= 0) & (age[None] < windows)).astype(np.float64)  # [Wn, N, R]
    values = np.stack([records[field][slots] for field in fields]).astype(np.float64)  # [K, N, R]
    sums = np.einsum("wnr,knr->wkn", masks, values)  # [Wn, K, N]
    return {d: list(sums[i]) for i, d in enumerate(WINDOW_DAYS)}


def encode_tables(tables: dict[str, StateTable]) -> bytes:
    """Whole-featurizer snapshot: header, key lists, then every table's records in key order."""
    header: dict = {name: list(table) for name, table in tables.items()}
    header["record_bytes"] = {name: table.dtype.itemsize for name, table in tables.items()}
    header_bytes = json.dumps(header).encode("utf-8")
    parts = [_HEADER.pack(_MAGIC, STATE_VERSION, FEATURE_VERSION, len(header_bytes)), header_bytes]
    for name, table in tables.items():
        slots = np.array([table.slot_of[k] for k in header[name]], dtype=np.int64)
        parts.append(table.records[slots].tobytes())
    return b"".join(parts)


def read_snapshot(data: bytes, dtypes: dict[str, np.dtype]) -> dict[str, tuple[list[str], np.ndarray]]:
    """Each table's keys [K] and records [K] (of dtypes[name]) in a snapshot written by encode_tables.

    Refuses, naming what is wrong, another version, records of another size, and bytes that are no snapshot
    of this layout: a short or garbled header, keys that are not distinct strings, fewer or more record bytes
    than the keys take. Whether the records hold what events fold is the caller's to check
    (record_checks.py: StreamingFeaturizer.from_bytes)."""
    where = "featurizer state snapshot"
    if len(data) < _HEADER.size or bytes(data[:4]) != _MAGIC:
        raise ValueError(
            f"not a txsentinel {where} (starts with {bytes(data[:4])!r}, expected {_MAGIC!r}, {len(data)} bytes)"
        )
    _, state_version, feature_version, header_len = _HEADER.unpack_from(data)
    if (state_version, feature_version) != (STATE_VERSION, FEATURE_VERSION):
        raise ValueError(
            f"featurizer state is state v{state_version} / features v{feature_version}; this txsentinel "
            f"runs state v{STATE_VERSION} / features v{FEATURE_VERSION}. Rebuild the state by replaying "
            "history with the current version."
        )
    offset = _HEADER.size + header_len
    if offset > len(data):
        raise ValueError(
            f"{where}: its header announces {header_len} bytes of keys, {len(data) - _HEADER.size} follow: "
            "the snapshot is truncated"
        )
    try:
        header = json.loads(data[_HEADER.size : offset])
    except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, or nested past the parser
        raise ValueError(f"{where}: its header is not JSON ({error}): the snapshot is corrupt") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: its header is {type(header).__name__}, expected a JSON object")
    # Written before the record sizes were: accounts of 580 bytes, terminals of 484 (before they remembered
    # their reported events; 868 bytes before they remembered their verdicts).
    sizes = header.get("record_bytes", {"accounts": 580, "terminals": 484})
    for name, dtype in dtypes.items():
        size = sizes.get(name) if isinstance(sizes, dict) else None
        if size != dtype.itemsize:
            raise ValueError(
                f"{where} holds {name} records of {size} bytes; this txsentinel's are {dtype.itemsize} bytes. "
                "Rebuild the state by replaying history with the current version."
            )
    out = {}
    for name, dtype in dtypes.items():
        keys = header.get(name)
        if not isinstance(keys, list) or not all(isinstance(key, str) for key in keys):
            raise ValueError(f"{where}: its {name} are {str(keys)[:80]}, expected a list of keys (strings)")
        if len(set(keys)) != len(keys):
            repeated = next(key for key, n in Counter(keys).items() if n > 1)
            raise ValueError(
                f"{where}: {name} key {repeated[:100]!r} appears more than once, expected each once"
            )
        size = len(keys) * dtype.itemsize
        if offset + size > len(data):
            raise ValueError(
                f"{where}: {len(keys)} {name} take {size} bytes, {len(data) - offset} follow: the snapshot is "
                "truncated"
            )
        out[name] = (keys, np.frombuffer(data, dtype=dtype, count=len(keys), offset=offset))
        offset += size
    if offset != len(data):
        raise ValueError(f"{where} has {len(data) - offset} trailing bytes")
    return out
