"""Partitions coming and going, and the states this instance holds for them, read back from Kafka.

The group's assignor is cooperative and sticky (kafka-python's CooperativeStickyAssignor, KIP-429): a
rebalance moves only the partitions that must move, and an instance keeps the others, and their states
in memory, without a pause. The listener below hears only what changed:

- revoked (or lost) partitions: the batch in flight settles first, then their accounts leave memory;
- assigned partitions: paused, and restored by the poll loop before anything else (_catch_up), not in
  the listener, which runs on the consumer's network thread (kafka-python 3) where a long restore would
  hold up the heartbeats and a blocking consumer call is refused. In this order:
  1. the group's committed offsets of the new partitions are fetched (read_committed: the broker answers
     only once no transaction holds offsets for them, KIP-447), so a frozen predecessor's last batch
     is either in them or can no longer commit: its generation is fenced;
  2. changelog partition p is read from its beginning up to its end (read_committed, consumers/runtime/
     compacted.py keeps to restore_timeout_s and logs its progress), and every account of p is held, up
     to max_states_in_memory (the rest stay dormant in the changelog, consumers/service/dormant.py),
     applied in chunks as they stream in (consumers/service/state_restore.py);
  3. the consumer is sought to the offsets of step 1 and the partitions resumed.

After an aborted batch (_rewind), only its accounts leave memory: their last committed records come back
with their redelivered events, as a dormant account's do; the changelog is read only past the records
this instance knows of, in case the commit landed after all. The consumer is sought back to the
committed offsets before the next poll.

Terminal risk (consumers/terminals/table.py has the whole flow): on start, before joining the group, the
instance reads the terminal table, then the labels and every instance's terminal deltas after the table's
positions. Then, every terminal_feed_interval_ms (before a batch, or while idle), it folds in the labels
and the other instances' deltas that have arrived; after scoring, each batch's own terminal event counts go
out as one delta record in its transaction. Whichever instance owns transactions partition 0 also runs the table
writer (consumers/terminals/writer.py).
"""

import logging
import time
from collections.abc import Iterable

from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import KafkaTimeoutError
from kafka.structs import TopicPartition

from consumers.runtime.compacted import read_places
from consumers.service.commit_pipeline import Committed
from consumers.service.dormant import changelog_places
from consumers.service.state_restore import restore_partitions

log = logging.getLogger(__name__)


class _Listener(ConsumerRebalanceListener):
    # kafka-python calls these from inside poll(), between batches. The previous batch's commit may still be
    # running then: on_revoked settles it first, so no transaction stays open across a rebalance.
    def __init__(self, service: "Restore"):
        self.service = service

    def on_partitions_revoked(self, revoked):
        self.service.on_revoked(revoked)

    def on_partitions_assigned(self, assigned):
        self.service.on_assigned(assigned)

    def on_partitions_lost(self, lost):
        self.service.on_revoked(lost)


