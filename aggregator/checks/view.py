"""What a check may read of a job: :class:`JobView`, and the naming rules checks share.

The runner gives every check event the job's view, never the aggregator's mutable job state
(``jobs.JobState``): a check reads what the interface below says, and nothing it does through it
changes the job. A test may give a check any object with the members it reads (a label and ranks,
say).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Optional

from ..reconcile import StepNorms, owner, step_norms
from ..shards import part

__all__ = ["JobView", "owner"]


class JobView:
    """A read-only view of one job.

    Attributes:
        job: the job's label (its ``job_id``).
        world: its world size.
        epoch: a number that changes whenever a rank comes, goes, restarts or takes another place
            (what a check derives per rank from those may be kept until it changes).
        overloaded_at: aggregator clock of the latest frame of this job the intake dropped
            (``-inf``: none): silence since may be the aggregator's own.
        ranks: ``{rank: its record}``, read-only; each record (``jobs.RankState``) is the
            aggregator's own: read its fields (``step``, ``last_seen``, ``closing``,
            ``close_reason``, ``boot``, ``host``, ``local_rank``, ``in_step_s``, ``waiting``,
            ``runnable``, ...), never change them.
        schemas: ``{schema key: wire.Schema}``, read-only: the job's schemas and placed copies.
    """

    __slots__ = ("_state", "_ranks", "_ranks_of", "_schemas", "_schemas_of")

    def __init__(self, state):
        self._state = state
        self._ranks = self._ranks_of = self._schemas = self._schemas_of = None

    @property
    def job(self) -> str:
        return self._state.job

    @property
    def world(self) -> int:
        return self._state.world

    @property
    def epoch(self) -> int:
        return self._state.epoch

    @property
    def overloaded_at(self) -> float:
        return self._state.overloaded_at

    @property
    def ranks(self) -> Mapping:
        got = self._state.ranks
        if got is not self._ranks_of:  # one read-only proxy per dict the job holds
            self._ranks, self._ranks_of = MappingProxyType(got), got
        return self._ranks

    @property
    def schemas(self) -> Mapping:
        got = self._state.schemas
        if got is not self._schemas_of:
            self._schemas, self._schemas_of = MappingProxyType(got), got
        return self._schemas

    def in_order(self) -> list:
        """The ranks' records by rank (the job's own list, kept until a rank comes or goes: read it,
        never change it)."""
        return self._state.in_order()

    def columns(self):
        """The ranks' fields the ticks' checks judge, one read-only array each in :meth:`in_order`
        order (``jobs.RankColumns``: ``step``, ``steps``, ``last_seen``, ``last_report_at``,
        ``closing``), read in one pass per tick."""
        return self._state.columns()

    def ended_in_overload(self, window: float) -> Optional[float]:
        """The job's latest overload drop (aggregator clock) when a rank said goodbye within
        ``window`` seconds of it (the goodbyes of others may be among the frames dropped); None
        otherwise."""
        return self._state.ended_in_overload(window)

    def part_of(self, rank: int) -> Optional[tuple]:
        """The part of the model ``rank`` runs (:func:`.shards.part` of its current schema: ranks of
        one part are peers whose own statistics compare), or None when its schema is not known."""
        r = self._state.ranks.get(rank)
        s = self._state.schemas.get(r.schema) if r is not None else None
        return part(s) if s is not None else None

    def step_norms(self, step: int, norms: dict) -> Optional[StepNorms]:
        """One step's per-parameter gradient norms (``{rank: (schema key, float32 [n_params])}``,
        a released step's ``norms``) lined up by parameter name under the job's schemas, with the
        ranks holding the same bytes of each (:func:`.reconcile.step_norms`); None when no norms
        are under a known schema."""
        return step_norms(self._state.schemas, step, norms)
