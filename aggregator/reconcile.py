"""Reconciliation of one probed step across ranks, and the immutable snapshot that scrapes read.

:func:`reconcile` lines up every rank's report of one step by layer name (ranks may even disagree
on the schema), aggregates each per-layer statistic over the ranks that observed it (min, median,
max; a NaN value, unlike an unobserved one, propagates) and totals each rank over its layers.
Layer names are module paths with an output suffix (``blocks.0.mlp.fc``, ``lstm[0]``); parameter
statistics are grouped by the module that owns them (``blocks.0.mlp.fc`` for
``blocks.0.mlp.fc.weight`` and ``.bias``), their gradient and weight norms combined as the L2 norm
over the module's parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from gradwatch import wire

AGGS = ("min", "median", "max")

#: per-layer statistics exported, with the wire array and column they come from
LAYER_STATS = {
    "activation_mean": ("act", 0),
    "activation_std": ("act", 1),
    "activation_min": ("act", 2),
    "activation_max": ("act", 3),
    "activation_zero_ratio": ("act", 4),
    "activation_nonfinite": ("act", 5),
    "output_grad_norm": ("act_grad", 0),
    "output_grad_nonfinite": ("act_grad", 1),
    "grad_norm": ("module", 0),
    "weight_norm": ("module", 1),
    "grad_nonfinite": ("module", 2),
}


@dataclass(frozen=True)
class RoundResult:
    """One reconciled probed step.

    Attributes:
        step: optimizer step index.
        complete: every rank of the world reported.
        ranks: ranks that reported, ascending.
        layers: activation slot names, forward order.
        modules: names of modules owning parameters, ``named_parameters`` order.
        act: float64 [n_ranks, n_layers, 6] (wire ``ACT_FIELDS``), NaN where not observed.
        act_grad: float64 [n_ranks, n_layers, 2].
        module: float64 [n_ranks, n_modules, 3]: grad norm, weight norm, grad non-finite count.
        agg: statistic name -> (float64 [3, n] min/median/max over ranks, bool [n] observed by
            any rank), for each of ``LAYER_STATS``.
        rank_totals: float64 [n_ranks, 3]: non-finite counts summed over layers of activations,
            output gradients and parameter gradients.
    """

    step: int
    complete: bool
    ranks: tuple[int, ...]
    layers: tuple[str, ...]
    modules: tuple[str, ...]
    act: np.ndarray
    act_grad: np.ndarray
    module: np.ndarray
    agg: dict
    rank_totals: np.ndarray


def _union(names_per_rank) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for names in names_per_rank:
        for n in names:
            seen.setdefault(n, None)
    return tuple(seen)


def _owner(param: str) -> str:
    return param.rpartition(".")[0] or param


def _aggregate(values: np.ndarray, observed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """min/median/max over axis 0 of ``values`` where ``observed``: float64 [3, n], and bool [n]
    telling which columns any rank observed. An observed NaN propagates."""
    v = np.where(observed, values, np.nan)
    out = np.full((3, values.shape[1]), np.nan)
    cols = observed.any(axis=0)
    if cols.any():
        vc = v[:, cols]
        out[0, cols] = np.nanmin(vc, axis=0)
        out[1, cols] = np.nanmedian(vc, axis=0)
        out[2, cols] = np.nanmax(vc, axis=0)
        poisoned = (np.isnan(values) & observed)[:, cols].any(axis=0)
        out[:, np.flatnonzero(cols)[poisoned]] = np.nan
    return out, cols


def reconcile(world: int, schemas: dict, step: int, reports: dict[int, wire.Report], complete: bool) -> RoundResult:
    ranks = tuple(sorted(reports))
    sch = [schemas[reports[r].schema] for r in ranks]
    slot_names = [[m + o for m, o, _, _ in s.slots] for s in sch]
    layers = _union(slot_names)
    modules = _union([[_owner(p[0]) for p in s.params] for s in sch])
    lidx = {n: i for i, n in enumerate(layers)}
    midx = {n: i for i, n in enumerate(modules)}
    R = len(ranks)
    act = np.full((R, len(layers), 6), np.nan)
    act_grad = np.full((R, len(layers), 2), np.nan)
    sq = np.zeros((R, len(modules), 3))
    seen_grad = np.zeros((R, len(modules)), bool)
    for k, r in enumerate(ranks):
        rep, s = reports[r], sch[k]
        cols = [lidx[n] for n in slot_names[k]]
        act[k, cols] = rep.act
        act_grad[k, cols] = rep.act_grad
        owners = np.array([midx[_owner(p[0])] for p in s.params], dtype=np.int64)
        p = rep.param.astype(np.float64)
        has = ~np.isnan(p[:, 2])
        np.add.at(sq[k, :, 0], owners[has], p[has, 0] ** 2)
        np.add.at(sq[k, :, 1], owners, p[:, 1] ** 2)
        np.add.at(sq[k, :, 2], owners[has], p[has, 2])
        seen_grad[k, owners[has]] = True
    module = np.stack([np.sqrt(sq[..., 0]), np.sqrt(sq[..., 1]), sq[..., 2]], axis=-1)
    module[..., 0][~seen_grad] = np.nan
    module[..., 2][~seen_grad] = np.nan

    arrays = {"act": act, "act_grad": act_grad, "module": module}
    observed = {
        "act": ~np.isnan(act[..., 5]),
        "act_grad": ~np.isnan(act_grad[..., 1]),
        "module": seen_grad,
    }
    agg = {}
    for name, (src, col) in LAYER_STATS.items():
        obs = observed[src] if not (src == "module" and col == 1) else np.ones_like(seen_grad)
        agg[name] = _aggregate(arrays[src][..., col], obs)
    totals = np.stack(
        [
            np.nansum(act[..., 5], axis=1),
            np.nansum(act_grad[..., 1], axis=1),
            np.nansum(module[..., 2], axis=1),
        ],
        axis=-1,
    )
    return RoundResult(step, complete, ranks, layers, modules, act, act_grad, module, agg, totals)


# --- the snapshot read at scrape time ---------------------------------------------------------


@dataclass(frozen=True)
class RankView:
    rank: int
    host: str
    local_rank: int
    step: int
    step_time: float
    grad_norm: float
    grad_nonfinite: int
    steps: int
    probes: int
    nonfinite_steps: int
    received: int
    lost: int
    restarts: int
    last_seen: float  # wall clock, seconds since the epoch
    agent_drops: int
    agent_errors: int


@dataclass(frozen=True)
class JobView:
    job: str
    world: int
    ranks: tuple[RankView, ...]
    last_round: Optional[RoundResult]
    rounds_complete: int
    rounds_incomplete: int


@dataclass(frozen=True)
class Snapshot:
    jobs: tuple[JobView, ...] = ()
    received: tuple[tuple[str, int], ...] = ()
    rejected: tuple[tuple[str, int], ...] = ()
    decode_seconds: float = 0.0
    decode_count: int = 0


def snapshot(state, wall_now: float) -> Snapshot:
    """Copy what the exporter needs out of ``state`` (called by the writer thread only)."""
    mono_now = state.clock()
    jobs = []
    for job in state.jobs.values():
        ranks = tuple(
            RankView(
                r.rank, r.host, r.local_rank, r.step, r.step_time, r.grad_norm, r.grad_nonfinite, r.steps,
                r.probes, r.nonfinite_steps, r.received, r.lost, r.restarts,
                wall_now - (mono_now - r.last_seen), r.agent_drops, r.agent_errors,
            )
            for r in sorted(job.ranks.values(), key=lambda x: x.rank)
        )
        jobs.append(JobView(job.job, job.world, ranks, job.last_round, job.rounds_complete, job.rounds_incomplete))
    return Snapshot(
        tuple(jobs),
        tuple(sorted(state.received.items())),
        tuple(sorted(state.rejected.items())),
        state.decode_seconds,
        state.decode_count,
    )


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
