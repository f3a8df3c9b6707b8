"""The bounds the aggregator's state keeps, in one object.

:class:`Limits` gathers every setting the state's rooms read (admission, schemas, rounds, series,
snapshots), so the state takes one object instead of a keyword argument per bound; :meth:`Limits.of`
reads them from an :class:`~.config.AggregatorConfig`, which documents units and defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional


@dataclass
class Limits:
    """Every bound of the aggregator's state; defaults as the aggregator's settings'.

    Attributes:
        grace_s: seconds a round waits for missing ranks (``round_grace_s``).
        max_pending: rounds held open per job (``max_pending_rounds``).
        rank_ttl_s: seconds after which a silent rank is forgotten.
        max_jobs, max_world, max_pending_jobs, max_pending_ranks, max_schema_bytes,
        max_series_per_job, max_series_total, max_pending_bytes, max_label_len, max_step_jump,
        restart_grace_s, boot_takeover_s, proof_steps, proof_rank_share, max_unproven_per_source,
        max_pending_per_source, max_jobs_per_source: the aggregator settings of the same name (``proof_steps`` 0: every
        job is proven as it comes, as the checks' own tests take them).
        round_slice_ranks: rounds of at least this many reports are reconciled in slices
            (:mod:`.rounds`); 0: every round at once.
        group_depth: the exporter's ``--layer-depth``: a round reconciled in slices is also merged
            for export, in a slice of its own; 0: none is.
        rank_view_max: the exporter's ``--rank-series-max``: a snapshot of a job with more ranks
            holds views only of the ranks an active finding names (:mod:`.snapshot`); None: views
            of every rank.
    """

    grace_s: float = 10.0
    max_pending: int = 64
    rank_ttl_s: float = 600.0
    max_jobs: int = 64
    max_world: int = 65_536
    max_pending_jobs: int = 16
    max_pending_ranks: int = 256
    max_schema_bytes: int = 1 << 30
    max_series_per_job: int = 10_000
    max_series_total: int = 15_000
    max_pending_bytes: int = 512 << 20
    max_label_len: int = 200
    max_step_jump: int = 1000
    restart_grace_s: float = 30.0
    boot_takeover_s: float = 3.0
    proof_steps: int = 3
    proof_rank_share: float = 0.5
    max_unproven_per_source: int = 4
    max_pending_per_source: int = 8
    max_jobs_per_source: int = 16
    round_slice_ranks: int = 0
    group_depth: int = 0
    rank_view_max: Optional[int] = None

    #: the limits whose aggregator setting has another name: limit -> setting
    SETTINGS = {"grace_s": "round_grace_s", "max_pending": "max_pending_rounds", "group_depth": "layer_depth",
                "rank_view_max": "rank_series_max"}

    @classmethod
    def of(cls, cfg) -> "Limits":
        """The limits an :class:`~.config.AggregatorConfig` sets (each from the setting of its
        name, or of :attr:`SETTINGS`' name)."""
        return cls(**{f.name: getattr(cfg, cls.SETTINGS.get(f.name, f.name)) for f in fields(cls)})
