"""A rank's per-step records: its gauges and counters, the job's step table, the steps released.

Every ``steps`` batch and every report carries per-step records (wire ``STEP_COLUMNS``). Each
updates the rank's latest values and counters, counting each step once (a batch sent again, or
overlapping the last, is not counted twice), and goes into the job's step table (:mod:`.steps`),
which releases the steps every rank reported, or that waited long enough, to the checks
(``on_steps``), once sharded ranks' global gradient norms are worked out from their shard groups
(:mod:`.shards`). A probe report then goes to its round (:mod:`.rounds`).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from gradwatch import wire

from .jobs import JobState, RankState
from .rounds import Rounds
from .shards import gradless, norms_of, sq_kind
from .steps import COLUMNS as TABLE_COLUMNS
from .steps import MAX_CELLS, MIN_ROWS, PENDING_CELLS, StepTable


class Records:
    """Takes every rank's per-step records (module docstring). The writer thread's.

    Args:
        rounds: the rounds a probe report goes to, and the checks' events (``on_steps``) go through.
    """

    def __init__(self, rounds: Rounds):
        self.rounds = rounds

    def take(self, job: JobState, r: RankState, m, now: float) -> Optional[str]:
        """A rank's per-step records (a ``steps`` batch, or a report's one record): its gauges and
        counters, the job's step table (the checks judge the steps it releases), a probe's round.
        Returns why the probe's round did not take it (:meth:`.rounds.Rounds.add`), or None."""
        probe = isinstance(m, wire.Report) and m.probe
        one = isinstance(m, wire.Report) or len(m.step) == 1  # 1 step/s and slower: no numpy per record
        # the counters take each step once: records of steps the rank sent before (a batch sent
        # again, or overlapping the last) are not counted again
        if one:
            rec = _record(m)
            last, n = rec["step"], 1
            fresh = last > r.step
            skipped = rec["skipped"] if fresh else 0
            breaker = rec["nonfinite_skipped"] if fresh else 0
            nonfinite = fresh and (rec["grad_nonfinite"] > 0 or math.isinf(rec["grad_norm"]))
        else:
            rec = dict(zip(_NAMES, m.records[-1].item()))
            last, n = rec["step"], len(m.step)
            new = m.step > r.step
            fresh = int(new.sum())
            skipped = int(m.skipped[new].sum())
            breaker = int(m.nonfinite_skipped[new].sum())
            nonfinite = int((((m.grad_nonfinite > 0) | np.isinf(m.grad_norm)) & new).sum())
        r.boot_step = -1
        if r.steps == 0:
            r.first_report_at = now
        job.max_step, job.last_report_at = max(job.max_step, last), now
        r.step = max(r.step, last)
        r.step_time, r.compute_time, r.loss, r.loss_scale = rec["step_time"], rec["compute_time"], rec["loss"], rec["loss_scale"]
        r.local_grad_norm = rec["local_grad_norm"]
        sharded = m.grad_sq is not None
        if not sharded:  # a sharded rank's global norm is known once its shard group reported (:meth:`released`)
            r.grad_norm, r.grad_nonfinite = rec["grad_norm"], int(rec["grad_nonfinite"])
        r.skipped_steps += skipped
        r.nonfinite_skipped += int(breaker)
        r.agent_drops = max(r.agent_drops, m.drops)
        r.agent_cost, r.probe_interval, r.over_budget = m.agent_cost, m.probe_interval, m.over_budget
        r.steps += int(fresh)
        # a NaN norm with no non-finite parameter means "no gradients this step", not a fault
        r.nonfinite_steps += int(nonfinite)
        r.last_report_at = now
        table = job.table
        if table is None or table.world != job.world:
            # a job not proven (its world only what its frames claim) gets a small table: one frame
            # claiming 65,536 ranks took ~240 MB, and frames of a few invented ranks steps apart
            # grew a table of an admitted job to MAX_CELLS (~60 MB) each
            big = job.admitted and job.proven
            table = job.table = StepTable(job.world, MAX_CELLS if big else min(PENDING_CELLS, max(job.world, 1) * MIN_ROWS))
        elif job.admitted and job.proven and table.max_cells < MAX_CELLS:
            table.allow(MAX_CELLS)
        norms = None
        if m.grad_norms is not None:
            norms = (m.schema, m.grad_norms.reshape(n, -1))
        grad_sq = None
        if sharded:  # (its place's schema key, sq_kind, sums): the step's norms are worked out in columns
            if isinstance(m, wire.Report):
                grad_sq = [(m.schema, sq_kind(tuple(d for d, _ in m.grad_sq)), [v for _, v in m.grad_sq])]
            else:
                kind = sq_kind(m.grad_sq_dims)
                grad_sq = [(m.schema, kind, row) for row in m.grad_sq.tolist()]
        guard = None
        if m.nonfinite_slot is not None:
            guard = (m.schema, m.nonfinite_slot if isinstance(m, wire.Report) else m.nonfinite_slot.reshape(n))
        if one:
            rec["probe"] = 1.0 if probe else 0.0
            if guard is not None and not isinstance(m, wire.Report):
                guard = (guard[0], int(guard[1][0]))
            released = table.add_one(r.rank, last, rec, norms and (norms[0], norms[1][0]), grad_sq and grad_sq[0], guard)
        else:
            values = {name: getattr(m, name) for name in TABLE_COLUMNS if name != "probe"}
            values["probe"] = np.zeros(n)
            released = table.add(r.rank, m.step, values, norms, grad_sq, guard)
        self.released(job, released)
        if job.rounds:
            self.rounds.passed(job, r.rank, last - 1 if probe else last)
        if not probe:
            return None
        return self.rounds.add(job, r, m, now)

    @staticmethod
    def proven(job: JobState) -> None:
        """The job was just proven: its step table may hold MAX_CELLS from now on."""
        if job.table is not None and job.admitted and job.table.max_cells < MAX_CELLS:
            job.table.allow(MAX_CELLS)

    def released(self, job: JobState, views: list) -> None:
        """Steps the job's table released: sharded ranks' global norms filled in (and their gauges,
        at the rank's latest step), then the checks judge them."""
        if not views:
            return
        schemas, states = job.schemas, job.ranks
        for v in views:
            if not v.grad_sq:
                continue
            # in rank order (the view's), not arrival order: each step of a job then asks
            # norms_of with the same ranks in the same positions, and its groups are kept
            sq, at, meshes, kinds, values = [], [], [], [], []
            ranks, per = v.ranks.tolist(), v.grad_sq
            for i, k in enumerate(ranks):
                e = per.get(k)
                if e is None:
                    continue
                sq.append(i)
                s = schemas.get(e[0])  # the record's place, also when its schema came after it
                if s is not None and s.mesh is not None:
                    at.append(i)
                    meshes.append(s.mesh)
                    kinds.append(e[1])
                    values.append(e[2])
            own = v.grad_norm[sq]
            v.grad_norm[sq] = math.nan  # until its shard groups are complete
            if at:
                v.grad_norm[at] = norms_of(meshes, kinds, values)[0]
            v.grad_norm[sq] = gradless(v.grad_norm[sq], own, v.grad_nonfinite[sq])
            step = v.step
            for k, x, y in zip([ranks[i] for i in sq], v.grad_norm[sq].tolist(), v.grad_nonfinite[sq].tolist()):
                r = states.get(k)
                if r is not None and r.step == step:  # its gauges show its latest step
                    r.grad_norm, r.grad_nonfinite = x, int(y)
        self.rounds.event("on_steps", job, views)


def _record(m) -> dict:
    """A message's one record as Python numbers (a report, or a ``steps`` batch of one)."""
    if isinstance(m, wire.Report):
        return {c.name: getattr(m, c.name) for c in wire.STEP_COLUMNS}
    return dict(zip(_NAMES, m.records[0].item()))


_NAMES = tuple(c.name for c in wire.STEP_COLUMNS)
