"""The probe schedule: which steps are probed, and the bursts a suspicious gradient norm asks for.

Every ``every``-th step is probed (module hooks record activations and output gradients). When the
sender thread sees a non-finite gradient norm, or one above ``spike_factor`` times the median of
the recent finite ones, it asks for a *burst*: the next ``burst`` steps are probed regardless of
cadence. The request is a plain integer the training thread reads at its next step boundary, so it
arrives a step or two after the faulty step and never costs a host synchronisation.

At each step boundary :meth:`ProbeSchedule.advance` switches the recorder's module hooks on or off,
so hooks exist only while a probed step runs.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Callable

from .hooks import ProbeRecorder

PART = "schedule"


class ProbeSchedule:
    """Cadence and bursts of probed steps for one monitor.

    Args:
        every: probe cadence in steps (>= 1).
        burst: steps probed after a suspicious gradient norm (0: never).
        spike_factor: a gradient norm above this times the median of the recent ones is a spike.
        recorder: whose hooks :meth:`advance` installs and removes.
        on_error: called as ``on_error("schedule", exc)`` when switching hooks fails.
        history: finite gradient norms kept for the median.
    """

    def __init__(self, every: int, burst: int, spike_factor: float, recorder: ProbeRecorder,
                 on_error: Callable[[str, BaseException], None], history: int = 32):
        self.every = every
        self.burst = burst
        self.spike_factor = spike_factor
        self.recorder = recorder
        self.on_error = on_error
        self._burst_until = 0  # written by the sender thread, read at step boundaries
        self._recent: collections.deque = collections.deque(maxlen=history)  # sender thread only

    def is_probe(self, step: int) -> bool:
        return step % self.every == 0 or step < self._burst_until

    def on_cadence(self, step: int) -> bool:
        """``step`` is probed for the cadence, not (only) for a burst."""
        return step % self.every == 0

    def advance(self, step: int) -> None:
        """Training thread, before ``step`` runs: module hooks on for a probed step, off otherwise."""
        try:
            want = self.is_probe(step)
            if want and not self.recorder.probing:
                self.recorder.install()
            elif not want and self.recorder.probing:
                self.recorder.remove()
        except Exception as e:
            self.on_error(PART, e)

    def watch(self, step: int, grad_norm: float, grad_nonfinite: int, scheduled: int) -> None:
        """Sender thread: ask for a burst after a non-finite or spiking gradient norm of ``step``.

        ``scheduled`` is the training thread's current step count; a NaN norm with no non-finite
        parameter means "no gradients", not a fault. Raises only what ``statistics`` would; the
        sender counts it with the report it drops.
        """
        recent = self._recent
        spike = len(recent) >= 4 and grad_norm > self.spike_factor * statistics.median(recent)
        if self.burst and (grad_nonfinite > 0 or math.isinf(grad_norm) or spike):
            # ``burst`` probes from the first step the training thread has not yet scheduled: the
            # request arrives a step or two after the faulty one, and ranks may start one step apart
            self._burst_until = max(self._burst_until, max(step + 1, scheduled + 1) + self.burst)
        if math.isfinite(grad_norm):
            recent.append(grad_norm)
