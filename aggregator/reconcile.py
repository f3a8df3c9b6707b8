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

import collections
import functools
import math
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

import numpy as np

from gradwatch import statistics, wire

from .shards import combine_params, global_norms, holders, parts

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
        act_grad: float64 [n_ranks, n_layers, 2] (wire ``ACT_GRAD_FIELDS``).
        act_count: float64 [n_ranks, n_layers, 2] (wire ``act_count``: calls, elements), NaN
            where the layer's module did not run (or the agent predates the array).
        module: float64 [n_ranks, n_modules, 3] (wire ``PARAM_FIELDS``, merged per module): grad
            norm, weight norm, grad non-finite count.
        agg: statistic name -> (float64 [len(aggs), n] aggregated over ranks (min/median/max),
            bool [n] observed by any rank), for each row of
            :data:`gradwatch.statistics.STATISTICS`.
        rank_totals: float64 [n_ranks, 3]: the statistics with a ``rank_total`` (non-finite
            counts of activations, output gradients and parameter gradients) summed over layers.
        layer_types: module class name of each layer (``ReLU``, ``Linear``, ...).
        params: parameter names, ``named_parameters`` order.
        fp_grad, fp_weight: uint64 [n_ranks, n_params] fingerprints (see :mod:`gradwatch.wire`).
        fp_grad_seen: bool [n_ranks, n_params]: the rank had a gradient for the parameter.
        fp_weight_seen: bool [n_ranks, n_params]: the rank's schema lists the parameter.
        grad_norm, local_grad_norm, compute_time: float64 [n_ranks] from each rank's report
            (global gradient norm after and before all-reduce; seconds of own work).
        batch, micro: int64 [n_ranks]: samples and forward passes of each rank this step.
        agent_cost: float64 [n_ranks]: each rank's agent cost over its training step time (NaN unknown).
        probe_interval: int64 [n_ranks]: each rank's probe interval in use, steps (0 unknown).
        over_budget: bool [n_ranks]: the rank's agent cannot meet its budget.
        burst: any rank probed this step out of cadence.
        holders: int64 [n_ranks, n_params]: ranks with equal numbers in a column hold the same
            bytes of that parameter (all 0 under DDP; the replicas of one shard under FSDP/HSDP);
            fingerprints are compared within those only. None: all hold the same.
        part: int64 [n_ranks]: ranks with equal numbers run the same part of the model (the same
            pipeline stage and parameter names, :func:`.shards.part`): their own statistics are
            comparable. None: all run the same.
        own_param: float64 [n_ranks, n_params, 3] (wire ``PARAM_FIELDS``): each rank's rows about
            its own part of each parameter as it reported them (before shard groups are
            combined), NaN where not held.
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
    act_count: np.ndarray = None
    agent_cost: np.ndarray = None
    probe_interval: np.ndarray = None
    over_budget: np.ndarray = None
    holders: np.ndarray = None
    part: np.ndarray = None
    own_param: np.ndarray = None


def _union(names_per_rank) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for names in names_per_rank:
        for n in names:
            seen.setdefault(n, None)
    return tuple(seen)


@functools.lru_cache(maxsize=1 << 16)
def _owner(param: str) -> str:
    # cached: the same few thousand names come back every round, once per rank before
    return param.rpartition(".")[0] or param


