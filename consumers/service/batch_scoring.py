"""A polled batch -> a ScoredBatch: every record its transaction will write, in send order.

In memory only: nothing is sent here (consumers/service/commit_pipeline.py sends it once the previous batch's commit
has returned). In order:
1. every `terminal_feed_interval_ms`, the labels and the other instances' terminal deltas that have arrived
   are applied to the terminal state (consumers/terminals/feed.py; records of either that do not decode are
   skipped, and the table writer dead-letters them);
2. each message is decoded and validated (bad ones: dead letters with the reason and the original bytes);
   accounts of the batch that memory let go of are read back from the changelog (consumers/service/dormant.py);
3. Scorer.score, in partition order (one partition's records keep their order);
4. records: scores (and alerts) to the input event's partition number, the batch's terminal delta (keyed by
   this instance's session, consumers/terminals/deltas.py), then the changed accounts' states to the
   changelog partition of the event that changed them.
"""

import math
import time
from collections.abc import Callable

from kafka.structs import OffsetAndMetadata

from consumers.runtime.settings import ServeConfig
from consumers.scoring.messages import MessageError, dead_letter_value, decode_transaction, encode_scores
from consumers.scoring.scorer import Scorer
from consumers.service.commit_pipeline import ScoredBatch
from consumers.service.dormant import DormantStates, Place
from consumers.terminals.deltas import encode_deltas
from consumers.terminals.feed import FeedReader


class BatchScorer:
    def __init__(
        self,
        cfg: ServeConfig,
        scorer: Scorer,
        feed: FeedReader,
        model_version: str,
        co_partitioned: bool,
        dormant: DormantStates,
        read_states: Callable[[dict[str, Place]], dict[str, bytes]],
    ):
        self.scorer, self.feed = scorer, feed
        self.session = b""  # the key of this instance's deltas since its last restore (set by the service)
        self.dormant, self.read_states = (
            dormant,
            read_states,
        )  # read_states: consumers.runtime.compacted.read_at
        self.seq = 0  # the last batch's
        self.feed_interval_s = cfg.terminal_feed_interval_ms / 1000
        self.feed_read_at = -math.inf  # time.monotonic() of the last read of the feed
        self.model_version = model_version
        # Scores and alerts go to their input event's partition number when the topics have as many
        # partitions as `transactions` (those the service creates do): the key's partition under the default
        # partitioner, without kafka-python's pure-Python murmur2 per record (~10 us of a ~40 us send).
        self.co_partitioned = co_partitioned
        self.scores_topic, self.alerts_topic = cfg.topic("scores"), cfg.topic("alerts")
        self.dead_letter_topic, self.changelog, self.deltas_topic = (
            cfg.topic("dead_letter"), cfg.topic("changelog"), cfg.topic("terminal_deltas")
        )  # fmt: skip

    def score(self, batch: dict) -> ScoredBatch:
        """Decode, apply labels, score and encode a polled batch ({TopicPartition: records})."""
        started = time.monotonic()
        self.seq += 1
        out = ScoredBatch(batch, seq=self.seq)
        out.labels_applied, out.deltas_applied = self.fold_feed()  # they count for all this batch's events
        transactions, positions, created_ms = [], [], []
        for tp in sorted(batch, key=lambda tp: tp.partition):  # one partition's records keep their order
            for record in batch[tp]:
                out.offsets[tp] = OffsetAndMetadata(record.offset + 1, "", -1)
                out.events += 1
                try:
                    if record.value is None:
                        raise MessageError("null value (a tombstone): expected a JSON transaction")
                    transactions.append(decode_transaction(record.value))
                    positions.append((record.partition, record.offset))
                    created_ms.append(record.timestamp)
                except MessageError as error:
                    self._dead_letter(out, record, error)
        self._bring_back(out, {tx.account_id for tx in transactions})
        dropped_before = self.scorer.stats.duplicates_dropped
        decoded = time.monotonic()
        scores = self.scorer.score(transactions, positions)
        scored = time.monotonic()
        out.duplicates_dropped = self.scorer.stats.duplicates_dropped - dropped_before
        partition_of = {}
        for s, value in zip(scores, encode_scores(scores, self.model_version), strict=True):
            partition = s.position[0] if self.co_partitioned else None
            out.records.append((self.scores_topic, s.account_id, value, partition))
            if s.alert:
                out.records.append((self.alerts_topic, s.account_id, value, partition))
                out.alerts += 1
            partition_of[s.account_id] = s.position[0]
        out.scored = len(scores)
        created = dict(zip(positions, created_ms, strict=True))  # duplicates dropped: no score
        out.created_ms = [created[s.position] for s in scores]
        # This batch's terminal event counts, for the other instances and the table writer.
        deltas = encode_deltas(self.scorer.featurizer.take_terminal_journal())
        if deltas is not None:
            out.records.append((self.deltas_topic, self.session, deltas, None))
        # Only now forget the changed set: should anything below fail, the rewind evicts and restores.
        changed = sorted(self.scorer.take_changed())
        for account, state in zip(changed, self.scorer.account_states_bytes(changed), strict=True):
            out.records.append((self.changelog, account, state, partition_of[account]))
        out.seconds = {
            "decode": decoded - started,
            "score": scored - decoded,
            "encode": time.monotonic() - scored,
        }
        return out

    def _bring_back(self, out: ScoredBatch, accounts: set[str]) -> None:
        """Read the states of the batch's dormant accounts back from the changelog (consumers/service/dormant.py)."""
        self.dormant.touched(accounts, out.seq)
        returning = self.dormant.returning(accounts, self.scorer.accounts_in_memory)
        if not returning:
            return
        for account, value in self.read_states(returning).items():
            self.scorer.restore_account(account, value)
        out.reloaded = len(returning)

    def _dead_letter(self, out: ScoredBatch, record, error: MessageError) -> None:
        out.records.append((self.dead_letter_topic, record.key, dead_letter_value(record, error), None))
        out.dead_lettered += 1

    def fold_feed(self) -> tuple[int, int]:
        """Fold in the labels and the other instances' deltas that have arrived, when `terminal_feed_interval_ms`
        has passed since the last read (the service also calls it when a poll brings nothing, so an idle
        instance keeps up); (labels, deltas) folded."""
        now = time.monotonic()
        if now - self.feed_read_at < self.feed_interval_s:
            return 0, 0
        self.feed_read_at = now
        got = self.feed.read(self.session)
        got.fold_into(self.scorer.featurizer)
        return len(got.labels), len(got.deltas)
