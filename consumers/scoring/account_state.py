"""One account's serving state as one versioned byte record: what the state changelog stores per account.

The record joins what the scorer keeps for an account in two places — the streaming featurizer's account
record and the detector's recurrent state — with the exactly-once bookkeeping: the last applied source
position (partition, offset), the newest event ts applied and the hashes of the account's last
RECENT_EVENT_IDS event ids (a producer's retry of an event at another offset is dropped by its id).
Restoring it reproduces the account exactly.

Layout (little-endian), version 2:

    MAGIC "TXSA" (4) | RECORD_VERSION (u16) | featurizer state version (u16) | feature version (u16)
    | model fingerprint (8) | partition (i32) | offset (i64) | last ts µs (i64)
    | recent ids count K (u16) | next recent slot (u16)
    | featurizer record length (u32) | detector record length (u32)
    | recent ids (K x u64, 0 = empty, a ring) | featurizer record (pipeline.features.state.ACCOUNT_STATE bytes)
    | detector record (models.state_codec)

Version 1 had neither the two u16 nor the ids; it is still read, with an empty window (the account's
replays are then caught by offset only until it has applied K events).

The detector record carries its own header (detector name, config fingerprint, dtype). The model
fingerprint adds the weights: a state written under other weights of the same architecture (a retrained
model) is not a state of this model, even though its layout fits.
Bump RECORD_VERSION whenever this layout changes.
"""

import hashlib
import struct
from dataclasses import dataclass

import numpy as np
import torch

from models.contract import RecurrentDetector
from pipeline.features.definitions import FEATURE_VERSION
from pipeline.features.record_checks import record_fault, record_faults
from pipeline.features.state import ACCOUNT_STATE, MAX_TS_US
from pipeline.features.state import STATE_VERSION as FEATURIZER_STATE_VERSION

MAGIC = b"TXSA"
RECORD_VERSION = 2  # 2: the recent event ids joined the record
RECENT_EVENT_IDS = 16  # K: a producer retries within seconds, so an account's last 16 events hold its retries
NO_POSITION = -1  # partition and offset of an account with no applied source position
NO_TS = -(2**63)  # last_ts_us of an account with no event: older than any ts
_HEADER = struct.Struct("<4sHHH8siqqHHII")
_HEADER_V1 = struct.Struct("<4sHHH8siqqII")
_NO_IDS = bytes(8 * RECENT_EVENT_IDS)


_REBUILD = (
    "restore it with the model and txsentinel version that wrote it, or drop it and rebuild the account's "
    "state by replaying its history through this model"
)


@dataclass(frozen=True)
class AccountRecord:
    features: bytes  # the featurizer's account record (StateTable bytes, ACCOUNT_STATE dtype)
    detector: bytes  # models.state_codec.encode_account_state of the account's recurrent state
    model: bytes  # 8-byte model_fingerprint of the detector that wrote `detector`
    partition: int = NO_POSITION  # source partition of the last applied event
    offset: int = NO_POSITION  # its offset in that partition
    last_ts_us: int = NO_TS  # newest event ts applied to this account
    recent_ids: bytes = _NO_IDS  # event_id_hash of its last RECENT_EVENT_IDS events, u64 each, a ring
    recent_next: int = 0  # the ring's slot for the next event

    def to_bytes(self) -> bytes:
        header = _HEADER.pack(
            MAGIC,
            RECORD_VERSION,
            FEATURIZER_STATE_VERSION,
            FEATURE_VERSION,
            self.model,
            self.partition,
            self.offset,
            self.last_ts_us,
            RECENT_EVENT_IDS,
            self.recent_next,
            len(self.features),
            len(self.detector),
        )
        return header + self.recent_ids + self.features + self.detector


# _HEADER as a numpy record, to write the headers of many accounts at once (encode_account_records)
_HEADER_ROW = np.dtype(
    [
        ("magic", "S4"),
        ("version", "<u2"),
        ("featurizer_state_version", "<u2"),
        ("feature_version", "<u2"),
        ("model", "S8"),
        ("partition", "<i4"),
        ("offset", "<i8"),
        ("last_ts_us", "<i8"),
        ("recent_count", "<u2"),
        ("recent_next", "<u2"),
        ("features_bytes", "<u4"),
        ("detector_bytes", "<u4"),
    ]
)
assert _HEADER_ROW.itemsize == _HEADER.size


