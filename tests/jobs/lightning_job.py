"""A Lightning job on two ranks (torchrun, gloo, CPU, ``strategy="ddp"``): a small MLP, gradient
accumulation 2, clipping at 1.0, with ``L.Trainer(..., callbacks=[GradwatchCallback()])``.
Lightning steps the optimizer with a closure that runs forward and backward. See
tests/jobs/common.py; the loss it logs per batch (``self.log``) goes to a CSV logger."""

from __future__ import annotations

import os

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger

from gradwatch.integrations.lightning import GradwatchCallback

from common import OUT, STEPS, Reference, injected


class Points(torch.utils.data.Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(12, generator=g)
        return x, torch.tanh(x[:4] * 2 + 0.3)


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
        self.ref: Reference = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y) * injected(self.trainer.global_step)
        self.ref.loss(self.trainer.global_step, loss)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        self.ref = Reference(opt, self.named_parameters, lambda: self.trainer.global_step)
        return opt


def main() -> None:
    torch.manual_seed(0)
    model = Net()
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp", max_steps=STEPS,
        accumulate_grad_batches=2, gradient_clip_val=1.0, logger=CSVLogger(OUT, name="csv", version=0),
        log_every_n_steps=1, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[GradwatchCallback()],
    )
    trainer.fit(model, torch.utils.data.DataLoader(Points(), batch_size=8))
    model.ref.write()


if __name__ == "__main__":
    main()
