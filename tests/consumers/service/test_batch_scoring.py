"""BatchScorer.fold_feed: labels and other instances' deltas are read every terminal_feed_interval_ms, not
before every batch (each read costs a broker round trip). The feed is a stand-in that counts its reads; the
reads against the real broker: tests/integration/test_service_labels.py."""

from types import SimpleNamespace

import numpy as np

from consumers.runtime.settings import load_serve_config
from consumers.service import batch_scoring
from consumers.service.batch_scoring import BatchScorer
from consumers.terminals.feed import FeedRead
from pipeline.features.stream import StreamingFeaturizer, TerminalOp


class CountingFeed:
    def __init__(self):
        self.reads = []

    def read(self, session):
        self.reads.append(session)
        return FeedRead(deltas=[TerminalOp("events", ["t1"], np.array([3], dtype=np.int64))])


def batch_scorer(interval_ms: int) -> tuple[BatchScorer, CountingFeed, StreamingFeaturizer]:
    cfg = load_serve_config(None, overrides={"terminal_feed_interval_ms": interval_ms}, env={})
    featurizer, feed = StreamingFeaturizer(), CountingFeed()
    scorer = SimpleNamespace(featurizer=featurizer)
    batches = BatchScorer(cfg, scorer, feed, "1", True, dormant=None, read_states=None)
    batches.session = b"me/1"
    return batches, feed, featurizer


def test_the_feed_is_read_at_most_once_an_interval_and_what_it_brings_is_folded(monkeypatch):
    batches, feed, featurizer = batch_scorer(interval_ms=250)
    clock = iter([100.0, 100.1, 100.2, 100.26, 100.3])
    monkeypatch.setattr(batch_scoring.time, "monotonic", lambda: next(clock))
    folded = [batches.fold_feed() for _ in range(5)]
    assert folded == [(0, 1), (0, 0), (0, 0), (0, 1), (0, 0)]
    assert feed.reads == [b"me/1", b"me/1"]  # this instance's own deltas are left out by its session
    assert "t1" in featurizer.terminals


def test_an_interval_of_zero_reads_before_every_batch():
    batches, feed, _ = batch_scorer(interval_ms=0)
    assert [batches.fold_feed() for _ in range(3)] == [(0, 1)] * 3 and len(feed.reads) == 3
