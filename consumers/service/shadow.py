"""The shadow challenger's topics, records and restores in the service (the model itself: consumers/scoring/shadow.py).

`serve --shadow URI` steps a second model on every event of every batch (Scorer(shadow=...)). What that
adds to each batch's ONE transaction, beside the champion's records:
- the challenger's score of each scored event to `shadow_scores` (the scores' layout, its own model_version;
  `alert` says where its threshold would have put one: it never writes to `alerts`);
- each changed account's challenger state record to the shadow changelog, at the same partition as the
  champion's, so both models' states commit, or abort, with the same offsets: exactly once for both.

The shadow changelog is a topic of its own, named after the challenger's fingerprint:
`<changelog_topic>.<16 hex digits>`. Not model-keyed records in the champion's changelog: a restore of the
champion would read (and skip) every challenger record, the memory cap's places would need the model in
them, and, above all, promotion would have to pick one model's records out of a mixed topic. With a topic
per model, promotion is only a name: a served model whose shadow changelog exists serves from it
(`changelog_for`), so moving the alias and restarting makes the challenger the champion with the states it
built in shadow, and nothing is replayed. The old champion's changelog stays as it was, behind: to go back
to it, run it in shadow first and promote it the same way.

On assignment, the challenger's records of the new partitions are read after the champion's and kept when
current (ShadowModel.restore); the places of all of them are noted, as the champion's are
(consumers/service/dormant.py), so a dormant account returns with both states.
"""

import logging
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from kafka import KafkaAdminClient

from consumers.runtime.compacted import Reader, high_watermarks, offset_span, read_chunks, read_places
from consumers.runtime.settings import ServeConfig
from consumers.runtime.topics import COMPACTED_CONFIG, create_topic, partition_count
from consumers.scoring.outputs import encode_scores
from consumers.scoring.results import ScoreRecord
from consumers.scoring.scorer import Scorer
from consumers.service.dormant import DormantStates, Place, changelog_places
from consumers.service.state_restore import CHUNK_BYTES

log = logging.getLogger(__name__)


def shadow_changelog(cfg: ServeConfig, fingerprint: bytes) -> str:
    """The changelog topic of a model served in shadow: the changelog's name and the model's fingerprint."""
    return f"{cfg.topic('changelog')}.{fingerprint.hex()}"


def changelog_for(cfg: ServeConfig, bootstrap: str, fingerprint: bytes) -> str:
    """The changelog the served model reads and writes: its shadow changelog when it ran in shadow before
    (promotion, module docstring), else changelog_topic."""
    promoted = shadow_changelog(cfg, fingerprint)
    admin = _admin(cfg, bootstrap)
    try:
        if promoted in set(admin.list_topics()):
            log.info(
                "this model ran in shadow: serving from the states it built there changelog=%s", promoted
            )
            return promoted
    finally:
        admin.close()
    return cfg.topic("changelog")


def ensure_shadow_topics(cfg: ServeConfig, bootstrap: str, changelog: str, partitions: int) -> None:
    """Create the shadow scores and changelog topics when missing; refuse a changelog of another partition
    count (state of input partition p lives in changelog partition p)."""
    admin = _admin(cfg, bootstrap)
    try:
        existing = set(admin.list_topics())
        scores = cfg.topic("shadow_scores")
        if scores not in existing:
            create_topic(admin, scores, partitions, cfg.replication_factor, {})
        if changelog not in existing:
            create_topic(admin, changelog, partitions, cfg.replication_factor, COMPACTED_CONFIG)
        found = partition_count(admin, changelog)
        if found != partitions:
            raise ValueError(
                f"shadow changelog topic {changelog!r} has {found} partitions, {cfg.topic('transactions')!r} "
                f"has {partitions}: they must match. Delete it to start the shadow afresh"
            )
    finally:
        admin.close()


