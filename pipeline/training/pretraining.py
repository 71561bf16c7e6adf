"""Self-supervised pretraining: the detector learns to predict each account's next event before it sees a label.

Labels are what a fraud team has least of: a new deployment may hold months of transactions and a few weeks of
confirmed fraud. Next-event prediction needs no label, so it can use every event before the validation week
(`pretrain_epochs` > 0), after which the detector trains on the labelled window as it would have. Per chunk:

    h_t = the detector's sequence output at event t            [B, T, d]  (what its score head reads)
    prediction_t = NextEventHead(h_t)                          [B, T, F]
    loss = mean over pairs (t, t + 1) of the same account, both in the chunk, of
           mean_f (prediction_t,f - x_t+1,f)^2                 (x clamped as the encoder clamps it)

The score head is set aside while the next-event head stands in for it, and comes back untouched (freshly
initialised) for the fraud objective; the next-event head is dropped. Everything else (the encoder, the
sequence layers) carries over. State, chunks and truncated BPTT are the fraud training's: the same data
module over another window, the same carried state.
"""

import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from models.contract import RecurrentDetector, detach_state
from pipeline.training.module import DetectorModule


class NextEventHead(nn.Module):
    """[..., d_model] -> the next event's F numeric features [..., F]."""

    def __init__(self, d_model: int, features: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, features)

    def forward(self, h: Tensor) -> Tensor:
        return self.out(self.norm(h))


def next_event_loss(predictions: Tensor, x: Tensor, lengths: Tensor, clip: float) -> tuple[Tensor, Tensor]:
    """(summed squared error, pairs counted) of predictions [B, T, F] against the next event's numeric
    features: x [B, T, F + 1] (the last column is the terminal bucket, not predicted), lengths [B]."""
    T = x.shape[1]
    pairs = torch.arange(T - 1, device=x.device)[None, :] + 1 < lengths[:, None]  # [B, T - 1]: t + 1 valid
    target = x[:, 1:, :-1].clamp(-clip, clip)  # [B, T - 1, F]
    error = (predictions[:, :-1].float() - target).pow(2).mean(-1)  # [B, T - 1]
    return (error * pairs).sum(), pairs.sum()


class NextEventModule(DetectorModule):
    """DetectorModule's carried state and optimiser, with the next-event loss instead of the fraud loss."""

    def __init__(
        self, detector: RecurrentDetector, learning_rate: float, weight_decay: float, warmup_steps: int
    ):
        super().__init__(detector, learning_rate, weight_decay, warmup_steps, pos_weight=1.0, num_events={})
        config = detector.config
        self.clip = float(config.input_clip)
        self.next_event = NextEventHead(config.d_model, config.num_features)
        # The score head steps aside while the next-event head stands in for it. Kept in a tuple, outside
        # the module's parameters: no optimiser step touches it, and DDP does not wait for its gradients.
        self._score_head, detector.head = (detector.head,), self.next_event

    def restore_score_head(self) -> RecurrentDetector:
        (self.detector.head,) = self._score_head
        return self.detector

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        first = bool(batch["first_chunk"]) or self._carry is None
        state = None if first else detach_state(self._carry)
        predictions, self._carry = self.detector(batch["x"], state, batch["lengths"])
        error_sum, pairs = next_event_loss(predictions, batch["x"], batch["lengths"], self.clip)
        step_sum, step_pairs = self._over_ranks(torch.stack([error_sum.detach(), pairs.float()])).unbind()
        self.log("pretrain/loss", step_sum / step_pairs.clamp(min=1), prog_bar=True)
        # As the fraud loss: W * (this rank's sum) / (the step's pairs), so DDP's average is the step's mean.
        return error_sum * self.trainer.world_size / step_pairs.clamp(min=1)


def pretrain(module: NextEventModule, trainer: pl.Trainer, data: pl.LightningDataModule) -> RecurrentDetector:
    """Fits `module` on `data`'s training window with `trainer`; returns its detector, score head restored."""
    trainer.fit(module, datamodule=data)
    return module.restore_score_head()
