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
from dataclasses import dataclass, replace
from typing import Any, Optional

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
        layer_types: module class name of each layer (``ReLU``, ``Linear``, ...).
        params: parameter names, ``named_parameters`` order.
        fp_grad, fp_weight: uint64 [n_ranks, n_params] fingerprints (see :mod:`gradwatch.wire`).
        fp_grad_seen: bool [n_ranks, n_params]: the rank had a gradient for the parameter.
        fp_weight_seen: bool [n_ranks, n_params]: the rank's schema lists the parameter.
        grad_norm, local_grad_norm, compute_time: float64 [n_ranks] from each rank's report
            (global gradient norm after and before all-reduce; seconds of own work).
        batch, micro: int64 [n_ranks]: samples and forward passes of each rank this step.
        burst: any rank probed this step out of cadence.
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
    layer_types: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    fp_grad: np.ndarray = None
    fp_weight: np.ndarray = None
    fp_grad_seen: np.ndarray = None
    fp_weight_seen: np.ndarray = None
    grad_norm: np.ndarray = None
    local_grad_norm: np.ndarray = None
    compute_time: np.ndarray = None
    batch: np.ndarray = None
    micro: np.ndarray = None
    burst: bool = False


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
    out = np.full((3, values.shape[1]), np.nan)
    cols = observed.any(axis=0)
    # a column with an observed NaN stays NaN; the others have at least one value to reduce
    clean = cols & ~(np.isnan(values) & observed).any(axis=0)
    if clean.any():
        vc = np.where(observed, values, np.nan)[:, clean]
        out[0, clean] = np.nanmin(vc, axis=0)
        out[1, clean] = np.nanmedian(vc, axis=0)
        out[2, clean] = np.nanmax(vc, axis=0)
    return out, cols


def reconcile(world: int, schemas: dict, step: int, reports: dict[int, wire.Report], complete: bool) -> RoundResult:
    ranks = tuple(sorted(reports))
    sch = [schemas[reports[r].schema] for r in ranks]
    slot_names = [[m + o for m, o, _, _ in s.slots] for s in sch]
    layers = _union(slot_names)
    modules = _union([[_owner(p[0]) for p in s.params] for s in sch])
    params = _union([[p[0] for p in s.params] for s in sch])
    pidx = {n: i for i, n in enumerate(params)}
    types: dict[str, str] = {}
    for s in sch:
        for m, o, typ, _ in s.slots:
            types.setdefault(m + o, typ)
    lidx = {n: i for i, n in enumerate(layers)}
    midx = {n: i for i, n in enumerate(modules)}
    R = len(ranks)
    act = np.full((R, len(layers), 6), np.nan)
    act_grad = np.full((R, len(layers), 2), np.nan)
    sq = np.zeros((R, len(modules), 3))
    seen_grad = np.zeros((R, len(modules)), bool)
    fp_grad = np.zeros((R, len(params)), np.uint64)
    fp_weight = np.zeros((R, len(params)), np.uint64)
    fp_grad_seen = np.zeros((R, len(params)), bool)
    fp_weight_seen = np.zeros((R, len(params)), bool)
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
        pcols = np.array([pidx[p[0]] for p in s.params], dtype=np.int64)
        if rep.fp_grad is not None:
            fp_grad[k, pcols] = rep.fp_grad
            fp_weight[k, pcols] = rep.fp_weight
            fp_grad_seen[k, pcols[has]] = True
            fp_weight_seen[k, pcols] = True
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
    reps = [reports[r] for r in ranks]
    return RoundResult(
        step, complete, ranks, layers, modules, act, act_grad, module, agg, totals,
        layer_types=tuple(types.get(n, "") for n in layers),
        params=params, fp_grad=fp_grad, fp_weight=fp_weight,
        fp_grad_seen=fp_grad_seen, fp_weight_seen=fp_weight_seen,
        grad_norm=np.array([x.grad_norm for x in reps], np.float64),
        local_grad_norm=np.array([x.local_grad_norm for x in reps], np.float64),
        compute_time=np.array([x.compute_time for x in reps], np.float64),
        batch=np.array([x.batch for x in reps], np.int64),
        micro=np.array([x.micro for x in reps], np.int64),
        burst=any(x.burst for x in reps),
    )


def layer_group(name: str, depth: int) -> str:
    """The first ``depth`` dot-separated components of a layer's module path (``depth`` 0: all)."""
    return ".".join(name.split(".")[:depth]) if depth > 0 else name


def _groups(names: tuple[str, ...], depth: int) -> tuple[tuple[str, ...], list[np.ndarray]]:
    members: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        members.setdefault(layer_group(n, depth), []).append(i)
    return tuple(members), [np.array(v, dtype=np.int64) for v in members.values()]