def encode_account_records(
    features: np.ndarray,
    detector: np.ndarray,
    model: bytes,
    partition: np.ndarray,
    offset: np.ndarray,
    last_ts_us: np.ndarray,
    recent_ids: np.ndarray,
    recent_next: np.ndarray,
) -> list[bytes]:
    """AccountRecord(...).to_bytes() of N accounts at once, byte for byte: features [N] featurizer records
    (ACCOUNT_STATE), detector [N, bytes] (models.state_codec.encode_state_rows), partition, offset and
    last_ts_us [N], recent_ids [N, RECENT_EVENT_IDS] uint64 and recent_next [N]. The service writes a record per changed account per poll, ~280 of them at 500 events a
    poll; one at a time they cost ~8 us each."""
    n = len(features)
    header = np.zeros(n, dtype=_HEADER_ROW)
    header["magic"] = MAGIC
    header["version"] = RECORD_VERSION
    header["featurizer_state_version"] = FEATURIZER_STATE_VERSION
    header["feature_version"] = FEATURE_VERSION
    header["model"] = model
    header["partition"] = partition
    header["offset"] = offset
    header["last_ts_us"] = last_ts_us
    header["recent_count"] = RECENT_EVENT_IDS
    header["recent_next"] = recent_next
    header["features_bytes"] = features.dtype.itemsize
    header["detector_bytes"] = detector.shape[1]
    ids = np.ascontiguousarray(recent_ids, dtype="<u8").view(np.uint8).reshape(n, -1)
    records = np.concatenate(
        [header.view(np.uint8).reshape(n, -1), ids, features.view(np.uint8).reshape(n, -1), detector], axis=1
    )
    return [row.tobytes() for row in records]


class CorruptRecordError(ValueError):
    """An account state record of this model and version that holds what no events give (a NaN, a day out
    of range, a sum larger than its count of events allows, a position no event had, a truncated payload):
    its account can only start again from no history, where a record of another model or version is a
    deployment to fix."""


def decode_account_record(data: bytes, account_id: str = "?") -> AccountRecord:
    """Parse a record written by AccountRecord.to_bytes, checking its format and feature versions.

    Whether the detector part belongs to this model is checked by the scorer, which holds the model.
    Raises ValueError naming the account, what does not match and what to do; CorruptRecordError (a
    ValueError) for bytes that are no account state at all.
    """
    where = f"account state record of {account_id[:100]!r}"
    if len(data) < _HEADER_V1.size or not data.startswith(MAGIC):  # garbage: anyone can write the topic
        raise CorruptRecordError(
            f"{where}: not a txsentinel account state (starts with {bytes(data[:4])!r}, expected {MAGIC!r}, "
            f"{len(data)} bytes)"
        )
    version = struct.unpack_from("<H", data, 4)[0]
    if version == 1:  # before the recent event ids: read with an empty window
        (_, _, state_version, feature_version, model, partition, offset, last_ts, n_feat, n_det) = (
            _HEADER_V1.unpack_from(data)
        )
        n_ids, recent_next, start = 0, 0, _HEADER_V1.size
    elif version == RECORD_VERSION and len(data) >= _HEADER.size:
        (_, _, state_version, feature_version, model, partition, offset, last_ts, n_ids, recent_next, n_feat,
         n_det) = _HEADER.unpack_from(data)  # fmt: skip
        start = _HEADER.size
        if n_ids != RECENT_EVENT_IDS or recent_next >= n_ids:
            raise ValueError(
                f"{where}: a window of {n_ids} recent event ids (next slot {recent_next}), this txsentinel keeps "
                f"{RECENT_EVENT_IDS}; {_REBUILD}"
            )
    else:
        raise ValueError(
            f"{where}: record version {version}, this txsentinel reads versions 1 and {RECORD_VERSION}; {_REBUILD}"
        )
    if (state_version, feature_version) != (FEATURIZER_STATE_VERSION, FEATURE_VERSION):
        raise ValueError(
            f"{where}: featurizer state v{state_version} / features v{feature_version}, this txsentinel runs "
            f"state v{FEATURIZER_STATE_VERSION} / features v{FEATURE_VERSION}; {_REBUILD}"
        )
    if n_feat != ACCOUNT_STATE.itemsize:
        raise ValueError(
            f"{where}: featurizer record of {n_feat} bytes, expected {ACCOUNT_STATE.itemsize}; {_REBUILD}"
        )
    if len(data) != start + 8 * n_ids + n_feat + n_det:
        raise CorruptRecordError(
            f"{where}: {len(data)} bytes, but its header announces {start + 8 * n_ids + n_feat + n_det}: the "
            "record is truncated or corrupt"
        )
    features_at = start + 8 * n_ids
    features = bytes(data[features_at : features_at + n_feat])
    fault = _bookkeeping_fault(partition, offset, last_ts) or record_fault(
        np.frombuffer(features, dtype=ACCOUNT_STATE)[0]
    )
    if fault:
        raise CorruptRecordError(f"{where}: {fault}, which no events give: the record is corrupt; {_REBUILD}")
    return AccountRecord(
        features=features,
        detector=bytes(data[features_at + n_feat :]),
        model=model,
        partition=partition,
        offset=offset,
        last_ts_us=last_ts,
        recent_ids=bytes(data[start:features_at]) or _NO_IDS,
        recent_next=recent_next,
    )


