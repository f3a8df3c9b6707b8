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
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from gradwatch import columns, wire

from . import reductions
from .shards import combine, global_norms, gradless, holders, parts, shard_groups

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
            :data:`gradwatch.columns.STATISTICS`; a round merged for export
            (:attr:`grouped`) aggregates its own layers when a reader first asks
            (:class:`.reductions.LazyAggregates`).
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
        grouped: this round with its layers and modules merged for export at the aggregator's
            ``--layer-depth`` (:func:`group_layers`), made with the round (a slice of its own in
            :func:`reconcile_in_slices`) so that no scrape has to: at 16,384 ranks it takes
            0.1-0.3 s, which a scrape waited for, and more beside the writer. None at depth 0.
        group_depth: the depth this round's layers were merged at (0: not merged).
    """

    step: int
    complete: bool
    ranks: tuple[int, ...]
    layers: tuple[str, ...]
    modules: tuple[str, ...]
    act: np.ndarray
    act_grad: np.ndarray
    module: np.ndarray
    agg: Mapping
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
    holders: np.ndarray = None
    part: np.ndarray = None
    own_param: np.ndarray = None
    grouped: Optional["RoundResult"] = None
    group_depth: int = 0


def _union(names_per_rank) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for names in names_per_rank:
        for n in names:
            seen.setdefault(n, None)
    return tuple(seen)


@functools.lru_cache(maxsize=1 << 16)
def owner(param: str) -> str:
    """The module owning a parameter: its name without the last component (``blocks.1.fc.weight``
    -> ``blocks.1.fc``), the name itself for a top-level parameter."""
    # cached: the same few thousand names come back every round, once per rank before
    return param.rpartition(".")[0] or param


def _rank_totals(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """float64 [R, n]: each statistic with a ``rank_total`` summed over a rank's layers (NaN skipped)."""
    return np.stack(
        [np.nansum(arrays[s.array][..., s.column], axis=1) for s in columns.STATISTICS if s.rank_total], axis=-1
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


def _placed(s: wire.Schema) -> bool:
    """A schema ranks' values can be held under: without a mesh, or placed on its mesh (a rank's
    records sent before its schema came under the bare hash: where on the mesh is unknown)."""
    return s.mesh is None or len(s.mesh.coord) == len(s.mesh.sizes)


def step_norms(schemas: dict, step: int, norms: dict[int, tuple[str, np.ndarray]]) -> Optional[StepNorms]:
    """Line up one step's per-parameter gradient norms (``rank -> (schema hash, float32
    [n_params])``, wire ``grad_norms``) by parameter name, as :func:`reconcile` lines up a probed
    step's arrays. Norms under a schema not (or no longer) known, not placed on its mesh, or not
    matching their schema's length, are left out; None when none is left."""
    ranks = tuple(sorted(r for r, (h, row) in norms.items()
                         if h in schemas and len(row) == len(schemas[h].params) and _placed(schemas[h])))
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


@dataclass(frozen=True, eq=False)
class Layout:
    """Everything about a round that depends only on its distinct schemas (in order of first use
    by ascending rank): names, their unions and orders, where each schema's rows go, the modules'
    merge plan, shard holders, pipeline parts. A job's rounds share one (:class:`LayoutCache`).

    Attributes:
        schemas: the schemas, first use order.
        layers, modules, params, layer_types: as in :class:`RoundResult`.
        slot_cols, param_cols: per schema, int64 [its slots] / [its parameters]: their columns
            among ``layers`` / ``params``.
        dense: one schema whose slots and parameters are exactly ``layers`` and ``params`` in
            order (every rank's arrays stack as they are).
        sharded: some schema has a mesh and shards (:func:`.shards.combine_params` has work).
        module_plan: :class:`~.reductions.MergePlan` of the parameters into ``modules``.
        holders: int64 [n_schemas, n_params], :func:`.shards.holders` per schema (numbered as
            over the ranks: in first use order).
        parts: int64 [n_schemas], :func:`.shards.parts` per schema.
        kinds: int64 [n_schemas]: schemas of one number hold the same lists (the same columns).
        index: ``{schema hash: its position in schemas}``.
        groups: :meth:`shard_groups`' cache.
    """

    schemas: tuple
    layers: tuple[str, ...]
    modules: tuple[str, ...]
    params: tuple[str, ...]
    layer_types: tuple[str, ...]
    slot_cols: tuple
    param_cols: tuple
    dense: bool
    sharded: bool
    module_plan: reductions.MergePlan
    holders: np.ndarray
    parts: np.ndarray
    kinds: np.ndarray
    index: dict = field(default_factory=dict, compare=False, repr=False)
    groups: dict = field(default_factory=dict, compare=False, repr=False)

    def shard_groups(self, which: np.ndarray):
        """:func:`.shards.shard_groups` of a round whose ranks' reports are under ``lay.schemas[which]``
        (int64 [R]); kept for the next rounds of the same ranks (a few sets of them)."""
        key = which.tobytes()
        g = self.groups.get(key)
        if g is None:
            if len(self.groups) >= 2:
                self.groups.clear()
            sch = [self.schemas[i] for i in which.tolist()]
            g = self.groups[key] = shard_groups([x.mesh for x in sch], [x.shard for x in sch],
                                                [self.param_cols[i] for i in which.tolist()])
        return g

    @staticmethod
    def of(schemas) -> "Layout":
        """The layout of ``schemas`` (:class:`~gradwatch.wire.Schema`, first use order). Schemas
        holding the same lists (the ranks of a mesh placed on one schema, ``schemas.SchemaStore.place``: a sharded
        job's ranks differ in mesh coordinates only) share their columns, worked out once."""
        schemas = tuple(schemas)
        kinds: dict[tuple[int, int], int] = {}
        kind = [kinds.setdefault((id(s.slots), id(s.params)), len(kinds)) for s in schemas]
        firsts = []  # the first schema of each kind
        for k, s in zip(kind, schemas):
            if k == len(firsts):
                firsts.append(s)
        slot_names = [[m + o for m, o, _, _ in s.slots] for s in firsts]
        layers = _union(slot_names)
        lidx = {n: i for i, n in enumerate(layers)}
        params, pcols = _param_columns({k: s for k, s in enumerate(firsts)})
        types: dict[str, str] = {}
        for s in firsts:
            for m, o, typ, _ in s.slots:
                types.setdefault(m + o, typ)
        modules = _union([[owner(p[0]) for p in s.params] for s in firsts])
        owners: dict[str, list[int]] = {m: [] for m in modules}
        for i, p in enumerate(params):
            owners[owner(p)].append(i)
        kind_cols = [np.array([lidx[n] for n in names], np.int64) for names in slot_names]
        slot_cols = tuple(kind_cols[c] for c in kind)
        param_cols = tuple(pcols[c] for c in kind)
        dense = (len(firsts) == 1 and np.array_equal(kind_cols[0], np.arange(len(layers)))
                 and np.array_equal(pcols[0], np.arange(len(params))))
        return Layout(
            schemas, layers, modules, params, tuple(types.get(n, "") for n in layers), slot_cols, param_cols, dense,
            sharded=any(s.mesh is not None and s.shard for s in schemas),
            module_plan=reductions.merge_plan([np.array(v, np.int64) for v in owners.values()]),
            holders=holders([s.mesh for s in schemas], [s.shard for s in schemas], list(param_cols), len(params)),
            parts=parts(list(schemas)),
            kinds=np.asarray(kind, np.int64),
            index={s.hash: i for i, s in enumerate(schemas)},
        )


class LayoutCache:
    """A job's recent :class:`Layout`\\ s, keyed by the tuple of their schemas' hashes (first use
    order). A hit must hold the very schema objects the job holds now (a job that dropped and
    relearned a schema, or another job's state under the same hashes, gets its own layout).

    Args:
        size: layouts kept, least recently used dropped first.
        max_schemas: and at most this many schemas over the layouts kept (the newest is kept
            whatever its size): a sharded job's layout holds a placed schema per rank, its holders
            and shard groups (~70 MB at 16,384 ranks x 200 parameters), and its rounds missing
            other ranks each make one.
    """

    def __init__(self, size: int = 8, max_schemas: int = 1 << 15):
        self.size, self.max_schemas = size, max_schemas
        self._layouts: collections.OrderedDict = collections.OrderedDict()
        self.hits = self.misses = 0

    def get(self, order: tuple[str, ...], schemas: dict) -> Layout:
        """A layout holding ``schemas[h] for h in order`` (:attr:`Layout.index` says where): theirs,
        or the latest layout's when it holds them all and no other lists (a sharded job's round
        missing some ranks: the layout of all its ranks' places, made once)."""
        lay = self._layouts.get(order)
        if lay is not None and all(a is schemas[h] for a, h in zip(lay.schemas, order)):
            self._layouts.move_to_end(order)
            self.hits += 1
            return lay
        if self._layouts and len(order) > 1:
            key, lay = next(reversed(self._layouts.items()))
            at = [lay.index.get(h) for h in order]
            if (None not in at and all(lay.schemas[i] is schemas[h] for i, h in zip(at, order))
                    and list(dict.fromkeys(lay.kinds[at].tolist())) == list(range(int(lay.kinds.max()) + 1))):
                # the same lists, first used in the same order: the same columns
                self._layouts.move_to_end(key)
                self.hits += 1
                return lay
        self.misses += 1
        lay = self._layouts[order] = Layout.of(schemas[h] for h in order)
        self._layouts.move_to_end(order)
        held = sum(len(x.schemas) for x in self._layouts.values())
        while len(self._layouts) > self.size or (len(self._layouts) > 1 and held > self.max_schemas):
            held -= len(self._layouts.popitem(last=False)[1].schemas)
        return lay


def reconcile(world: int, schemas: dict, step: int, reports: dict[int, wire.Report], complete: bool,
              layouts: Optional[LayoutCache] = None, group_depth: int = 0) -> RoundResult:
    """Line up one probed step's reports (``rank -> report``, each under a schema in ``schemas``)
    into a :class:`RoundResult`. ``layouts``: the job's :class:`LayoutCache` (None: work the
    layout out afresh). ``group_depth`` > 0: also merge its layers for export
    (:attr:`RoundResult.grouped`)."""
    work = reconcile_in_slices(world, schemas, step, reports, complete, layouts, group_depth)
    while True:
        try:
            next(work)
        except StopIteration as done:
            return done.value


def reconcile_in_slices(world: int, schemas: dict, step: int, reports: dict[int, wire.Report], complete: bool,
                        layouts: Optional[LayoutCache] = None, group_depth: int = 0):
    """:func:`reconcile` as a generator: it yields (None) between its phases (stacking, merging,
    aggregating, and with ``group_depth`` merging for export; ~0.1-0.25 s each at 16,384 ranks)
    and returns the :class:`RoundResult`, so that
    the writer can handle frames in between. Its first slice only takes the layout (from
    ``schemas``, which may change after it); ``reports`` must not change until it is done."""
    ranks = tuple(sorted(reports))
    reps = [reports[r] for r in ranks]
    digests = [x.schema for x in reps]
    order = tuple(dict.fromkeys(digests))
    lay = layouts.get(order, schemas) if layouts is not None else Layout.of(schemas[h] for h in order)
    yield  # the layout holds the schemas it needs: ``schemas`` may change from here on
    R, L, P = len(ranks), len(lay.layers), len(lay.params)
    # which schema each rank's report is under (index into lay.schemas)
    if len(lay.schemas) == 1:
        which = np.zeros(R, np.int64)
    else:
        which = np.fromiter((lay.index[h] for h in digests), np.int64, R)
    full = all(x.act_count is not None and x.fp_grad is not None for x in reps)
    if lay.dense and full:
        # the usual job: one schema, every array present: the ranks' rows stack as they are
        act = _stack(reps, "act", np.float64, (R, L, len(wire.ACT_FIELDS)))
        act_grad = _stack(reps, "act_grad", np.float64, (R, L, len(wire.ACT_GRAD_FIELDS)))
        act_count = _stack(reps, "act_count", np.float64, (R, L, len(columns.fields("act_count"))))
        yield
        param = _stack(reps, "param", np.float64, (R, P, len(wire.PARAM_FIELDS)))
        present = None  # every rank has every parameter
        fp_grad = _stack(reps, "fp_grad", np.uint64, (R, P))
        fp_weight = _stack(reps, "fp_weight", np.uint64, (R, P))
        fp_grad_seen = reductions.observed_rows("param", param)  # had a gradient
        fp_weight_seen = np.ones((R, P), bool)
    else:
        act, act_grad, act_count, param, present, fp_grad, fp_weight, fp_grad_seen, fp_weight_seen = _scatter(
            lay, reps, which)
    yield
    own_param = param
    if lay.sharded:
        # sharded parameters: each shard group's rows become the parameter's global figures
        param = combine(lay.shard_groups(which), param)
    grad_norm = np.array([x.grad_norm for x in reps], np.float64)
    sq = [k for k, x in enumerate(reps) if x.grad_sq is not None]
    if sq:
        norms = global_norms({k: (lay.schemas[which[k]].mesh, reps[k].grad_sq) for k in sq
                              if lay.schemas[which[k]].mesh is not None})
        grad_norm[sq] = gradless(np.array([norms.get(k, math.nan) for k in sq], np.float64), grad_norm[sq],
                                 np.array([reps[k].grad_nonfinite for k in sq]))
    # parameters merge into their module as layers merge into a group (reductions.merge: each module's sum in one order)
    module = reductions.merge("param", param, present, lay.module_plan)
    yield
    arrays = {"act": act, "act_grad": act_grad, "param": module, "act_count": act_count}
    # exported merged (group_depth): the per-layer aggregates only as the checks read them
    agg = reductions.aggregate_all(arrays) if group_depth <= 0 else reductions.LazyAggregates(arrays)
    yield
    totals = _rank_totals(arrays)
    rr = RoundResult(
        step, complete, ranks, lay.layers, lay.modules, act, act_grad, module, agg, totals,
        layer_types=lay.layer_types,
        params=lay.params, fp_grad=fp_grad, fp_weight=fp_weight,
        fp_grad_seen=fp_grad_seen, fp_weight_seen=fp_weight_seen,
        grad_norm=grad_norm, holders=_per_rank(lay.holders, which, R), part=lay.parts[which], own_param=own_param,
        local_grad_norm=np.array([x.local_grad_norm for x in reps], np.float64),
        compute_time=np.array([x.compute_time for x in reps], np.float64),
        batch=np.array([x.batch for x in reps], np.int64),
        micro=np.array([x.micro for x in reps], np.int64),
        burst=any(x.burst for x in reps), act_count=act_count,
    )
    if group_depth > 0:
        yield
        rr = replace(rr, grouped=group_layers(rr, group_depth))
    return rr


#: reports :func:`_stack` concatenates at once: one concatenation holds the interpreter lock for
#: its whole length (~0.2 s for 16,384 reports, which scrapes waited for), a chunk ~1/16 of that
STACK_CHUNK = 1024


def _stack(reps: list, attr: str, dtype, shape: tuple) -> np.ndarray:
    """Every report's array ``attr`` (``shape[1:]`` each) stacked into ``dtype`` ``shape`` (the
    round's ranks first), :data:`STACK_CHUNK` reports per concatenation; ``np.array`` of a list
    of arrays is ~6x slower (16,384 ranks: 83 against 13 ms)."""
    out = np.empty(shape, dtype)
    flat = out.reshape(-1, *shape[2:])  # a view: each report's rows one after the other
    rows = shape[1] if len(shape) > 1 else 1
    for a in range(0, len(reps), STACK_CHUNK):
        chunk = [getattr(x, attr) for x in reps[a:a + STACK_CHUNK]]
        np.concatenate(chunk, out=flat[a * rows:(a + len(chunk)) * rows])
    return out


def _per_rank(rows: np.ndarray, which: np.ndarray, R: int) -> np.ndarray:
    """``rows[which]``: each rank's row of its schema; one schema's row read-only for every rank
    (a 16,384-rank round would copy it 16,384 times)."""
    if len(rows) == 1:
        return np.broadcast_to(rows[0], (R, *rows.shape[1:]))
    return rows[which]


def _scatter(lay: Layout, reps: list, which: np.ndarray) -> tuple:
    """The round's per-rank arrays when ranks differ in columns (or some array is missing): the
    ranks of each set of columns (:attr:`Layout.kinds`) at once, their rows put in their columns;
    NaN (or 0, False) elsewhere."""
    R, L, P = len(reps), len(lay.layers), len(lay.params)
    act = np.full((R, L, len(wire.ACT_FIELDS)), np.nan)
    act_grad = np.full((R, L, len(wire.ACT_GRAD_FIELDS)), np.nan)
    act_count = np.full((R, L, len(columns.fields("act_count"))), np.nan)
    param = np.full((R, P, len(wire.PARAM_FIELDS)), np.nan)
    present = np.zeros((R, P), bool)
    fp_grad = np.zeros((R, P), np.uint64)
    fp_weight = np.zeros((R, P), np.uint64)
    fp_grad_seen = np.zeros((R, P), bool)
    fp_weight_seen = np.zeros((R, P), bool)
    kind = lay.kinds[which]
    for c in np.unique(kind).tolist():  # one pass per set of columns, however many schemas share it
        ks = np.flatnonzero(kind == c).tolist()
        i = which[ks[0]]
        cols, pcols = lay.slot_cols[i], lay.param_cols[i]
        reps_g = [reps[k] for k in ks]
        kk = np.array(ks, dtype=np.int64)[:, None]
        act[kk, cols] = np.stack([x.act for x in reps_g])
        act_grad[kk, cols] = np.stack([x.act_grad for x in reps_g])
        counted = [k for k, x in zip(ks, reps_g) if x.act_count is not None]
        if counted:
            act_count[np.array(counted, dtype=np.int64)[:, None], cols] = np.stack(
                [x.act_count for x in reps_g if x.act_count is not None])
        rows = np.stack([x.param for x in reps_g])
        param[kk, pcols] = rows
        present[kk, pcols] = True
        fp = [(k, x, row) for k, x, row in zip(ks, reps_g, rows) if x.fp_grad is not None]
        if fp:
            fk = np.array([k for k, _, _ in fp], dtype=np.int64)[:, None]
            has = reductions.observed_rows("param", np.stack([row for _, _, row in fp]))  # had a gradient
            fp_grad[fk, pcols] = np.stack([x.fp_grad for _, x, _ in fp])
            fp_weight[fk, pcols] = np.stack([x.fp_weight for _, x, _ in fp])
            at, col = np.nonzero(has)
            fp_grad_seen[fk[at, 0], pcols[col]] = True
            fp_weight_seen[fk, pcols] = True
    return act, act_grad, act_count, param, present, fp_grad, fp_weight, fp_grad_seen, fp_weight_seen


def layer_group(name: str, depth: int) -> str:
    """The first ``depth`` dot-separated components of a layer's module path (``depth`` 0: all)."""
    return ".".join(name.split(".")[:depth]) if depth > 0 else name


@functools.lru_cache(maxsize=64)
def _groups(names: tuple[str, ...], depth: int) -> tuple[tuple[str, ...], reductions.MergePlan]:
    """The groups of ``names`` at ``depth`` and their merge plan; cached: a job's layers (the
    same tuple every round, :class:`Layout`) are grouped once per scrape of a new round."""
    members: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        members.setdefault(layer_group(n, depth), []).append(i)
    return tuple(members), reductions.merge_plan([np.array(v, dtype=np.int64) for v in members.values()])


@functools.lru_cache(maxsize=64)
def _group_types(types: tuple[str, ...], plan: reductions.MergePlan) -> tuple[str, ...]:
    """Each group's layer type: its members' when they all agree, else ''."""
    return tuple(types[idx[0]] if types and len({types[i] for i in idx}) == 1 else "" for idx in plan.groups)


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
    layers, lplan = _groups(rr.layers, depth)
    modules, mplan = _groups(rr.modules, depth)
    act, act_grad, module, act_count = (
        reductions.merge(name, values, None, plan)
        for name, values, plan in (("act", rr.act, lplan), ("act_grad", rr.act_grad, lplan), ("param", rr.module, mplan),
                                   ("act_count", rr.act_count, lplan))
    )
    agg = reductions.aggregate_all({"act": act, "act_grad": act_grad, "param": module, "act_count": act_count})
    return replace(rr, layers=layers, modules=modules, act=act, act_grad=act_grad, module=module, agg=agg,
                   layer_types=_group_types(rr.layer_types, lplan), act_count=act_count, grouped=None,
                   group_depth=depth)
