"""AMP: watching a ``torch.amp.GradScaler`` for the steps it skips (case C10).

Under mixed precision the scaler skips the optimizer step when gradients hold inf or NaN, which is
normal while it searches for a loss scale. Its ``update()`` runs once per iteration; an iteration
without an optimizer step before it is a skipped step. Such a step sends no report: the monitor
discards its partial statistics (``on_skip``) and the next report counts it in ``skipped``. The
scale itself stays a device tensor (``get_scale()`` would synchronise) and travels in the frame.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

PART = "scaler"  # not switchable alone: without it skipped steps would report partial statistics


class ScalerWatch:
    """Wraps one scaler's ``update`` until :meth:`close`.

    Attributes:
        skipped: steps skipped since the last :meth:`take_skipped`.
        stepped: an optimizer step happened since the scaler's last update (set by the monitor).
        live: cleared by the monitor when it closes or the process forks.

    Args:
        scaler: a ``torch.amp.GradScaler`` (or anything with ``update`` and ``_scale``).
        on_skip: called on the training thread when ``update`` finds no step since the last one.
        on_error: called as ``on_error("scaler", exc)`` when that bookkeeping fails; the scaler's
            own ``update`` always runs and its exceptions reach the caller as they would without
            the agent.
    """

    def __init__(self, scaler, on_skip: Callable[[], None], on_error: Callable[[str, BaseException], None]):
        self.on_skip = on_skip
        self.on_error = on_error
        self.skipped = 0
        self.stepped = True
        self.live = True
        self._scaler = scaler
        ref = weakref.ref(self)  # the scaler must not keep the agent alive
        original = scaler.update

        def update(*args, **kwargs):
            w = ref()
            if w is not None and w.live:
                w._update()
            return original(*args, **kwargs)

        scaler.update = update  # an instance attribute: close() deletes it, restoring the method

    def _update(self) -> None:
        try:
            if not self.stepped:
                self.skipped += 1
                self.on_skip()
            self.stepped = False
        except Exception as e:
            self.on_error(PART, e)

    def scale(self) -> Optional[torch.Tensor]:
        """The current loss scale as the scaler's own device tensor, or None before its first use."""
        s = getattr(self._scaler, "_scale", None)
        return s if isinstance(s, torch.Tensor) else None

    def take_skipped(self) -> int:
        """Skipped steps since the last call, resetting the count."""
        n, self.skipped = self.skipped, 0
        return n

    def close(self) -> None:
        """Restore the scaler's own ``update``."""
        if self._scaler is not None and "update" in vars(self._scaler):
            del self._scaler.update
        self._scaler = None