class Restore:
    """The rebalance and restore part of the service (loop._Service, whose __init__ and start() build the
    attributes used here)."""

    # -- rebalance ---------------------------------------------------------------------------------------
    def on_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self.rebalance_callbacks += 1
        partitions = sorted(tp.partition for tp in revoked if tp.topic == self.topic)
        self._settle_before_revoking(partitions)
        self._run_writer(partitions, assigned=False)
        evicted = 0
        for p in partitions:
            leaving = self.scorer.accounts_in_partition(p)
            for account in leaving:
                # No batch is open between polls, so nothing unsaved is lost; discard_changes only guards
                # against an account whose events would be redelivered anyway (uncommitted offsets).
                self.scorer.evict(account, discard_changes=True)
            self.dormant.forget(leaving)
            evicted += len(leaving)
        self.assigned -= set(partitions)
        self.to_restore -= set(partitions)
        self.to_seek -= set(partitions)
        self.dormant.drop_partitions(partitions)
        if self.shadow is not None:
            self.shadow.places.drop_partitions(partitions)
        if partitions:
            self.probes.wait_for(
                "partitions", "rebalancing: partitions revoked, waiting for the next assignment"
            )
            self.stats.rebalances += 1
        self.metrics.set("txsentinel_assigned_partitions", len(self.assigned))
        self.metrics.set("txsentinel_states_in_memory", len(self.scorer.accounts_in_memory))
        log.info("partitions revoked partitions=%s evicted_states=%d", partitions, evicted)

    def _settle_before_revoking(self, partitions: list[int]) -> None:
        """The batch in flight commits under the generation that is ending, or is aborted and rewound."""
        try:
            self._settle()
        except Exception as error:  # kafka-python logs and swallows callback errors: handled here
            failed = self.pipeline.take_failed()
            self._end_failed_transaction(error)
            log.warning("batch aborted at revocation error=%r; it is redelivered", error)
            self._rewind(failed.polled, revoked=partitions)

    def on_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        """New partitions wait, paused, for _catch_up (the module docstring says why not here)."""
        self.rebalance_callbacks += 1
        tps = [tp for tp in assigned if tp.topic == self.topic]
        partitions = sorted(tp.partition for tp in tps)
        log.info("partitions assigned partitions=%s", partitions)
        if partitions:
            self.stats.rebalances += 1
        beyond = [p for p in partitions if self._beyond(p)]
        if beyond:  # no changelog partition holds their states: nothing to restore, every record refused
            self._hold_beyond(beyond)
            tps = [tp for tp in tps if tp.partition not in beyond]
            partitions = [p for p in partitions if p not in beyond]
        self.consumer.pause(*tps)
        self.to_restore |= set(partitions)
        if self.to_restore:
            self.probes.wait_for(
                "partitions", f"restoring the states of partitions {sorted(self.to_restore)}"
            )
        else:
            self.probes.done("partitions")  # no partition at all is ready too: a spare member, idle
        self._run_writer(partitions, assigned=True)

    def _beyond(self, partition: int) -> bool:
        """Whether `partition` of `transactions` was added after this instance started (0: not known yet)."""
        return 0 < self.partitions <= partition

    def _hold_beyond(self, partitions: list[int]) -> None:
        """Partitions added to `transactions` after this instance started: read, and every record of them
        dead-lettered (BatchScorer._decode), so that the partitions it serves go on and nothing is lost."""
        log.error(
            "transactions partitions %s are beyond the %d this instance started with: %r has grown, so its "
            "keys now go to other partitions than the account states were kept by. Their records go to the "
            "dead-letter topic. Growing the partitions is a new deployment: a new topic_prefix with the new "
            "count, then replay (docs/operations.md, Instances and partitions)",
            partitions, self.partitions, self.topic,
        )  # fmt: skip
        self.assigned |= set(partitions)
        self.metrics.set("txsentinel_assigned_partitions", len(self.assigned))

    def _catch_up(self) -> None:
        """Before the next poll: restore what was assigned, seek back what was rewound (module docstring)."""
        if self.to_restore:
            partitions = sorted(self.to_restore)
            tps = [TopicPartition(self.topic, p) for p in partitions]
            try:
                committed = self._committed(
                    tps
                )  # before the changelog is read: step 1 of the module docstring
                # Every position a state of these partitions can hold lies below their log ends
                ends = self.consumer.end_offsets(tps)
                self.scorer.note_log_ends({tp.partition: end for tp, end in ends.items()})
                self._restore(partitions)
            except BaseException as error:
                self.probes.wait_for("partitions", f"restoring partitions {partitions} failed: {error!r}")
                raise
            self._seek(committed)
            self.consumer.resume(*tps)
            log.info(
                "partitions resumed partitions=%s from_offsets=%s",
                partitions, {tp.partition: committed[tp] for tp in tps},
            )  # fmt: skip
            self.to_restore.clear()
            self.to_seek -= set(partitions)
            self.assigned |= set(partitions)
            self.probes.done("partitions")
            self.metrics.set("txsentinel_assigned_partitions", len(self.assigned))
        if self.to_seek:
            self._seek(self._committed([TopicPartition(self.topic, p) for p in sorted(self.to_seek)]))
            self.to_seek.clear()

    def _committed(self, tps: list[TopicPartition]) -> dict[TopicPartition, int | None]:
        """The group's committed offsets, once no open transaction holds any of them (None: none yet)."""
        timeout_ms = int(self.cfg.restore_timeout_s * 1000)
        try:
            return {tp: self.consumer.committed(tp, timeout_ms=timeout_ms) for tp in tps}
        except KafkaTimeoutError:
            raise TimeoutError(
                f"the committed offsets of {self.topic!r} partitions {[tp.partition for tp in tps]} were not "
                f"stable within restore_timeout_s = {self.cfg.restore_timeout_s} s: a transaction of another "
                "instance holds them (the broker aborts it after that instance's transaction_timeout_ms); "
                "raise restore_timeout_s above transaction_timeout_ms, or check the broker"
            ) from None

    def _seek(self, committed: dict[TopicPartition, int | None]) -> None:
        for tp, offset in committed.items():
            if offset is None:
                self.consumer.seek_to_beginning(tp)  # auto_offset_reset=earliest: nothing committed yet
            else:
                self.consumer.seek(tp, offset)

    def _restore(self, partitions: list[int]) -> None:
        """Read changelog partitions from the beginning up to their high watermarks (read_committed) into the
        scorer, up to its capacity; the other accounts' places are noted (consumers/service/dormant.py)."""
        if not partitions:
            return
        started = time.monotonic()
        # Memory takes the accounts written most recently, up to its capacity; the others stay dormant in
        # the changelog, their places noted, until they return (consumers/service/dormant.py).
        room = max(self.dormant.capacity - len(self.scorer.accounts_in_memory), 0)
        # refuses another model's states, saying what to do
        done = restore_partitions(
            self.scorer, self.restorer, self.changelog, partitions, self.cfg.restore_timeout_s, keep=room
        )
        restored, read, where, corrupt = len(done.accounts), done.read, done.where, done.corrupt
        if self.shadow is not None:  # after the champion's: a challenger record is kept when current
            corrupt_before = self.shadow.model.corrupt
            kept, shadow_read = self.shadow.restore(self.restorer, partitions, self.cfg.restore_timeout_s)
            read += shadow_read
            corrupt += self.shadow.model.corrupt - corrupt_before
            log.info("shadow restore done partitions=%s states=%d", partitions, kept)
        self.dormant.drop_partitions(partitions)
        self.dormant.restored(where, done.accounts, self.batches.seq if self.batches else 0)
        seconds = time.monotonic() - started
        self.stats.restored_states += restored
        self.stats.restore_s += seconds
        self.stats.changelog_records_read += read
        self.metrics.inc("txsentinel_restore_seconds_total", seconds)
        self.metrics.inc("txsentinel_restored_states_total", restored)
        self.metrics.inc("txsentinel_states_discarded_total", corrupt)
        self.stats.states_discarded += corrupt
        self.metrics.inc("txsentinel_changelog_records_read_total", read)
        self.metrics.set("txsentinel_states_in_memory", len(self.scorer.accounts_in_memory))
        log.info(
            "restore done partitions=%s records=%d states=%d dormant=%d seconds=%.3f",
            partitions, read, restored, len(where) - restored, seconds,
        )  # fmt: skip

    def _rewind(self, batch: dict, revoked: Iterable[int] = ()) -> None:
        """Undo uncommitted batches in memory (their transaction is aborted already).

        Their accounts may be half-applied, so they leave memory; their redelivered events bring their
        last committed records back (consumers/service/dormant.py). Terminal state is restored again (the
        table, then the labels and deltas after it), and the consumer goes back to the group's committed
        offsets before the next poll. Partitions in `revoked` are leaving this instance: nothing of them
        is read or sought.
        """
        # A key that is not UTF-8 (a hostile record) names no account of ours: nothing to reload for it.
        accounts = {r.key.decode("utf-8", "replace") for rs in batch.values() for r in rs if r.key}
        held = accounts & set(self.scorer.accounts_in_memory)
        for account in held:
            self.scorer.evict(account, discard_changes=True)
        self.dormant.forget(held)
        self.scorer.take_changed()
        leaving = set(revoked)
        # The accounts the batches were letting go are kept again: their tombstones' partitions are read too
        letting_go = self.dormant.put_back()
        kept = sorted({tp.partition for tp in batch} - leaving)
        # the others have no changelog partition
        with_states = [p for p in sorted(set(kept) | (letting_go - leaving)) if not self._beyond(p)]
        if with_states:  # records past those this instance knows of: an aborted commit that landed after all
            ends = {p: self.dormant.ends.get(p, 0) for p in with_states}
            places, read = read_places(self.restorer, self.changelog, ends, self.cfg.restore_timeout_s)
            self.dormant.committed(places)
            if self.shadow is not None:
                read += self.shadow.read_tail(self.restorer, with_states, self.cfg.restore_timeout_s)
            self.stats.changelog_records_read += read
            self.metrics.inc("txsentinel_changelog_records_read_total", read)
        self.stats.states_rewound += len(held)
        self.metrics.inc("txsentinel_states_rewound_total", len(held))
        self._restore_terminals()  # drops the batches' own terminal counts; labels and deltas are read again
        self.to_seek |= set(kept) & self.assigned
        log.info("rewound accounts=%d partitions=%s", len(held), kept)

    def _rejoin(self) -> None:
        """Drop this member's partitions and subscribe afresh: the next poll joins the group anew.

        Waiting does not do it: until a heartbeat learns that the member is unknown, every poll hands out
        records whose offsets cannot commit (kafka-python has no call that forces a rejoin).
        """
        self.on_revoked([TopicPartition(self.topic, p) for p in sorted(self.assigned | self.to_restore)])
        self.consumer.unsubscribe()
        self._subscribe()

    def _subscribe(self) -> None:
        self.consumer.subscribe([self.topic], listener=_Listener(self))
        # kafka-python 3.0.12: without the topic's metadata before the first poll, the member can end up
        # in a stable group with no partitions (lost rejoin); see tests/integration/test_kafka_broker.py.
        self.consumer.partitions_for_topic(self.topic)

    def _let_dormant_go(self, committed: Committed) -> None:
        """Note where the committed batch's state records went, and the accounts it let go (a tombstone
        each); evict what memory holds beyond capacity."""
        out = committed.batch
        self.dormant.committed(changelog_places(out.records, out.sent, self.changelog), out.seq)
        if self.shadow is not None:
            self.shadow.committed(out.records, out.sent)
        self.dormant.count_let_go(out.accounts_let_go)
        self.stats.accounts_let_go += out.accounts_let_go
        self.metrics.inc("txsentinel_accounts_let_go_total", out.accounts_let_go)
        evicted = self.dormant.to_evict(self.scorer.accounts_in_memory, out.seq)
        for account in evicted:
            self.scorer.evict(account)  # its latest state is a committed record: it comes back exactly
        self.stats.states_evicted += len(evicted)
        self.metrics.inc("txsentinel_states_evicted_total", len(evicted))

    # -- terminal state -----------------------------------------------------------------------------------
    def _restore_terminals(self) -> None:
        """Terminal state = the table + every label and delta after its positions (consumers/terminals/table.py);
        then a new delta session: whatever this instance folds from now on, it also writes."""
        cfg, featurizer = self.cfg, self.scorer.featurizer
        started = time.monotonic()
        self.feed.start_from_table(
            featurizer, self.restorer, cfg.topic("terminal_table"), row_limit=self.batches.eviction.row_limit
        )
        self.stats.restored_terminals += len(featurizer.terminals)
        featurizer.terminal_journal = []  # what the rewound batches folded is gone with the old table
        got = self.feed.read(to_high_watermark=True)  # every session's deltas: none of them is folded yet
        got.fold_into(featurizer)
        self.batches.let_terminals_go()
        self._count_terminals()
        self.stats.labels_applied += len(got.labels)
        self.metrics.inc("txsentinel_labels_applied_total", len(got.labels))
        self.terminal_restores += 1
        self.batches.session = f"{self.instance_tag}/{self.terminal_restores}".encode()
        log.info(
            "terminal state restored terminals=%d deltas=%d labels=%d session=%s seconds=%.3f",
            len(featurizer.terminals), len(got.deltas), len(got.labels), self.batches.session.decode(),
            time.monotonic() - started,
        )  # fmt: skip

    def _fold_feed_while_idle(self) -> None:
        """No events: still fold in labels and other instances' deltas, so the next event sees them all."""
        try:
            labels, deltas = self.batches.fold_feed()
        except Exception as error:  # the next batch reads the feed again, and recovers if it fails there
            log.warning("reading labels and terminal deltas between batches failed error=%r", error)
            return
        self.stats.labels_applied += labels
        self.stats.terminal_deltas_applied += deltas
        self.metrics.inc("txsentinel_labels_applied_total", labels)
        self.metrics.inc("txsentinel_terminal_deltas_applied_total", deltas)
        self._count_terminals()

    def _run_writer(self, partitions: Iterable[int], assigned: bool) -> None:
        """The table writer runs where transactions partition 0 is (consumers/terminals/writer.py), unless
        it runs on its own (terminal_table_writer: external)."""
        if 0 not in partitions or self.cfg.terminal_table_writer != "embedded":
            return
        if assigned and not self.writer.running and not self.closing:
            self.writer.start()
        elif not assigned:
            self.writer.stop()
