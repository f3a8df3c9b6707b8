"""Every rank's per-step records of one job, lined up step by step: the step table.

Agents send their per-step records in batches (wire ``steps``, a few per second per rank) and one
with each probed step (wire ``report``). The ranks meet in the all-reduce, so every rank's record of
a step arrives within moments of the others', give or take a batch. The table holds the records of
the steps that not every rank has reported yet, one array [capacity, world] per value the checks
read (:data:`COLUMNS`), a step in row ``step % capacity``: a batch is written with one numpy
assignment per column, whatever its length. A step is *released*, once and in step order, as a
:class:`StepView` of the ranks that reported it:

* when every rank of the world has reported it, together with every older step still waiting;
* ``WAIT_S`` seconds of the aggregator's clock after it was first seen (via :meth:`tick`; a rank
  can die or a record be lost);
* when the steps waiting would span more rows than the table holds: the capacity grows (powers of
  two) up to ``max_cells`` / world steps, so memory is bounded per job whatever its ranks send, and
  beyond it the oldest steps are released first (the span runs from the oldest step waiting or
  arriving to the newest: a step's row is ``step % capacity``).

A record of a step already released, or of one older than the table spans back from the newest
step, is left out (the rank's gauges still took it). The checks that
judge a step as a whole read the views (``Check.on_steps``): after all-reduce every rank holds the
same gradient norm, so a step is judged once, with every rank's local (pre-all-reduce) norm and
own compute time at hand.

Pure numpy; no torch.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

#: seconds (aggregator clock) an incomplete step waits for its missing ranks
WAIT_S = 2.0
#: rows a table starts with (fewer where ``max_cells`` / world is less)
MIN_ROWS = 64
#: cells a pending job's table holds at most (a job without a slot: its world is only what its
#: frames claim): ~4 MB, 4 steps of 16,384 ranks
PENDING_CELLS = 1 << 16
#: cells (rows x world) a table holds at most: with :data:`COLUMNS` about 60 bytes each
MAX_CELLS = 1 << 20
#: rows (steps) a table holds at most, whatever its world: a batch's worth (wire.MAX_STEPS), twice
#: what a job of 1,000 steps a second has waiting for WAIT_S; a few ranks' records far apart no
#: longer grow a table of a small world to MAX_CELLS (~60 MB)
MAX_ROWS = 4096

#: the per-step values the checks read: wire.STEP_COLUMNS names, and whether a probe report carried it
COLUMNS = ("step_time", "compute_time", "compute_wait", "grad_norm", "local_grad_norm", "grad_nonfinite", "probe")


class StepView:
    """One released step: the records of the ranks that reported it, in rank order.

    Attributes:
        step: the optimizer step.
        ranks: int64 [n], ascending.
        step_time, compute_time, compute_wait, grad_norm, local_grad_norm: float64 [n], seconds
            and L2 norms (wire ``STEP_COLUMNS``; ``compute_wait`` NaN where the agent cannot
            measure it; a sharded rank's ``grad_norm`` is the global norm of its shard
            group, NaN until the whole group reported, see :mod:`.shards`).
        grad_nonfinite: float64 [n], parameters with a non-finite gradient.
        probe: bool [n], the record came with a probed step's report.
        norms: ``{rank: (schema hash, float32 [n_params])}``: the ranks' per-parameter gradient
            norms (wire ``grad_norms``), for the ranks that sent them.
        grad_sq: ``{rank: (its place's schema key, shards.sq_kind of its classes' dims, their sums
            of squares)}`` of sharded ranks (opaque to the table; :meth:`.records.Records.released`).
        guard: ``{rank: (schema hash, slot)}``: the ranks whose NaN guard saw a non-finite output
            at this step, and the first slot that held one (wire ``nonfinite_slot``).
    """

    __slots__ = ("step", "ranks", *COLUMNS, "norms", "grad_sq", "guard")

    def __init__(self, step: int, ranks: np.ndarray, columns: dict, norms: dict, grad_sq: dict,
                 guard: Optional[dict] = None):
        self.step, self.ranks, self.norms, self.grad_sq = step, ranks, norms, grad_sq
        self.guard = guard if guard is not None else {}
        for name in COLUMNS:
            setattr(self, name, columns[name])

    def __len__(self) -> int:
        return len(self.ranks)


class StepTable:
    """One job's pending steps (module docstring).

    Args:
        world: ranks of the job.
        max_cells: rows x world held at most.
    """

    def __init__(self, world: int, max_cells: int = MAX_CELLS):
        self.world = world
        self.allow(max_cells)
        self.released = -1  # highest step released so far
        self.oldest = -1  # lowest step waiting, -1 when none
        self.newest = -1  # highest step waiting, -1 when none
        self._alloc(min(MIN_ROWS, self.max_rows))
        self.norms: dict[int, dict[int, tuple]] = {}  # step -> rank -> (schema, row)
        self.grad_sq: dict[int, dict[int, tuple]] = {}  # step -> rank -> grad_sq
        self.guard: dict[int, dict[int, tuple]] = {}  # step -> rank -> (schema, slot), slots >= 0 only

    def allow(self, max_cells: int) -> None:
        """Hold at most ``max_cells`` cells from now on (``max_rows``: a power of two, at least
        one row, at most :data:`MAX_ROWS`; 16 at 65,536 ranks by :data:`MAX_CELLS`)."""
        self.max_cells = max_cells
        self.max_rows = min(MAX_ROWS, 1 << max(0, (max_cells // max(self.world, 1)).bit_length() - 1))

    def _alloc(self, rows: int) -> None:
        self.rows = rows
        self.step_of = np.full(rows, -1, np.int64)  # the step a row holds, -1 free
        self.have = np.zeros((rows, self.world), bool)
        self.count = np.zeros(rows, np.int64)
        self.seen = np.full(rows, np.nan)  # aggregator clock at the first tick after the first record
        self.cols = {name: np.full((rows, self.world), np.nan) for name in COLUMNS}

    @property
    def pending(self) -> int:
        """Steps waiting."""
        return int((self.step_of >= 0).sum())

    def add(self, rank: int, steps: np.ndarray, values: dict, norms: Optional[tuple] = None,
            grad_sq: Optional[list] = None, guard: Optional[tuple] = None) -> list[StepView]:
        """Take ``rank``'s records; return the steps released, ascending.

        Args:
            rank: 0 <= rank < world.
            steps: int64 [n], strictly increasing.
            values: each of :data:`COLUMNS` -> array [n].
            norms: ``(schema hash, float32 [n, n_params])`` of the records, or None.
            grad_sq: per record its ``grad_sq`` (sharded layouts), or None.
            guard: ``(schema hash, int32 [n])``: the records' ``nonfinite_slot``, or None.
        """
        if steps[0] <= self.released:  # late, some or all: steps the checks have judged already
            steps, values, norms, grad_sq, guard = _only(steps > self.released, steps, values, norms, grad_sq, guard)
            if not len(steps):
                return []
        if len(steps) > self.max_rows:  # more than the table holds: a table's worth at a time
            out = []
            for i in range(0, len(steps), self.max_rows):
                part = slice(i, i + self.max_rows)
                out += self.add(rank, steps[part], {k: v[part] for k, v in values.items()},
                                None if norms is None else (norms[0], norms[1][part]),
                                None if grad_sq is None else grad_sq[part],
                                None if guard is None else (guard[0], guard[1][part]))
            return out
        first, last = int(steps[0]), int(steps[-1])
        out = self._room(first, last)
        if first <= self.released:  # making room released these steps' peers' records, or left them behind
            steps, values, norms, grad_sq, guard = _only(steps > self.released, steps, values, norms, grad_sq, guard)
            if not len(steps):
                return out
            first = int(steps[0])
        i0 = first % self.rows
        if last - first + 1 == len(steps) and i0 + len(steps) <= self.rows:
            idx = slice(i0, i0 + len(steps))  # consecutive steps, not wrapping: plain slices, no gather
        else:
            idx = steps % self.rows
        self.step_of[idx] = steps
        self.count[idx] += ~self.have[idx, rank]
        self.have[idx, rank] = True
        for name in COLUMNS:
            self.cols[name][idx, rank] = values[name]
        self.oldest = first if self.oldest < 0 else min(self.oldest, first)
        self.newest = max(self.newest, last)
        if norms is not None:
            schema, rows = norms
            for s, row in zip(steps.tolist(), rows):
                self.norms.setdefault(s, {})[rank] = (schema, row)
        if grad_sq is not None:
            for s, sq in zip(steps.tolist(), grad_sq):
                self.grad_sq.setdefault(s, {})[rank] = sq
        if guard is not None:
            schema, slots = guard
            for j in np.flatnonzero(slots >= 0).tolist():  # almost always none
                self.guard.setdefault(int(steps[j]), {})[rank] = (schema, int(slots[j]))
        done = np.flatnonzero(self.count[idx] >= self.world)
        if len(done):
            last = int(steps[done[-1]])
            out += self._release(self.step_of[(self.step_of >= 0) & (self.step_of <= last)])
        return out

    def add_one(self, rank: int, step: int, values: dict, norms: Optional[tuple] = None,
                grad_sq=None, guard: Optional[tuple] = None) -> list[StepView]:
        """:meth:`add` for one record (``values``: each of :data:`COLUMNS` -> a number; ``norms``:
        ``(schema hash, float32 [n_params])``; ``guard``: ``(schema hash, slot)``), without an array
        per column: one step per second from thousands of ranks comes a record at a time."""
        if step <= self.released:
            return []
        out = self._room(step, step)
        if step <= self.released:
            return out
        i = step % self.rows
        self.step_of[i] = step
        if not self.have[i, rank]:
            self.have[i, rank] = True
            self.count[i] += 1
        for name in COLUMNS:
            self.cols[name][i, rank] = values[name]
        self.oldest = step if self.oldest < 0 else min(self.oldest, step)
        self.newest = max(self.newest, step)
        if norms is not None:
            self.norms.setdefault(step, {})[rank] = norms
        if grad_sq is not None:
            self.grad_sq.setdefault(step, {})[rank] = grad_sq
        if guard is not None and guard[1] >= 0:
            self.guard.setdefault(step, {})[rank] = guard
        if self.count[i] >= self.world:
            out += self._release(self.step_of[(self.step_of >= 0) & (self.step_of <= step)])
        return out

    def tick(self, now: float) -> list[StepView]:
        """Release the steps first seen ``WAIT_S`` or more before ``now`` (and older ones)."""
        held = self.step_of >= 0
        if not held.any():
            return []
        fresh = held & np.isnan(self.seen)
        self.seen[fresh] = now
        due = held & (now - self.seen >= WAIT_S)
        if not due.any():
            return []
        return self._release(self.step_of[held & (self.step_of <= self.step_of[due].max())])

    def forget_rank(self, rank: int) -> None:
        """Drop ``rank``'s waiting records (its agent restarted: what it sent before is another boot's)."""
        self.count -= self.have[:, rank]
        self.have[:, rank] = False
        for per in (self.norms, self.grad_sq, self.guard):
            for d in per.values():
                d.pop(rank, None)

    def _room(self, first: int, last: int) -> list[StepView]:
        """Make the rows span ``first..last`` together with the steps waiting (a step's row is
        ``step % rows``: two steps a table's rows or more apart would share one): grow, else the
        steps that many rows or more behind the newest go: those waiting are released, and
        records of older ones are late (``released`` moves up to them)."""
        lo, hi = (first, last) if self.oldest < 0 else (min(first, self.oldest), max(last, self.newest))
        span = hi - lo + 1
        if span <= self.rows:
            return []
        if self.rows < self.max_rows:
            self._grow(min(self.max_rows, 1 << (span - 1).bit_length()))
        if span <= self.rows:
            return []
        held = self.step_of[self.step_of >= 0]
        out = self._release(held[held <= hi - self.rows])
        self.released = max(self.released, hi - self.rows)
        return out

    def _grow(self, rows: int) -> None:
        step_of, have, count, seen, cols = self.step_of, self.have, self.count, self.seen, self.cols
        self._alloc(rows)
        used = np.flatnonzero(step_of >= 0)
        idx = step_of[used] % rows
        self.step_of[idx], self.have[idx], self.count[idx], self.seen[idx] = step_of[used], have[used], count[used], seen[used]
        for name in COLUMNS:
            self.cols[name][idx] = cols[name][used]

    def _release(self, steps: np.ndarray) -> list[StepView]:
        out = []
        for s in np.sort(steps).tolist():
            i = s % self.rows
            ranks = np.flatnonzero(self.have[i])
            columns = {name: self.cols[name][i, ranks] for name in COLUMNS}
            columns["probe"] = columns["probe"] > 0
            out.append(StepView(s, ranks, columns, self.norms.pop(s, {}), self.grad_sq.pop(s, {}), self.guard.pop(s, {})))
            self.step_of[i], self.count[i], self.seen[i] = -1, 0, math.nan
            self.have[i] = False
            self.released = max(self.released, s)
        if out:
            held = self.step_of[self.step_of >= 0]
            self.oldest, self.newest = (int(held.min()), int(held.max())) if held.size else (-1, -1)
        return out


def _only(keep: np.ndarray, steps, values, norms, grad_sq, guard):
    """The records where ``keep`` holds (the same objects when it holds everywhere)."""
    if keep.all():
        return steps, values, norms, grad_sq, guard
    return (steps[keep], {k: v[keep] for k, v in values.items()}, None if norms is None else (norms[0], norms[1][keep]),
            None if grad_sq is None else [g for g, k in zip(grad_sq, keep) if k],
            None if guard is None else (guard[0], guard[1][keep]))
