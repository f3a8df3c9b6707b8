"""Fingerprints: an exact, order-independent digest of a tensor's bits, so replicas compare bit for bit.

After all-reduce every rank must hold the same gradient, and after the optimizer step the same
weights. The aggregator compares one int64 per parameter across ranks (see :mod:`gradwatch.wire`).

There is no error callback here on purpose: the wire cannot say "fingerprint missing" in a probe
report, and a zero would read as a replica that disagrees. A fingerprint that fails therefore
fails the statistics it travels with (the step's sentinel, or its probe), under that part's name.
"""

from __future__ import annotations

from typing import Sequence

import torch

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """int64 scalar: sum of ``t``'s elements reinterpreted as signed integers of their own width,
    wrapping modulo 2**64. Exact and independent of reduction order; on the device, no sync."""
    x = t.detach().reshape(-1)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    return torch.sum(x.view(_INT_OF_WIDTH[x.element_size()]), dtype=torch.int64)


class Fingerprints:
    """Fingerprints of a rank's tensors, taken only when there are replicas to compare.

    Args:
        world_size: ranks in the job; alone, there is nothing to compare and nothing is computed.
    """

    def __init__(self, world_size: int):
        self.enabled = world_size > 1

    def of(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """int64 0-d device tensors, one per tensor (empty when disabled); no host sync."""
        return [fingerprint(t) for t in tensors] if self.enabled else []