def _bookkeeping_fault(partition: int, offset: int, last_ts_us: int) -> str | None:
    if _position_faults(partition, offset):
        return f"source position ({partition}, {offset}), expected a Kafka partition and offset"
    if _ts_faults(last_ts_us):
        return f"newest ts {last_ts_us}, expected 0..{MAX_TS_US} microseconds since the epoch"
    return None


# The header's bookkeeping rules, for one record (ints) or many ([N] arrays) alike.
def _position_faults(partition, offset):
    return (partition < NO_POSITION) | (offset < NO_POSITION)


def _ts_faults(last_ts_us):
    return (last_ts_us != NO_TS) & ((last_ts_us < 0) | (last_ts_us > MAX_TS_US))


def decode_account_records(values: list[bytes]) -> np.ndarray | None:
    """Version-2 records of N accounts as one structured array [N] (header, recent ids, featurizer record,
    detector record bytes): the inverse of encode_account_records, checked for the whole batch at once.

    None when they are not all version 2 of one length: decode those one by one (decode_account_record).
    Rows whose header is wrong are named by bad_account_records; this call does not raise for them.
    """
    if not values:
        return None
    length = len(values[0])
    detector_bytes = length - _HEADER.size - 8 * RECENT_EVENT_IDS - ACCOUNT_STATE.itemsize
    if detector_bytes <= 0 or any(len(v) != length for v in values):
        return None
    row = _record_row(detector_bytes)
    records = np.frombuffer(b"".join(values), dtype=row)  # [N], one copy of the batch's bytes
    if (records["header"]["version"] != RECORD_VERSION).any():
        return None  # version 1 among them: read one by one
    return records


def bad_account_records(records: np.ndarray) -> np.ndarray:
    """Positions of the rows of decode_account_records that decode_account_record would refuse."""
    header = records["header"]
    wrong = (
        (header["magic"] != MAGIC)
        | (header["featurizer_state_version"] != FEATURIZER_STATE_VERSION)
        | (header["feature_version"] != FEATURE_VERSION)
        | (header["recent_count"] != RECENT_EVENT_IDS)
        | (header["recent_next"] >= RECENT_EVENT_IDS)
        | (header["features_bytes"] != ACCOUNT_STATE.itemsize)
        | (header["detector_bytes"] != records.dtype["detector"].itemsize)
        | _position_faults(header["partition"], header["offset"])
        | _ts_faults(header["last_ts_us"])
        | record_faults(records["features"])
    )
    return np.flatnonzero(wrong)


def _record_row(detector_bytes: int) -> np.dtype:
    return np.dtype(
        [
            ("header", _HEADER_ROW),
            ("recent_ids", "<u8", (RECENT_EVENT_IDS,)),
            ("features", ACCOUNT_STATE),
            ("detector", np.uint8, (detector_bytes,)),
        ]
    )


def events_folded(features: np.ndarray | bytes) -> torch.Tensor:
    """[N] int64: the events each featurizer record [N] (ACCOUNT_STATE, or one record's bytes) folded, the
    most its account's detector state can have stepped: the scorer folds every event it steps (a shadow's
    states, started later, stepped fewer). A restore holds the detector record to it (models/state_codec.py)."""
    if isinstance(features, bytes):
        features = np.frombuffer(features, dtype=ACCOUNT_STATE)
    return torch.from_numpy(np.array(features["count"], dtype=np.int64))  # a copy, its own strides


def model_fingerprint(detector: RecurrentDetector) -> bytes:
    """8 bytes identifying detector name, config and weights: the states a model writes are its own."""
    digest = hashlib.sha256(detector.name.encode() + detector.config.fingerprint())
    with torch.no_grad():
        for key, value in sorted(detector.state_dict().items()):
            tensor = value.detach().to("cpu").contiguous()
            digest.update(f"{key}:{tensor.dtype}:{list(tensor.shape)}".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()[:8]
