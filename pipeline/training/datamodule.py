"""Account histories as training batches: chunks of `chunk_events`, the state carried between chunks.

A pass over the data is a list of account *groups* (B accounts of similar length, so little padding) and,
for each group, its chunks in time order: batch (g, 0), (g, 1), ... The LightningModule carries the
detector's state from chunk c to c + 1 of the same group (truncated BPTT) and starts a fresh state at c = 0.
Groups are shuffled per epoch; chunks never are.

With DDP over W ranks the groups go in *rounds* of W consecutive groups of the length-sorted list; rank r takes
member r of each round. Rounds are what is shuffled, and a round runs as many chunks as its longest member
needs, so every rank takes the same number of steps (a rank whose member is shorter, or missing in the last
round, gets padding batches that count nothing). Round k is then the k-th group of one process with W times
the accounts per batch: same order, same chunks. Lightning's own distributed sampler (which would reorder
chunks) is switched off.

Each pass feeds an account's events up to `end` (history before the loss window feeds the state) and marks
the events in [`window_start`, `end`) for the loss or the metrics.
"""

from dataclasses import dataclass

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from pipeline.training.sequences import AccountSequences  # numpy only: no polars needed to train


@dataclass(frozen=True)
class Window:
    """Events with ts < end_us are fed; those with ts >= start_us among them count."""

    start_us: int
    end_us: int


def _fed_lengths(seqs: AccountSequences, window: Window) -> tuple[np.ndarray, np.ndarray]:
    """Per account: events fed (ts < end) and events counted (start <= ts < end)."""
    fed = (seqs.ts_us < window.end_us).astype(np.int64)
    counted = fed & (seqs.ts_us >= window.start_us)
    starts = seqs.offsets[:-1]
    return np.add.reduceat(fed, starts), np.add.reduceat(counted, starts)


class ChunkedHistories(Dataset):
    """Map-style dataset whose item i is a whole batch: chunk c of group g, padded to [B, chunk]."""

    def __init__(
        self,
        seqs: AccountSequences,
        window: Window,
        batch_accounts: int,
        chunk_events: int,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.seqs = seqs
        self.window = window
        self.chunk = chunk_events
        self.shuffle = shuffle
        self.seed = seed
        fed, counted = _fed_lengths(seqs, window)
        self.fed = fed
        # Accounts with nothing to count cost compute and teach nothing; longest first, so groups are even.
        accounts = np.flatnonzero(counted > 0)
        accounts = accounts[np.argsort(-fed[accounts], kind="stable")]
        groups = [accounts[i : i + batch_accounts] for i in range(0, len(accounts), batch_accounts)]
        rounds = [groups[i : i + world_size] for i in range(0, len(groups), world_size)]
        # This rank's member of each round (None: the last round is short of one) and the round's chunks.
        self.groups = [members[rank] if rank < len(members) else None for members in rounds]
        self.round_chunks = [-(-int(fed[members[0]].max()) // chunk_events) for members in rounds]
        self.counted_events = int(counted[accounts].sum())
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        order = np.arange(len(self.groups))
        if self.shuffle:
            np.random.default_rng(self.seed + epoch).shuffle(order)
        self.items = [(int(g), c) for g in order for c in range(self.round_chunks[g])]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g, c = self.items[i]
        accounts = self.groups[g]
        if accounts is None:
            # A missing member: one account that feeds nothing. The step still runs the detector (DDP wants
            # every rank's graph) but counts nothing.
            accounts, fed = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
        else:
            fed = self.fed[accounts]
        seqs, T = self.seqs, self.chunk
        B, F = len(accounts), seqs.x.shape[1]
        start = seqs.offsets[accounts] + c * T  # [B] first row of this chunk
        stop = seqs.offsets[accounts] + fed  # [B] end of the fed rows
        lengths = np.clip(stop - start, 0, T)
        steps = np.arange(T)
        rows = np.where(steps[None, :] < lengths[:, None], start[:, None] + steps[None, :], -1)  # [B, T]
        safe = np.maximum(rows, 0)
        valid = rows >= 0
        x = np.zeros((B, T, F + 1), dtype=np.float32)
        x[..., :F] = seqs.x[safe]
        x[..., F] = seqs.terminal_bucket[safe]
        x[~valid] = 0.0
        counted = valid & (seqs.ts_us[safe] >= self.window.start_us)
        return {
            "x": torch.from_numpy(x),  # [B, T, F + 1]: features, then the terminal bucket
            "y": torch.from_numpy(np.where(valid, seqs.target[safe], 0.0).astype(np.float32)),  # [B, T]
            "mask": torch.from_numpy(counted),  # [B, T] events that count
            "lengths": torch.from_numpy(lengths.astype(np.int64)),  # [B]
            "rows": torch.from_numpy(np.where(counted, rows, -1)),  # [B, T] event index, -1 if not counted
            "first_chunk": torch.tensor(c == 0),
        }


class HistoryDataModule(pl.LightningDataModule):
    """Train on one window, validate on the next, test on a third — each over full account histories."""

    def __init__(
        self,
        train: tuple[AccountSequences, Window],
        validation: tuple[AccountSequences, Window] | None,
        test: tuple[AccountSequences, Window] | None,
        batch_accounts: int,
        chunk_events: int,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__()
        self.specs = {"train": train, "validation": validation, "test": test}
        self.batch_accounts = batch_accounts
        self.chunk_events = chunk_events
        self.num_workers = num_workers
        self.seed = seed
        self.datasets: dict[str, ChunkedHistories] = {}

    def setup(self, stage: str | None = None) -> None:
        rank = self.trainer.global_rank if self.trainer else 0
        world = self.trainer.world_size if self.trainer else 1
        for name, spec in self.specs.items():
            if spec is None or name in self.datasets:
                continue
            seqs, window = spec
            self.datasets[name] = ChunkedHistories(
                seqs, window, self.batch_accounts, self.chunk_events, name == "train", self.seed, rank, world
            )

    def _loader(self, name: str) -> DataLoader:
        return DataLoader(
            self.datasets[name],
            batch_size=None,  # items are whole batches
            shuffle=False,  # order matters: chunks of a group follow each other
            num_workers=self.num_workers,
        )

    def train_dataloader(self) -> DataLoader:
        # The Trainer reloads this every epoch (reload_dataloaders_every_n_epochs=1), so workers see the
        # epoch's group order.
        dataset = self.datasets["train"]
        dataset.set_epoch(self.trainer.current_epoch if self.trainer else 0)
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")