def _rank_totals(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """float64 [R, n]: each statistic with a ``rank_total`` summed over a rank's layers (NaN skipped)."""
    return np.stack(
        [np.nansum(arrays[s.array][..., s.column], axis=1) for s in statistics.STATISTICS if s.rank_total], axis=-1
    )


def _param_columns(schemas: dict[str, wire.Schema]) -> tuple[tuple[str, ...], dict[str, np.ndarray]]:
    """The union of the schemas' parameter names (first use order) and, per schema digest, int64
    [its parameters]: their columns in that union."""
    params = _union([[p[0] for p in s.params] for s in schemas.values()])
    pidx = {n: i for i, n in enumerate(params)}
    return params, {h: np.array([pidx[p[0]] for p in s.params], dtype=np.int64) for h, s in schemas.items()}


@dataclass(frozen=True)
class StepNorms:
    """Every rank's per-parameter gradient norms of one step (wire ``grad_norms``, sent every step).

    Attributes:
        step: optimizer step index.
        ranks: ranks whose report carried norms under a known schema, ascending.
        params: parameter names, union of their schemas in first-use order.
        norms: float64 [n_ranks, n_params], the float32 wire values; NaN where the rank does not
            hold the parameter or it had no gradient.
        holders: int64 [n_ranks, n_params], :func:`.shards.holders`: ranks with equal numbers in a
            column hold the same bytes of that parameter.
    """

    step: int
    ranks: tuple[int, ...]
    params: tuple[str, ...]
    norms: np.ndarray
    holders: np.ndarray


def step_norms(schemas: dict, step: int, norms: dict[int, tuple[str, np.ndarray]]) -> Optional[StepNorms]:
    """Line up one step's per-parameter gradient norms (``rank -> (schema hash, float32
    [n_params])``, wire ``grad_norms``) by parameter name, as :func:`reconcile` lines up a probed
    step's arrays. Norms under a schema not (or no longer) known, or not matching their schema's
    length, are left out; None when none is left."""
    ranks = tuple(sorted(r for r, (h, row) in norms.items() if h in schemas and len(row) == len(schemas[h].params)))
    if not ranks:
        return None
    used = {norms[r][0]: schemas[norms[r][0]] for r in ranks}
    params, pcols = _param_columns(used)
    out = np.full((len(ranks), len(params)), np.nan)
    for k, r in enumerate(ranks):
        out[k, pcols[norms[r][0]]] = norms[r][1]
    sch = [schemas[norms[r][0]] for r in ranks]
    return StepNorms(step, ranks, params, out,
                     holders([x.mesh for x in sch], [x.shard for x in sch], [pcols[norms[r][0]] for r in ranks],
                             len(params)))


def reconcile(world: int, schemas: dict, step: int, reports: dict[int, wire.Report], complete: bool) -> RoundResult:
    ranks = tuple(sorted(reports))
    sch = [schemas[reports[r].schema] for r in ranks]
    # names are worked out once per distinct schema (every rank of a job usually shares one), not
    # once per rank; in rank order of first use, so unions and orders are what a per-rank pass gives
    by_schema: dict[str, list[int]] = {}
    for k, r in enumerate(ranks):
        by_schema.setdefault(reports[r].schema, []).append(k)
    distinct = [schemas[h] for h in by_schema]
    slot_names = {h: [m + o for m, o, _, _ in schemas[h].slots] for h in by_schema}
    layers = _union(slot_names.values())
    modules = _union([[_owner(p[0]) for p in s.params] for s in distinct])
    params, param_cols = _param_columns({h: schemas[h] for h in by_schema})
    types: dict[str, str] = {}
    for s in distinct:
        for m, o, typ, _ in s.slots:
            types.setdefault(m + o, typ)
    lidx = {n: i for i, n in enumerate(layers)}
    R = len(ranks)
    act = np.full((R, len(layers), len(wire.ACT_FIELDS)), np.nan)
    act_grad = np.full((R, len(layers), len(wire.ACT_GRAD_FIELDS)), np.nan)
    act_count = np.full((R, len(layers), len(statistics.fields("act_count"))), np.nan)
    param = np.full((R, len(params), len(wire.PARAM_FIELDS)), np.nan)
    present = np.zeros((R, len(params)), bool)
    fp_grad = np.zeros((R, len(params)), np.uint64)
    fp_weight = np.zeros((R, len(params)), np.uint64)
    fp_grad_seen = np.zeros((R, len(params)), bool)
    fp_weight_seen = np.zeros((R, len(params)), bool)
    all_pcols: list = [None] * R
    for digest, ks in by_schema.items():
        # the ranks of one schema at once: their rows go to the same columns
        s = schemas[digest]
        cols = np.array([lidx[n] for n in slot_names[digest]], dtype=np.int64)
        pcols = param_cols[digest]
        reps_g = [reports[ranks[k]] for k in ks]
        kk = np.array(ks, dtype=np.int64)[:, None]
        act[kk, cols] = np.stack([x.act for x in reps_g])
        act_grad[kk, cols] = np.stack([x.act_grad for x in reps_g])
        counted = [k for k, x in zip(ks, reps_g) if x.act_count is not None]
        if counted:
            act_count[np.array(counted, dtype=np.int64)[:, None], cols] = np.stack(
                [x.act_count for x in reps_g if x.act_count is not None])
        for k in ks:
            all_pcols[k] = pcols
        rows = np.stack([x.param for x in reps_g])
        param[kk, pcols] = rows
        present[kk, pcols] = True
        fp = [(k, x, row) for k, x, row in zip(ks, reps_g, rows) if x.fp_grad is not None]
        if fp:
            fk = np.array([k for k, _, _ in fp], dtype=np.int64)[:, None]
            has = statistics.observed_rows("param", np.stack([row for _, _, row in fp]))  # had a gradient
            fp_grad[fk, pcols] = np.stack([x.fp_grad for _, x, _ in fp])
            fp_weight[fk, pcols] = np.stack([x.fp_weight for _, x, _ in fp])
            at, col = np.nonzero(has)
            fp_grad_seen[fk[at, 0], pcols[col]] = True
            fp_weight_seen[fk, pcols] = True
    own_param = param  # combine_params returns a new array
    # sharded parameters: each shard group's rows become the parameter's global figures
    param, holders = combine_params([x.mesh for x in sch], [x.shard for x in sch], all_pcols, param)
    reps = [reports[r] for r in ranks]
    norms = global_norms({k: (sch[k].mesh, x.grad_sq) for k, x in enumerate(reps)
                          if x.grad_sq is not None and sch[k].mesh is not None})
    grad_norm = np.array([norms.get(k, math.nan) if x.grad_sq is not None else x.grad_norm
                          for k, x in enumerate(reps)], np.float64)
    # parameters merge into their module as layers merge into a group; summed in parameter order
    owners: dict[str, list[int]] = {m: [] for m in modules}
    for i, p in enumerate(params):
        owners[_owner(p)].append(i)
    module = statistics.merge("param", param, present, [np.array(v, np.int64) for v in owners.values()], in_order=True)
    arrays = {"act": act, "act_grad": act_grad, "param": module, "act_count": act_count}
    agg = statistics.aggregate_all(arrays)
    totals = _rank_totals(arrays)
    return RoundResult(
        step, complete, ranks, layers, modules, act, act_grad, module, agg, totals,
        layer_types=tuple(types.get(n, "") for n in layers),
        params=params, fp_grad=fp_grad, fp_weight=fp_weight,
        fp_grad_seen=fp_grad_seen, fp_weight_seen=fp_weight_seen,
        grad_norm=grad_norm, holders=holders, part=parts(sch), own_param=own_param,
        local_grad_norm=np.array([x.local_grad_norm for x in reps], np.float64),
        compute_time=np.array([x.compute_time for x in reps], np.float64),
        batch=np.array([x.batch for x in reps], np.int64),
        micro=np.array([x.micro for x in reps], np.int64),
        burst=any(x.burst for x in reps), act_count=act_count,
        agent_cost=np.array([x.agent_cost for x in reps], np.float64),
        probe_interval=np.array([x.probe_interval for x in reps], np.int64),
        over_budget=np.array([x.over_budget for x in reps], bool),
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
    act, act_grad, module, act_count = (
        statistics.merge(name, values, np.ones(values.shape[:2], bool), groups)
        for name, values, groups in (("act", rr.act, lgroups), ("act_grad", rr.act_grad, lgroups), ("param", rr.module, mgroups),
                                     ("act_count", rr.act_count, lgroups))
    )
    agg = statistics.aggregate_all({"act": act, "act_grad": act_grad, "param": module, "act_count": act_count})
    types = tuple(
        rr.layer_types[idx[0]] if rr.layer_types and len({rr.layer_types[i] for i in idx}) == 1 else ""
        for idx in lgroups
    )
    return replace(rr, layers=layers, modules=modules, act=act, act_grad=act_grad, module=module, agg=agg,
                   layer_types=types, act_count=act_count)


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
    #: counters summed over the job's ranks, forgotten ones included: ((name, total), ...)
    totals: tuple = ()
    #: the exporter's view of a job above rank_series_max: the ranks whose series it exports
    only: Optional[frozenset] = None


@dataclass(frozen=True)
class Snapshot:
    jobs: tuple[JobView, ...] = ()
    checks: Any = None  # checks.RunnerView
    received: tuple[tuple[str, int], ...] = ()
    rejected: tuple[tuple[str, int], ...] = ()
    decode_seconds: float = 0.0
    decode_count: int = 0
    jobs_evicted: int = 0  # pending jobs evicted (State.max_pending_jobs)


_RANK_FIELDS = tuple(f.name for f in fields(RankView))


def _rank_view(*values) -> RankView:
    """``RankView(*values)`` with every field given, without the frozen dataclass's ``__init__``
    (one ``object.__setattr__`` per field): a snapshot of a 16,384-rank job builds 16,384 of them,
    four times a second."""
    assert len(values) == len(_RANK_FIELDS)
    view = object.__new__(RankView)
    view.__dict__.update(zip(_RANK_FIELDS, values))
    return view


def snapshot(state, wall_now: float) -> Snapshot:
    """Copy what the exporter needs out of ``state`` (called by the writer thread only)."""
    from .state import rank_counters  # state imports this module
    mono_now = state.clock()
    jobs = []
    for job in state.jobs.values():
        ranks = tuple(
            _rank_view(
                r.rank, r.host, r.local_rank, r.step, r.step_time, r.grad_norm, r.grad_nonfinite, r.steps,
                r.probes, r.nonfinite_steps, r.received, r.lost, r.restarts,
                wall_now - (mono_now - r.last_seen), r.drops_base + r.agent_drops, r.errors_base + r.agent_errors,
                r.local_grad_norm, r.compute_time, r.closing,
                r.loss, r.loss_scale, r.skipped_steps,
            )
            for r in job.in_order()
        )
        totals = collections.Counter(getattr(job, "forgotten", ()))
        for r in job.ranks.values():
            for k, v in rank_counters(r).items():
                totals[k] += v
        jobs.append(JobView(job.job, job.world, ranks, job.last_round, job.rounds_complete, job.rounds_incomplete,
                            job.restarts, job.series_dropped, tuple(sorted(totals.items()))))
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
