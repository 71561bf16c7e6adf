"""The LightningModule around any detector: loss, metrics, optimiser, and the state carried across chunks.

The detector (models/) knows nothing of this; one shared `_run` serves train, validation and test.

Under DDP (W ranks, each with its own accounts) three things are global, not per rank: the loss of a step is
the summed loss of every rank's counted events over their total count (so the averaged gradient is the
gradient of the whole step, as one process would take it); validation and test scores are gathered from every
rank before any metric; the validation loss is summed and counted across ranks.
"""

import math

import numpy as np
import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.nn import functional as F

from models.contract import RecurrentDetector, State, detach_state
from pipeline.evaluation.metrics import event_metrics


class DetectorModule(pl.LightningModule):
    def __init__(
        self,
        detector: RecurrentDetector,
        learning_rate: float,
        weight_decay: float,
        warmup_steps: int,
        pos_weight: float,
        num_events: dict[str, int],
    ):
        super().__init__()
        self.detector = detector
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        self.register_buffer("pos_weight", torch.tensor(float(pos_weight)), persistent=False)
        self.num_events = num_events  # rows of each stage's sequences, to collect scores by event index
        self._carry: State | None = None
        self.scores: dict[str, np.ndarray] = {}
        # The training run logs its own params; Lightning logging them again would clash in MLflow.
        self.save_hyperparameters(ignore=["detector", "num_events"], logger=False)

    # -- one shared step ---------------------------------------------------------------------------------
    def _run(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(scores [B, T], summed loss of the counted events) of a chunk, continuing from the previous chunk's
        state unless this is a first chunk."""
        state = None if bool(batch["first_chunk"]) or self._carry is None else detach_state(self._carry)
        scores, final_state = self.detector(batch["x"], state, batch["lengths"])
        self._carry = final_state
        mask = batch["mask"]
        if not bool(mask.any()):
            return scores, scores.float().sum() * 0.0  # keeps the graph (and DDP) happy with no targets
        loss_sum = F.binary_cross_entropy_with_logits(
            scores[mask].float(), batch["y"][mask], pos_weight=self.pos_weight, reduction="sum"
        )
        return scores, loss_sum

    def _over_ranks(self, values: Tensor, op: str = "sum") -> Tensor:
        return self.trainer.strategy.reduce(values, reduce_op=op)  # itself on one device

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        _, loss_sum = self._run(batch)
        counted = batch["mask"].sum().float()
        step_sum, step_counted = self._over_ranks(torch.stack([loss_sum.detach(), counted])).unbind()
        # DDP averages the W ranks' gradients, so W * (this rank's sum) / (the step's count) averages to the
        # gradient of the step's mean loss: what one process with all W groups in its batch would take.
        loss = loss_sum * self.trainer.world_size / step_counted.clamp(min=1)
        self.log("train/loss", step_sum / step_counted.clamp(min=1), prog_bar=True)
        return loss

    def _collect(self, stage: str, batch: dict[str, Tensor]) -> None:
        scores, loss_sum = self._run(batch)
        rows = batch["rows"]
        counted = rows >= 0
        self.scores[stage][rows[counted].cpu().numpy()] = scores[counted].float().cpu().numpy()
        self._loss_total += torch.stack([loss_sum.detach(), counted.sum()]).double()

    def _start(self, stage: str) -> None:
        self._carry = None
        self.scores[stage] = np.full(self.num_events[stage], np.nan, dtype=np.float32)
        # (summed loss, counted events) of this rank; float64, as an epoch's count can pass float32's 2^24.
        self._loss_total = torch.zeros(2, dtype=torch.float64, device=self.device)

    def _finish(self, stage: str) -> None:
        """Every rank's scores and loss on every rank. An event is scored by the one rank that owns its account,
        so a max over ranks, unscored as -inf, puts each score in place: one [N] all-reduce, no [W, N] gather."""
        self._carry = None
        mine = torch.from_numpy(np.where(np.isnan(self.scores[stage]), -np.inf, self.scores[stage]))  # [N]
        every = self._over_ranks(mine.to(self.device), "max").cpu().numpy()
        self.scores[stage] = np.where(np.isneginf(every), np.nan, every).astype(np.float32)
        loss_sum, counted = self._over_ranks(self._loss_total).unbind()
        # The same figure on every rank: sync_dist changes nothing but keeps Lightning from asking for it.
        self.log(f"{stage}/loss", (loss_sum / counted.clamp(min=1)).float(), sync_dist=True)

    def on_train_epoch_start(self) -> None:
        self._carry = None

    def on_validation_epoch_start(self) -> None:
        self._start("val")

    def on_test_epoch_start(self) -> None:
        self._start("test")

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._collect("val", batch)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._collect("test", batch)

    def on_validation_epoch_end(self) -> None:
        self._finish("val")
        targets = self.trainer.datamodule.datasets["validation"].seqs.target
        scored = ~np.isnan(self.scores["val"])
        auc, ap = event_metrics(self.scores["val"][scored], targets[scored] > 0.5)
        # Every rank holds every score now and computes the same figures (sync_dist as for the loss).
        # Undefined (one class among the scored events): not logged. A validation window without fraud trains
        # with no early stopping (train.py); a sanity check's few batches may have none, and nothing reads it.
        if not math.isnan(ap):
            self.log("val/ap", ap, prog_bar=True, sync_dist=True)
            self.log("val/auc", auc, sync_dist=True)

    def on_test_epoch_end(self) -> None:
        self._finish("test")

    # -- optimiser ---------------------------------------------------------------------------------------
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=self.learning_rate, weight_decay=self.weight_decay
        )
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup = min(self.warmup_steps, total // 2)

        def factor(step: int) -> float:
            # Linear warm-up, then cosine decay to 10% of the peak rate.
            if step < warmup:
                return (step + 1) / max(warmup, 1)
            progress = (step - warmup) / max(total - warmup, 1)
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
