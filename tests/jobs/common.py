"""What the framework jobs (launched by torchrun in tests/test_integrations.py) share: their
settings from the environment and the float64 reference each rank writes of its own steps.

Each job is a user's script: it trains with the framework as documented, attaches gradwatch with
the framework's one line, multiplies its loss by ``GW_INJECT_FACTOR`` on rank ``GW_INJECT_RANK``
at the framework's step ``GW_INJECT_STEP`` (a blow-up), and records, in an optimizer step
post-hook of its own, the framework's step number and the float64 norms of the gradients the
optimizer applied; the loss it computed per micro-batch; and the framework's own log where it
keeps one. ``ref-RANK.json`` under ``GW_OUT`` holds it all.
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable

import torch

STEPS = int(os.environ.get("GW_STEPS", "40"))
INJECT_STEP = int(os.environ.get("GW_INJECT_STEP", "-1"))
INJECT_RANK = int(os.environ.get("GW_INJECT_RANK", "1"))
INJECT_FACTOR = float(os.environ.get("GW_INJECT_FACTOR", "1e4"))
OUT = os.environ.get("GW_OUT", ".")
RANK = int(os.environ.get("RANK", "0"))


def injected(step: int) -> float:
    """The factor this rank's loss is multiplied by at the framework's step ``step``."""
    return INJECT_FACTOR if step == INJECT_STEP and RANK == INJECT_RANK else 1.0


class Reference:
    """Float64 norms of the gradients the optimizer applies, per framework step.

    Args:
        optimizer: the torch optimizer whose step applies them.
        reduce: how a step's loss is made of its micro-batches' (``mean`` or ``sum``).
        named: ``() -> [(name, parameter)]`` in the module's own order (no wrapper prefixes).
        step: ``() -> int``, the framework's number of the step being taken.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named: Callable, step: Callable[[], int], reduce: str = "mean"):
        self.named, self.step_of, self.reduce = named, step, reduce
        self.steps: dict[int, dict] = {}
        self.losses: dict[int, list[float]] = {}
        optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer, args, kwargs) -> None:
        norms = {n: float(p.grad.double().norm()) for n, p in self.named() if p.grad is not None}
        self.steps[self.step_of()] = dict(grad_norm=math.sqrt(sum(v * v for v in norms.values())), params=norms)

    def loss(self, step: int, value: torch.Tensor) -> None:
        """One micro-batch's loss; a step's is their mean, or their sum with ``reduce="sum"``."""
        self.losses.setdefault(step, []).append(float(value.detach()))

    def write(self, **extra) -> None:
        for s, v in self.losses.items():
            if s in self.steps:
                self.steps[s]["loss"] = sum(v) / (1 if self.reduce == "sum" else len(v))
        with open(os.path.join(OUT, f"ref-{RANK}.json"), "w") as f:
            json.dump(dict(rank=RANK, steps=self.steps, **extra), f)
