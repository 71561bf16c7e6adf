"""A shadow challenger: a second detector stepped on every event the champion applies, with states of its own.

The featurizer is the champion's (one per Scorer): both models read the same feature rows, so a challenger
whose features differ (names, feature version, windows, terminal buckets) is refused; its own normalisation
statistics are used, so a challenger fitted on another training period is fine. Per micro-batch the Scorer
hands over the applied events' raw feature rows in arrival order, after its own step, and the shadow steps
its detector over them the same way (rounds of one event per account).

Its states are its own: a StateStore of its detector. Everything else in an account's record (last applied
position, newest ts, recent event ids, the featurizer record) is the champion's, copied after each batch,
since both applied the same events. So each shadow record (account_state.py's layout, the challenger's
detector state and fingerprint) is a whole account state of the challenger: promoted, it serves from
these records as from its own, with no replay.

A shadow record is kept on restore only when its last applied position is the champion's: a shadow that was
stopped while the champion went on holds older states, which would skip the events in between; such an
account starts afresh in the shadow (counted in `stale`), as does one whose record is corrupt (counted in
`corrupt`, logged). Records of another model are refused.
The shadow never raises alerts: `alert` in its scores says where its threshold would have put one.
"""

import logging
from collections.abc import Sequence

import numpy as np
import torch

from consumers.scoring.account_state import (
    CorruptRecordError,
    bad_account_records,
    decode_account_record,
    decode_account_records,
    encode_account_records,
    events_folded,
    model_fingerprint,
)
from consumers.scoring.state_store import StateStore
from models.state_codec import StateRecordError, decode_account_state, decode_state_rows, encode_state_rows
from pipeline.features.spec import FeatureSpec
from pipeline.registry.artifact import DEFAULT_THRESHOLD, LoadedModel

# What makes two feature specs compute the same rows (the normalisation statistics may differ).
SAME_FEATURES = ("version", "names", "window_days", "terminal_buckets", "seen_terminal_bits")

log = logging.getLogger(__name__)


def check_same_features(champion: FeatureSpec, challenger: FeatureSpec, name: str) -> None:
    """Refuse a challenger whose feature rows would differ from the champion's (they share the featurizer)."""
    differs = [
        f"{k}: champion {getattr(champion, k)!r}, shadow {getattr(challenger, k)!r}"
        for k in SAME_FEATURES
        if getattr(champion, k) != getattr(challenger, k)
    ]
    if differs:
        raise ValueError(
            f"shadow model {name!r} computes other features than the served model ({'; '.join(differs)}): a "
            "shadow reads the served model's feature rows. Retrain the challenger with this txsentinel's "
            "features, or compare the two offline (txsentinel compare)"
        )


