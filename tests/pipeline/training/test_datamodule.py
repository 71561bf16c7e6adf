"""Chunked histories under DDP: equal steps on every rank, and together the ranks feed one process's batches."""

import numpy as np
import pytest
import torch

from pipeline.training.datamodule import ChunkedHistories, Window
from pipeline.training.sequences import AccountSequences

CHUNK = 4


def sequences(lengths: list[int], seed: int = 0) -> AccountSequences:
    """Accounts of the given lengths, one event a second from t = 0, random features and fraud."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(offsets[-1])
    return AccountSequences(
        account_ids=np.array([f"a{i}" for i in range(len(lengths))]),
        offsets=offsets,
        x=rng.normal(size=(n, 3)).astype(np.float32),
        terminal_bucket=rng.integers(0, 5, n),
        ts_us=np.concatenate([np.arange(k) for k in lengths]).astype(np.int64) * 1_000_000,
        event_ids=np.array([f"e{i}" for i in range(n)]),
        target=(rng.random(n) < 0.2).astype(np.float32),
        is_fraud=rng.random(n) < 0.2,
    )


# 13 accounts of 1 to 30 events. The first 2 s of each are history (fed, not counted), so the 1-event account
# counts nothing and 12 take part; events from 27 s on are not fed, so the 30-event account feeds 27.
LENGTHS = [30, 1, 7, 19, 4, 4, 12, 25, 9, 3, 16, 8, 22]
WINDOW = Window(start_us=2_000_000, end_us=27_000_000)


def datasets(world: int, batch_accounts: int, shuffle: bool = True) -> list[ChunkedHistories]:
    seqs = sequences(LENGTHS)
    return [
        ChunkedHistories(seqs, WINDOW, batch_accounts, CHUNK, shuffle, seed=7, rank=rank, world_size=world)
        for rank in range(world)
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("batch_accounts", [1, 2, 3, 5])
def test_every_rank_takes_the_same_number_of_steps_every_epoch(world, batch_accounts):
    ranks = datasets(world, batch_accounts)
    for epoch in range(3):
        for dataset in ranks:
            dataset.set_epoch(epoch)
        assert len({len(dataset) for dataset in ranks}) == 1, [len(d) for d in ranks]
        # A round's chunks follow each other on every rank, the first flagged: the carried state restarts there.
        for dataset in ranks:
            firsts = [bool(dataset[i]["first_chunk"]) for i in range(len(dataset))]
            assert sum(firsts) == len(dataset.groups) and firsts[0]


# (2, 5): 3 groups, the second round short of one; (3, 3): 4 groups, two ranks idle in the second round.
@pytest.mark.parametrize("world, batch_accounts", [(2, 3), (2, 5), (3, 3), (4, 5), (4, 1)])
def test_the_ranks_batches_at_a_step_are_one_process_batch_of_world_times_the_accounts(world, batch_accounts):
    ranks, single = datasets(world, batch_accounts), datasets(1, world * batch_accounts)[0]
    padding_steps = 0
    for epoch in range(3):  # the shuffle too: each epoch's round order is the one process's group order
        for dataset in [*ranks, single]:
            dataset.set_epoch(epoch)
        assert len(ranks[0]) == len(single)
        for i in range(len(single)):
            whole = single[i]
            parts = [dataset[i] for dataset in ranks]
            real = [p for d, p in zip(ranks, parts, strict=True) if d.groups[d.items[i][0]] is not None]
            for part in parts[len(real) :]:  # a missing member: runs, feeds nothing, counts nothing
                padding_steps += 1
                assert part["lengths"].tolist() == [0] and not part["mask"].any() and (part["rows"] < 0).all()
                assert part["first_chunk"] == whole["first_chunk"]
            for key in ("x", "y", "mask", "lengths", "rows"):
                torch.testing.assert_close(torch.cat([p[key] for p in real]), whole[key], rtol=0, atol=0)
            assert all(p["first_chunk"] == whole["first_chunk"] for p in real)
    counted = sum(int(single[i]["mask"].sum()) for i in range(len(single)))
    assert counted == single.counted_events > 0
    groups = -(-12 // batch_accounts)
    assert (padding_steps > 0) == (groups % world > 0), "a short last round, and only then, has padding"
