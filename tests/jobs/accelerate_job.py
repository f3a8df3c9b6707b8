"""An accelerate job on two ranks (torchrun, gloo, CPU): a small MLP, gradient accumulation 2,
``accelerator.clip_grad_norm_(..., 1.0)`` before each step, with
``monitor = attach(accelerator, model, optimizer)`` after ``accelerator.prepare``. See
tests/jobs/common.py."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator

from gradwatch.integrations.accelerate import attach

from common import STEPS, Reference, injected


def main() -> None:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    net = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    data = [torch.randn(8, 12, generator=torch.Generator().manual_seed(i)) for i in range(4 * STEPS)]
    model, optimizer = accelerator.prepare(net, optimizer)
    step = 0
    ref = Reference(optimizer.optimizer, net.named_parameters, lambda: step)
    monitor = attach(accelerator, model, optimizer)
    for i, x in enumerate(data):
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x), torch.tanh(x[:, :4] * 2 + 0.3)) * injected(step)
            ref.loss(step, loss)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
        if step == STEPS:
            break
    accelerator.end_training()
    ref.write(monitor_steps=monitor.step)


if __name__ == "__main__":
    main()