class ShadowModel:
    """The challenger's detector, its states and its threshold (module docstring)."""

    def __init__(self, model: LoadedModel, champion_spec: FeatureSpec, threshold: float | None = None):
        name = model.source or model.detector.name
        check_same_features(champion_spec, model.spec, name)  # first: this message names the shadow
        model.spec.check_compatible()
        weights = next(model.detector.parameters()).dtype
        if weights not in (torch.float32, torch.float64):
            raise ValueError(
                f"shadow model {name!r} has {weights} weights; serving state must be float32 at least: "
                "cast it first (model.detector.float())"
            )
        self.name = name
        self.detector = model.detector.eval()
        self.spec = model.spec
        self.threshold = float(
            model.meta.get("threshold", DEFAULT_THRESHOLD) if threshold is None else threshold
        )
        self.version = str(model.meta.get("model_version", model.source or model.name))
        self.store = StateStore(self.detector)
        self.model_fingerprint = model_fingerprint(self.detector)
        self.stale = 0  # records refused on restore: behind the champion's position
        self.corrupt = 0  # records refused on restore: holding what no events give
        self._dtype = weights

    @torch.inference_mode()
    def step(self, accounts: Sequence[str], features: np.ndarray, buckets: np.ndarray) -> np.ndarray:
        """Logits [M] float64 of the applied events (arrival order): features [M, F] float64 raw, buckets [M]."""
        rows = self.store.rows(accounts)  # [M]; accounts new to the shadow start from init_state
        x = np.concatenate([self.spec.normalize(features), buckets[:, None].astype(np.float32)], axis=1)
        x = torch.from_numpy(x).to(device=self.detector.device, dtype=self._dtype)  # [M, F + 1]
        logit = self.store.step(rows, x).to("cpu", torch.float64).numpy()
        if not np.isfinite(logit).all():
            raise FloatingPointError(
                f"shadow model {self.name!r} scored an event non-finite: its state is not either. A fault of "
                "the model, not of the input"
            )
        return logit

    def mirror(self, accounts: Sequence[str], champion: StateStore) -> None:
        """Copy the champion's bookkeeping of `accounts` (held by both) into the shadow's rows."""
        if not accounts:
            return
        mine = self.store.rows(accounts)
        theirs = champion.rows(accounts)
        for name in ("partition", "offset", "last_ts_us", "recent_ids", "recent_next"):
            getattr(self.store, name)[mine] = getattr(champion, name)[theirs]

    @torch.inference_mode()
    def states_bytes(self, accounts: Sequence[str], features: np.ndarray) -> list[bytes]:
        """The shadow's state record of each account; features: their featurizer records, in that order."""
        if not accounts:
            return []
        rows = self.store.rows(accounts)
        s = self.store
        return encode_account_records(
            features,
            encode_state_rows(self.detector, s.gather(rows)),
            self.model_fingerprint,
            s.partition[rows],
            s.offset[rows],
            s.last_ts_us[rows],
            s.recent_ids[rows],
            s.recent_next[rows],
        )

    @torch.inference_mode()
    def restore(self, accounts: Sequence[str], values: Sequence[bytes], champion: StateStore) -> int:
        """Load shadow records of accounts the champion holds; those behind the champion's position (or of an
        account it does not hold) are left out. Returns how many were loaded. Raises ValueError for a
        record of another model."""
        held = [(a, v) for a, v in zip(accounts, values, strict=True) if a in champion and v is not None]
        if not held:
            return 0
        ids = [a for a, _ in held]
        chunk = [v for _, v in held]
        records = decode_account_records(chunk)
        if records is None:  # several layouts: one at a time
            return sum(self._restore_one(a, v, champion) for a, v in held)
        foreign = np.flatnonzero(records["header"]["model"] != self.model_fingerprint)
        refused = sorted({*bad_account_records(records).tolist(), *foreign.tolist()})
        for at in refused:  # raises for another model, saying what is wrong; a corrupt one is left out
            self._restore_one(ids[at], chunk[at], champion)
        theirs = champion.rows(ids)
        header = records["header"]
        current = (header["partition"] == champion.partition[theirs]) & (
            header["offset"] == champion.offset[theirs]
        )
        current[refused] = False
        self.stale += int((~current).sum()) - len(refused)
        keep = np.flatnonzero(current)
        while len(keep):
            try:
                most = events_folded(records["features"][keep])
                state = decode_state_rows(self.detector, records["detector"][keep], most)
                break
            except StateRecordError as error:  # -> the accounts' names; corrupt ones are left out
                for at in keep[list(error.rows)].tolist():
                    self._restore_one(ids[at], chunk[at], champion)  # raises unless corrupt
                keep = np.delete(keep, list(error.rows))
        if len(keep) == 0:
            return 0
        rows = self.store.rows([ids[i] for i in keep.tolist()])
        self.store.scatter(rows, state)
        self.mirror([ids[i] for i in keep.tolist()], champion)
        return len(keep)

    def _restore_one(self, account: str, value: bytes, champion: StateStore) -> bool:
        """Load one shadow record when current; False when stale or corrupt (left out, its account's shadow
        starting again from no history: logged, counted in `corrupt`). ValueError for another model's."""
        try:
            record = decode_account_record(value, account)
        except CorruptRecordError as error:
            return self._left_out(f"shadow {error}")
        if record.model != self.model_fingerprint:
            raise ValueError(
                f"shadow state record of {account!r} was written by another model (fingerprint "
                f"{record.model.hex()}, the shadow {self.name!r} is {self.model_fingerprint.hex()}): the shadow "
                "changelog topic is named after its model's fingerprint, so another model wrote into it. Delete "
                "the topic to start the shadow afresh"
            )
        try:
            state = decode_account_state(self.detector, record.detector, events_folded(record.features))
        except StateRecordError as error:
            if error.corrupt:
                return self._left_out(f"shadow state record of {account!r}: {error.reason}")
            raise ValueError(f"shadow state record of {account!r}: {error}") from None
        row = champion.rows([account])
        if (record.partition, record.offset) != (
            int(champion.partition[row[0]]),
            int(champion.offset[row[0]]),
        ):
            self.stale += 1
            return False
        self.store.scatter(self.store.rows([account]), state)
        self.mirror([account], champion)
        return True

    def _left_out(self, why: str) -> bool:
        self.corrupt += 1
        log.error("shadow state record refused, the account's shadow starts again from no history: %s", why)
        return False

    def evict(self, account: str) -> None:
        if account in self.store:
            self.store.evict(account)
