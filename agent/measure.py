"""What a step measures on the device, as sections of the step frame (:mod:`.frame`).

Two plain functions, one per moment of the step. :func:`sentinel` runs in the optimizer's step
pre-hook, every step, while the gradients are there: per-parameter gradient norms with one
``torch._foreach_norm`` (float32 accumulation, case C10) and what travels with them; on a probed
step also per-parameter non-finite counts and gradient fingerprints. :func:`probe` runs in the
post-hook of a probed step: weight norms and fingerprints after the update, and the recorder's
activation and output-gradient records. Raw values go to the host as they are; sums, square roots
and counts are the sender thread's work (:mod:`.report`), so a step costs a handful of kernels and
no host synchronisation.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .fingerprint import Fingerprints
from .hooks import ProbeRecorder
from .stats import nonfinite_count


def sentinel(params: Sequence[torch.Tensor], buckets: Sequence[torch.Tensor], losses: Sequence[torch.Tensor],
             scale: Optional[torch.Tensor], probing: bool, fingerprints: Fingerprints) -> tuple[list[int], dict]:
    """Gradient statistics of one step, before the optimizer changes anything.

    Args:
        params: the model's parameters, in schema order.
        buckets: float32 0-d device tensors, this rank's DDP bucket norms before all-reduce.
        losses: float32 0-d device tensors passed to ``observe_loss``.
        scale: the AMP loss scale (0-d device tensor) or None.
        probing: the step is probed: add non-finite counts and fingerprints.
        fingerprints: computes gradient fingerprints when there are replicas.

    Returns:
        ``(present, sections)``: indices into ``params`` of those with a gradient, and frame
        sections; without any gradient, no section at all (bucket norms, losses and the scale
        only travel with gradients).
    """
    present = [i for i, p in enumerate(params) if p.grad is not None]
    grads = [params[i].grad for i in present]
    if not grads:
        return present, {}
    sections = {
        "grad_norm": torch._foreach_norm(grads, 2, dtype=torch.float32),
        "bucket_norm": list(buckets), "loss": list(losses), "loss_scale": [] if scale is None else [scale],
    }
    if probing:
        sections["grad_nonfinite"] = [nonfinite_count(g) for g in grads]
        sections["grad_fp"] = fingerprints.of(grads)
    return present, sections


def probe(params: Sequence[torch.Tensor], recorder: ProbeRecorder, fingerprints: Fingerprints) -> dict:
    """Frame sections a probed step adds after the optimizer step: weight norms (float32
    accumulation) and fingerprints of every parameter, and the recorder's records."""
    sections: dict = {"act": [r for _, _, r in recorder.act], "out_grad": [r for _, r in recorder.grad]}
    weights = [p.detach() for p in params]
    if weights:
        sections["weight_norm"] = torch._foreach_norm(weights, 2, dtype=torch.float32)
        sections["weight_fp"] = fingerprints.of(weights)
    return sections
