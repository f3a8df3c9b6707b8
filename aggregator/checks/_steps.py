"""Every rank's report of one step, released once per step and in step order.

Shared by the checks that judge a step as a whole (explosion, non-finite provenance): after
all-reduce every rank holds the same gradient norm, so a step is evaluated once, with every rank's
local (pre-all-reduce) norm at hand to name the rank it came from. Reports of one step reach the
aggregator within moments of each other (the ranks meet in the all-reduce), but a report can be
lost or a rank can die; so a step is released as soon as every rank of the world has reported it,
or when a later step is released (older steps first), or ``WAIT_S`` seconds of the aggregator's
clock after it was first seen, or when more than ``MAX_PENDING`` steps wait. A report for a step
already released (a very late one) is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

#: seconds an incomplete step waits for its missing ranks (aggregator clock, via ``on_tick``)
WAIT_S = 2.0
#: steps held per job at most; beyond it the oldest is released incomplete
MAX_PENDING = 16


@dataclass
class _Pending:
    reports: dict = field(default_factory=dict)  # rank -> wire.Report
    seen: Optional[float] = None  # first tick after the first report


@dataclass
class Steps:
    """One job's pending steps. ``add`` and ``tick`` return the released steps as
    ``[(step, {rank: report})]``, ascending."""

    world: int
    pending: dict = field(default_factory=dict)  # step -> _Pending
    released: int = -1  # highest step released so far

    def add(self, rank: int, report) -> list[tuple[int, dict]]:
        step = report.step
        if step <= self.released:
            return []
        p = self.pending.setdefault(step, _Pending())
        p.reports[rank] = report
        out: list[int] = []
        if len(p.reports) >= self.world:
            out = [s for s in self.pending if s <= step]
        elif len(self.pending) > MAX_PENDING:
            out = [min(self.pending)]
        return self._release(out)

    def tick(self, now: float) -> list[tuple[int, dict]]:
        due = []
        for s, p in self.pending.items():
            if p.seen is None:
                p.seen = now
            elif now - p.seen >= WAIT_S:
                due.append(s)
        return self._release([s for s in self.pending if due and s <= max(due)])

    def _release(self, steps: list[int]) -> list[tuple[int, dict]]:
        out = []
        for s in sorted(steps):
            out.append((s, self.pending.pop(s).reports))
            self.released = max(self.released, s)
        return out
