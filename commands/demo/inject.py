"""Fault injection for the demo and the tests: ``KIND@STEP[:key=value...]``. Never used by the agent.

Kinds (``rank`` defaults to the last rank; every fault acts on that one rank only):

    explode    multiply the loss by ``scale`` (default 1e6) at STEP: a gradient spike
    nan        replace the output of module ``layer`` (default ``blocks.0.mlp.fc``) with NaN at STEP
    desync     add ``scale`` (default 1e-3) to the gradient of parameter ``param`` (default
               ``head.weight``) after all-reduce, before the optimizer step, at STEP
    drift      flip mantissa bit ``bit`` (default 10 of 0-22: a relative change near 1e-4) of the
               first element of ``param`` after the optimizer step at STEP: the replicas differ from
               then on (flipping bit 0 can heal itself: later updates may round both replicas to
               the same float)
    straggler  sleep ``seconds`` (default 0.2) before every forward pass from STEP on
    hang       stop the training thread for ``seconds`` (default 60) at STEP; the agent's
               sender thread keeps running, as it would in a rank stuck in a collective or a
               dead data loader

Example: ``gradwatch demo --inject nan@40:rank=1 --inject straggler@100``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

KINDS = ("explode", "nan", "desync", "drift", "straggler", "hang")
_DEFAULTS = {
    "explode": {"scale": "1e6"},
    "nan": {"layer": "blocks.0.mlp.fc"},
    "desync": {"scale": "1e-3", "param": "head.weight"},
    "drift": {"param": "head.weight", "bit": "10"},
    "straggler": {"seconds": "0.2"},
    "hang": {"seconds": "60"},
}
_KEYS = {"rank", "scale", "layer", "param", "seconds", "bit"}


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int
    options: dict = field(default_factory=dict)


def parse(spec: str, world_size: int) -> Fault:
    """Parse ``KIND@STEP[:key=value...]``.

    Raises:
        ValueError: naming the part of ``spec`` that is wrong.
    """
    head, *opts = spec.split(":")
    kind, at, step = head.partition("@")
    if kind not in KINDS or not at:
        raise ValueError(f"inject {spec!r}: expected KIND@STEP with KIND one of {', '.join(KINDS)}")
    try:
        step_i = int(step)
    except ValueError:
        raise ValueError(f"inject {spec!r}: STEP must be an integer, got {step!r}") from None
    options = dict(_DEFAULTS[kind])
    for o in opts:
        k, eq, v = o.partition("=")
        if not eq or k not in _KEYS:
            raise ValueError(f"inject {spec!r}: unknown option {o!r} (known: {', '.join(sorted(_KEYS))})")
        options[k] = v
    rank = int(options.pop("rank", world_size - 1))
    if not 0 <= rank < world_size:
        raise ValueError(f"inject {spec!r}: rank must be in [0, {world_size}), got {rank}")
    return Fault(kind, step_i, rank, options)


class Injector:
    """Applies the faults meant for one rank at the training loop's four points."""

    def __init__(self, faults: list[Fault], rank: int):
        self.faults = [f for f in faults if f.rank == rank]
        self._handles = []

    def before_forward(self, step: int, model) -> None:
        for f in self.faults:
            if f.kind == "straggler" and step >= f.step:
                time.sleep(float(f.options["seconds"]))
            elif f.kind == "hang" and step == f.step:
                time.sleep(float(f.options["seconds"]))
            elif f.kind == "nan" and step == f.step:
                module = dict(model.named_modules())[f.options["layer"]]
                # prepend: the module itself yields NaN, so every observer (the agent's probe hooks,
                # registered earlier) sees it, as it would a NaN made inside the module's forward
                self._handles.append(
                    module.register_forward_hook(lambda m, a, out: out * float("nan"), prepend=True)
                )

    def loss(self, step: int, loss):
        for f in self.faults:
            if f.kind == "explode" and step == f.step:
                loss = loss * float(f.options["scale"])
        for h in self._handles:  # a nan fault lasts one forward pass
            h.remove()
        self._handles = []
        return loss

    def after_backward(self, step: int, model) -> None:
        import torch

        for f in self.faults:
            if f.kind == "desync" and step == f.step:
                with torch.no_grad():
                    dict(model.named_parameters())[f.options["param"]].grad.add_(float(f.options["scale"]))

    def after_step(self, step: int, model) -> None:
        import torch

        for f in self.faults:
            if f.kind == "drift" and step == f.step:
                with torch.no_grad():
                    p = dict(model.named_parameters())[f.options["param"]]
                    bits = p.data.view(-1).view(torch.int32)
                    bits[0] ^= 1 << int(f.options["bit"])