def group_layers(rr: RoundResult, depth: int) -> RoundResult:
    """``rr`` with its layers and modules merged by :func:`layer_group` (case C34: bounded series).

    Member layers are combined per rank, then aggregated over ranks as :func:`reconcile` does:
    norms (output gradient, parameter gradient, weight) as the L2 norm over the members
    (sqrt of the sum of squares), non-finite counts summed, activation min and max as the min and
    max, the mean as the mean of the members' means and the std pooled from the members' means and
    stds (each member weighted equally: element counts are not on the wire), the zero ratio as the
    largest member's (a dead member stays visible). Unobserved members are left out; an observed
    NaN propagates. Only the per-layer fields change; parameters and fingerprints are untouched.
    """
    if depth <= 0:
        return rr
    layers, lgroups = _groups(rr.layers, depth)
    modules, mgroups = _groups(rr.modules, depth)
    R = len(rr.ranks)
    act = np.full((R, len(layers), 6), np.nan)
    act_grad = np.full((R, len(layers), 2), np.nan)
    module = np.full((R, len(modules), 3), np.nan)
    a_obs, g_obs, m_obs = ~np.isnan(rr.act[..., 5]), ~np.isnan(rr.act_grad[..., 1]), ~np.isnan(rr.module[..., 2])
    with np.errstate(invalid="ignore", divide="ignore"):
        for g, idx in enumerate(lgroups):
            o, v = a_obs[:, idx], rr.act[:, idx]
            n = o.sum(axis=1)
            mean = np.where(o, v[..., 0], 0).sum(axis=1) / n
            var = np.where(o, v[..., 1] ** 2 + v[..., 0] ** 2, 0).sum(axis=1) / n - mean**2
            act[:, g] = np.stack([
                mean, np.sqrt(np.maximum(var, 0)),
                np.where(o, v[..., 2], np.inf).min(axis=1), np.where(o, v[..., 3], -np.inf).max(axis=1),
                np.where(o, v[..., 4], -np.inf).max(axis=1), np.where(o, v[..., 5], 0).sum(axis=1),
            ], axis=-1)
            act[n == 0, g] = np.nan
            o, v = g_obs[:, idx], rr.act_grad[:, idx]
            act_grad[:, g] = np.stack([
                np.sqrt(np.where(o, v[..., 0] ** 2, 0).sum(axis=1)), np.where(o, v[..., 1], 0).sum(axis=1),
            ], axis=-1)
            act_grad[~o.any(axis=1), g] = np.nan
        for g, idx in enumerate(mgroups):
            o, v = m_obs[:, idx], rr.module[:, idx]
            module[:, g, 0] = np.sqrt(np.where(o, v[..., 0] ** 2, 0).sum(axis=1))
            module[:, g, 1] = np.sqrt((v[..., 1] ** 2).sum(axis=1))
            module[:, g, 2] = np.where(o, v[..., 2], 0).sum(axis=1)
            module[~o.any(axis=1), g, 0::2] = np.nan
    arrays = {"act": act, "act_grad": act_grad, "module": module}
    observed = {"act": ~np.isnan(act[..., 5]), "act_grad": ~np.isnan(act_grad[..., 1]), "module": ~np.isnan(module[..., 2])}
    agg = {}
    for name, (src, col) in LAYER_STATS.items():
        obs = observed[src] if not (src == "module" and col == 1) else np.ones_like(observed["module"])
        agg[name] = _aggregate(arrays[src][..., col], obs)
    types = tuple(
        rr.layer_types[idx[0]] if rr.layer_types and len({rr.layer_types[i] for i in idx}) == 1 else ""
        for idx in lgroups
    )
    return replace(rr, layers=layers, modules=modules, act=act, act_grad=act_grad, module=module, agg=agg, layer_types=types)


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
    local_grad_norm: float = math.nan
    compute_time: float = math.nan
    closing: bool = False
    loss: float = math.nan
    loss_scale: float = math.nan
    skipped_steps: int = 0


@dataclass(frozen=True)
class JobView:
    job: str
    world: int
    ranks: tuple[RankView, ...]
    last_round: Optional[RoundResult]
    rounds_complete: int
    rounds_incomplete: int
    restarts: int = 0
    series_dropped: int = 0  # per-layer series of last_round over the job's cap (state.cap_series)


@dataclass(frozen=True)
class Snapshot:
    jobs: tuple[JobView, ...] = ()
    checks: Any = None  # checks.RunnerView
    received: tuple[tuple[str, int], ...] = ()
    rejected: tuple[tuple[str, int], ...] = ()
    decode_seconds: float = 0.0
    decode_count: int = 0
    jobs_evicted: int = 0  # pending jobs evicted (State.max_pending_jobs)


def snapshot(state, wall_now: float) -> Snapshot:
    """Copy what the exporter needs out of ``state`` (called by the writer thread only)."""
    mono_now = state.clock()
    jobs = []
    for job in state.jobs.values():
        ranks = tuple(
            RankView(
                r.rank, r.host, r.local_rank, r.step, r.step_time, r.grad_norm, r.grad_nonfinite, r.steps,
                r.probes, r.nonfinite_steps, r.received, r.lost, r.restarts,
                wall_now - (mono_now - r.last_seen), r.drops_base + r.agent_drops, r.errors_base + r.agent_errors,
                r.local_grad_norm, r.compute_time, r.closing,
                r.loss, r.loss_scale, r.skipped_steps,
            )
            for r in sorted(job.ranks.values(), key=lambda x: x.rank)
        )
        jobs.append(JobView(job.job, job.world, ranks, job.last_round, job.rounds_complete, job.rounds_incomplete,
                            job.restarts, job.series_dropped))
    return Snapshot(
        tuple(jobs),
        state.runner.view() if state.runner is not None else None,
        tuple(sorted(state.received.items())),
        tuple(sorted(state.rejected.items())),
        state.decode_seconds,
        state.decode_count,
        getattr(state, "jobs_evicted", 0),
    )


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
