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

#: loss scales from which gradients are divided by the scale before their norms (:class:`Unscale`),
#: and below which no longer (hysteresis: GradScaler halves its scale on an overflow). A float32
#: sum of squares overflows at 2^128: with a scale of 2^60, at gradient values around 2^4 already
UNSCALE_FROM, UNSCALE_BELOW = 2.0**40, 2.0**32


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
        self.stepped = False  # an update before any step since attach is a skipped first step
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


class Unscale:
    """The loss scale a step's scaled gradients are divided by before their norms, or none.

    A GradScaler's scale grows for ever where gradients never overflow (bf16 autocast: float32
    gradients): past ~2^60 the float32 sums of squares of the scaled gradients the DDP hook and
    the output-gradient hooks see overflow, and their norms would read Inf beside finite
    gradients. One instance, shared by :class:`.ddp.CommHook` and :class:`.hooks.ProbeRecorder`:
    the monitor's sender thread sets :attr:`source` while the scale is at least
    :data:`UNSCALE_FROM`; the step's first caller of :meth:`apply` decides for the whole step, so
    every record of a step is treated alike and :attr:`applied` tells the report builder not to
    divide by the scale again. The division is a temporary the tensor's size, no host sync,
    exact for GradScaler's powers of two (one rounding otherwise).

    Attributes:
        source: ``ScalerWatch.scale`` (the scale as the scaler's 0-d device tensor) or None.
        applied: this step's gradients are divided by the scale.
    """

    def __init__(self):
        self.source: Optional[Callable[[], Optional[torch.Tensor]]] = None
        self._scale: Optional[torch.Tensor] = None
        self._known = False

    @property
    def applied(self) -> bool:
        return self._known and self._scale is not None

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` divided by this step's scale (moved to ``t``'s device: no copy on the same one),
        or ``t`` itself."""
        if not self._known:
            # the scale before the flag: a hook on another autograd thread that finds the step
            # decided must find its scale too (else it left its tensor scaled, marked unscaled)
            source = self.source
            self._scale = source() if source is not None else None
            self._known = True
        scale = self._scale
        return t if scale is None else t / scale.to(t.device)

    def reset(self) -> None:
        """A step ended or was skipped: the next one decides again."""
        self._known = False
        self._scale = None