class ShadowSide:
    """What the service does for the challenger: its output records, restores and places."""

    def __init__(self, cfg: ServeConfig, scorer: Scorer, capacity: int):
        self.scorer = scorer
        self.model = scorer.shadow
        self.changelog = shadow_changelog(cfg, self.model.model_fingerprint)
        self.scores_topic = cfg.topic("shadow_scores")
        self.timestamp_format = cfg.timestamp_format
        self.places = DormantStates(capacity)  # where/ends of the challenger's records; no recency kept

    def records(
        self, scored: Sequence[ScoreRecord], logits, partitions: Sequence[int | None]
    ) -> list[tuple[str, str, bytes, int | None]]:
        """The challenger's score record of each scored event (the champion's, with its logit)."""
        model = self.model
        mine = [
            ScoreRecord(
                r.event_id, r.account_id, r.ts_us, score, logit, score >= model.threshold, r.out_of_order
            )
            for r, logit, score in zip(scored, logits.tolist(), _sigmoid(logits), strict=True)
        ]
        values = encode_scores(mine, model.version, self.timestamp_format)
        return [
            (self.scores_topic, r.account_id, v, p) for r, v, p in zip(mine, values, partitions, strict=True)
        ]

    def state_records(self, changed: Sequence[str], partition_of: dict[str, int]) -> list:
        return [
            (self.changelog, account, state, partition_of[account])
            for account, state in zip(changed, self.scorer.shadow_states_bytes(changed), strict=True)
        ]

    def tombstones(self, accounts: Iterable[str]) -> list:
        """A tombstone for the challenger's record of each account the champion lets go that has one."""
        where = self.places.where
        return [(self.changelog, a, None, where[a][0]) for a in accounts if a in where]

    def restore(self, reader: Reader, partitions: list[int], timeout_s: float) -> tuple[int, int]:
        """Read the challenger's records of `partitions` (after the champion's restore): (kept, read)."""
        kept = read = 0
        where: dict[str, Place] = {}
        # Rows in one step, as for the champion: one per record the read can find, no more than the accounts
        # the champion holds (only theirs load)
        end = high_watermarks(reader, self.changelog, partitions)
        self.model.store.reserve(min(offset_span(reader, end), len(self.scorer.store.accounts())))
        for chunk in read_chunks(reader, self.changelog, partitions, timeout_s, CHUNK_BYTES, end):
            read += len(chunk)
            latest: dict[str, bytes] = {}
            for key, record in chunk:
                latest.pop(key, None)
                if record.value is None:
                    where.pop(key, None)
                    continue
                where[key] = (record.partition, record.offset)
                latest[key] = record.value
            for account in latest:
                self.model.evict(account)  # an earlier chunk's record of it is superseded
            kept += self.model.restore(list(latest), list(latest.values()), self.scorer.store)
        self.places.drop_partitions(partitions)
        self.places.committed(where)
        if self.model.stale:
            log.info(
                "shadow states behind the served model's start afresh accounts=%d (the shadow was stopped "
                "while the served model went on)", self.model.stale,
            )  # fmt: skip
        return kept, read

    def bring_back(
        self, accounts: Sequence[str], read: Callable[[str, dict[str, Place]], dict[str, bytes]]
    ) -> None:
        """The challenger's records of accounts the champion just read back (dormant or rewound ones)."""
        wanted = {a: self.places.where[a] for a in accounts if a in self.places.where}
        if wanted:
            values = read(self.changelog, wanted)
            self.model.restore(list(values), list(values.values()), self.scorer.store)

    def committed(self, records: Sequence, sent: Sequence) -> None:
        """Note where a committed batch's challenger records went (None: a tombstone)."""
        self.places.committed(changelog_places(records, sent, self.changelog))

    def read_tail(self, reader: Reader, partitions: list[int], timeout_s: float) -> int:
        """After an abort: the records past those known here (a commit that landed after all)."""
        ends = {p: self.places.ends.get(p, 0) for p in partitions}
        places, read = read_places(reader, self.changelog, ends, timeout_s)
        self.places.committed(places)
        return read


def _sigmoid(logits: np.ndarray) -> list[float]:
    return (1.0 / (1.0 + np.exp(-np.clip(logits, -700, 700)))).tolist()  # clipped: no overflow warning


def _admin(cfg: ServeConfig, bootstrap: str) -> KafkaAdminClient:
    return KafkaAdminClient(
        bootstrap_servers=bootstrap,
        client_id="txsentinel-serve-admin",
        bootstrap_timeout_ms=cfg.bootstrap_timeout_ms,
        **cfg.kafka_security,
    )
