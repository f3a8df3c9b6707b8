"""Probed steps: the round layout cache and the fast paths of reconciliation and of the checks
keep their behaviour bit for bit. Each is compared with the general computation (or a
straightforward one of the same result) on random inputs chosen to reach its corners:
NaN, Inf, zeros of both signs, ties, several schemas in a round, ranks joining and leaving."""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import itertools
import math
import statistics as pystats
import types
import warnings

import msgspec
import numpy as np
import pytest

from gradwatch import columns, wire
from gradwatch.aggregator import reductions
from gradwatch.aggregator.checks import Outcome, Thresholds
from gradwatch.aggregator.checks._fingerprints import minority
from gradwatch.aggregator.checks.explosion import _LayerNorms, _medians, _rolling_medians
from gradwatch.aggregator.checks.outlier_rank import OutlierRank
from gradwatch.aggregator.reconcile import Layout, LayoutCache, _scatter, group_layers, reconcile

MODULES = [f"blocks.{i // 3}.l{i % 3}" for i in range(9)]


def _schema(rank: int, world: int, mods, bias: bool = True) -> wire.Schema:
    slots = tuple((m, "", "ReLU" if m.endswith("l2") else "Linear", "float32") for m in mods)
    params = tuple((f"{m}.{leaf}", (4,), "float32") for m in mods for leaf in (("weight", "bias") if bias else ("weight",)))
    return wire.Schema(wire.Header("j", rank, world, "b", 0, 0.0), "h", 0, 1, params, slots)


def _values(rng, shape, dtype=np.float32) -> np.ndarray:
    """Random values with NaN, Inf and zeros of both signs in them."""
    a = rng.standard_normal(shape)
    u = rng.random(shape)
    a[u < 0.08] = np.nan
    a[(u >= 0.08) & (u < 0.2)] = 0.0
    a[(u >= 0.2) & (u < 0.28)] = -0.0
    a[(u >= 0.28) & (u < 0.3)] = np.inf
    if rng.random() < 0.3:
        a = np.round(a)  # ties
    return a.astype(dtype)


def _report(rng, rank: int, s: wire.Schema, step: int = 10, full: bool = True) -> wire.Report:
    n_s, n_p = len(s.slots), len(s.params)
    fp = rng.integers(0, 3, n_p).astype(np.uint64)
    extra = dict(act_count=_values(rng, (n_s, 2)), fp_grad=fp, fp_weight=fp + np.uint64(rng.integers(0, 2)))
    if not full:
        extra[str(rng.choice(["act_count", "fp_grad"]))] = None
        if extra["fp_grad"] is None:
            extra["fp_weight"] = None
    return wire.Report(wire.Header("j", rank, s.header.world, "b", 1, 0.0), s.hash, step, 0.1, float(rng.random()), 0,
                       probe=True, act=_values(rng, (n_s, 6)), act_grad=_values(rng, (n_s, 2)),
                       param=_values(rng, (n_p, 3)), local_grad_norm=float(rng.random()), batch=8, **extra)


def _same(a, b, path="") -> None:
    """Equal bit for bit: arrays (shape, dtype, bytes), dicts and tuples of them, plain values."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.shape, a.dtype) == (b.shape, b.dtype) and a.tobytes() == b.tobytes(), path
    elif isinstance(a, collections.abc.Mapping):  # a dict, or a round's LazyAggregates
        assert list(a) == list(b), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, tuple) and a and isinstance(a[0], np.ndarray):
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _same_round(a, b) -> None:
    for f in dataclasses.fields(a):
        _same(getattr(a, f.name), getattr(b, f.name), f.name)


# --- the layout cache ------------------------------------------------------------------------------


def test_a_jobs_rounds_share_one_layout_and_equal_rounds_worked_out_afresh():
    rng = np.random.default_rng(0)
    s = _schema(0, 4, MODULES)
    schemas, cache = {s.hash: s}, LayoutCache()
    for step in range(3):
        reports = {r: _report(rng, r, s, step) for r in range(4)}
        _same_round(reconcile(4, schemas, step, reports, True, cache), reconcile(4, schemas, step, reports, True))
    assert (cache.hits, cache.misses) == (2, 1)
    # a rank leaving the round and joining again: the same schemas, the same layout
    for ranks in ([0, 2, 3], [1], [0, 1, 2, 3]):
        reports = {r: _report(rng, r, s) for r in ranks}
        _same_round(reconcile(4, schemas, 5, reports, False, cache), reconcile(4, schemas, 5, reports, False))
    assert (cache.hits, cache.misses) == (5, 1)


def test_a_rank_changing_its_schema_gets_a_new_layout_and_back_the_old_one():
    rng = np.random.default_rng(1)
    a, b = _schema(0, 3, MODULES), _schema(1, 3, MODULES[:4] + MODULES[5:], bias=False)
    schemas, cache = {a.hash: a, b.hash: b}, LayoutCache()
    for per_rank in ([a, a, a], [a, b, a], [b, a, a], [a, a, a]):
        reports = {r: _report(rng, r, s) for r, s in enumerate(per_rank)}
        got = reconcile(3, schemas, 7, reports, True, cache)
        _same_round(got, reconcile(3, schemas, 7, reports, True))
        assert got.params == tuple(dict.fromkeys(p[0] for s in dict.fromkeys(per_rank) for p in s.params))
    # [a, b] and [b, a] are two layouts (first use order decides the names' order); [a] came back
    assert (cache.hits, cache.misses) == (1, 3)


def test_a_layout_is_not_reused_for_other_schema_objects_under_the_same_hashes():
    """A job that relearned a schema, or a State whose label cut (max_label_len) differs: the hash
    is the same, the names need not be."""
    rng = np.random.default_rng(2)
    s = _schema(0, 2, MODULES)
    short = msgspec.structs.replace(s, slots=tuple((m[:8], o, t, d) for m, o, t, d in s.slots), hash=s.hash)
    cache = LayoutCache()
    reports = {r: _report(rng, r, s) for r in range(2)}
    assert reconcile(2, {s.hash: s}, 1, reports, True, cache).layers == tuple(MODULES)
    assert reconcile(2, {s.hash: short}, 1, reports, True, cache).layers == tuple(dict.fromkeys(m[:8] for m in MODULES))
    assert cache.misses == 2


def test_the_cache_keeps_its_size_least_recently_used_out():
    schemas = {s.hash: s for s in (_schema(0, 1, MODULES[:k]) for k in range(1, 6))}
    cache = LayoutCache(size=3)
    order = list(schemas)
    for h in order + [order[-1]]:
        cache.get((h,), schemas)
    assert list(cache._layouts) == [(h,) for h in order[2:]] and cache.hits == 1


def test_the_cache_holds_few_schemas_over_its_layouts_the_newest_whatever_its_size():
    """A sharded job's layouts hold a placed schema per rank: the cache bounds the schemas over
    them, not only the layouts."""
    schemas = {s.hash: s for s in (_schema(0, 1, MODULES[:k]) for k in range(1, 6))}
    h = list(schemas)
    cache = LayoutCache(size=8, max_schemas=4)
    cache.get((h[0], h[1]), schemas)
    cache.get((h[2], h[3]), schemas)
    assert list(cache._layouts) == [(h[0], h[1]), (h[2], h[3])]  # 4 schemas: both kept
    cache.get((h[4],), schemas)
    assert list(cache._layouts) == [(h[2], h[3]), (h[4],)]
    cache.get(tuple(h), schemas)  # over the bound alone: kept, the others go
    assert list(cache._layouts) == [tuple(h)]


def _partition(a: np.ndarray) -> list:
    """Which rows share a number, per column: what holders and parts mean (their numbers do not)."""
    a = a.reshape(len(a), -1)
    return [sorted(tuple(np.flatnonzero(a[:, j] == v).tolist()) for v in np.unique(a[:, j])) for j in range(a.shape[1])]


def test_a_sharded_round_missing_ranks_reuses_the_layout_of_all_their_places():
    """A job's ranks placed on a (dp, tp) mesh: a round without some of them takes the layout of
    the full round (no new one per set of ranks) and reconciles exactly as a layout of its own
    would: the same arrays bit for bit, the same holders and parts up to their numbering."""
    rng = np.random.default_rng(5)
    base = msgspec.structs.replace(_schema(0, 8, MODULES), mesh=wire.Mesh(("dp", "tp"), (4, 2)))
    base = msgspec.structs.replace(base, shard=tuple((1,) if i % 2 else () for i in range(len(base.params))))
    placed = {r: msgspec.structs.replace(base, mesh=wire.Mesh(("dp", "tp"), (4, 2), (r // 2, r % 2)),
                                         hash=f"{base.hash}@{r // 2},{r % 2}") for r in range(8)}
    schemas = {s.hash: s for s in placed.values()}
    cache = LayoutCache()

    def reports(ranks):
        return {r: msgspec.structs.replace(_report(rng, r, base), schema=placed[r].hash) for r in ranks}

    reconcile(8, schemas, 10, reports(range(8)), True, cache)
    for ranks in ([0, 1, 2, 3, 6, 7], [1, 2, 5], [3, 4, 5, 6, 7]):
        reps = reports(ranks)
        got = reconcile(8, schemas, 11, reps, False, cache)
        want = reconcile(8, schemas, 11, reps, False)
        for f in dataclasses.fields(got):
            if f.name in ("holders", "part"):
                assert _partition(getattr(got, f.name)) == _partition(getattr(want, f.name)), f.name
            else:
                _same(getattr(got, f.name), getattr(want, f.name), f.name)
    assert (cache.misses, cache.hits, len(cache._layouts)) == (1, 3, 1)


def test_one_schema_rounds_stack_as_the_general_path_scatters():
    rng = np.random.default_rng(3)
    for trial in range(200):
        world = int(rng.integers(1, 7))
        mods = list(rng.choice(MODULES, size=int(rng.integers(0, 6)), replace=False))
        s = _schema(0, world, mods, bias=bool(rng.random() < 0.5))
        lay = Layout.of([s])
        assert lay.dense
        reps = [_report(rng, r, s) for r in range(world)]
        rr = reconcile(world, {s.hash: s}, 1, dict(enumerate(reps)), True, LayoutCache())
        act, act_grad, act_count, param, present, fp_grad, fp_weight, fp_grad_seen, fp_weight_seen = _scatter(
            lay, reps, np.zeros(world, np.int64))
        for got, want in ((rr.act, act), (rr.act_grad, act_grad), (rr.act_count, act_count), (rr.own_param, param),
                          (rr.fp_grad, fp_grad), (rr.fp_weight, fp_weight), (rr.fp_grad_seen, fp_grad_seen),
                          (rr.fp_weight_seen, fp_weight_seen)):
            _same(got, want)
        assert present.all()


def test_stacking_in_chunks_equals_one_concatenation(monkeypatch):
    """A large round's arrays are stacked STACK_CHUNK reports at a time (the interpreter lock is
    free between chunks): any chunk size gives the arrays one concatenation gives."""
    from gradwatch.aggregator import reconcile as rec

    rng = np.random.default_rng(8)
    for world in (1, 5, 7):
        s = _schema(0, world, MODULES[:int(rng.integers(0, 6))])
        reps = [_report(rng, r, s) for r in range(world)]
        L, P = len(s.slots), len(s.params)
        cases = (("act", np.float64, (world, L, 6)), ("param", np.float64, (world, P, 3)), ("fp_grad", np.uint64, (world, P)))
        for chunk in (1, 2, 3, 1024):
            monkeypatch.setattr(rec, "STACK_CHUNK", chunk)
            for attr, dtype, shape in cases:
                want = np.concatenate([getattr(x, attr) for x in reps], dtype=dtype).reshape(shape)
                _same(rec._stack(reps, attr, dtype, shape), want)


def test_rounds_of_several_schemas_and_missing_arrays_equal_a_fresh_reconciliation_grouped_too():
    rng = np.random.default_rng(4)
    cache = LayoutCache()
    for trial in range(150):
        world = int(rng.integers(1, 6))
        pool = [_schema(0, world, list(rng.choice(MODULES, size=int(rng.integers(1, 6)), replace=bool(rng.random() < 0.2))),
                        bias=bool(rng.random() < 0.5)) for _ in range(int(rng.integers(1, 3)))]
        per_rank = [pool[int(rng.integers(0, len(pool)))] for _ in range(world)]
        ranks = sorted(rng.choice(world, size=int(rng.integers(1, world + 1)), replace=False).tolist())
        reports = {r: _report(rng, r, per_rank[r], full=bool(rng.random() < 0.8)) for r in ranks}
        schemas = {s.hash: s for s in per_rank}
        got, want = reconcile(world, schemas, 3, reports, True, cache), reconcile(world, schemas, 3, reports, True)
        _same_round(got, want)
        for depth in (1, 2):
            _same_round(group_layers(got, depth), group_layers(want, depth))
            # merged with the round for export (the writer's slice), as the exporter would merge it
            with_groups = reconcile(world, schemas, 3, reports, True, cache, group_depth=depth)
            assert with_groups.grouped.group_depth == depth and with_groups.grouped.grouped is None
            _same_round(with_groups.grouped, group_layers(want, depth))
            _same_round(dataclasses.replace(with_groups, grouped=None), want)


# --- statistics ------------------------------------------------------------------------------------


def test_aggregate_all_equals_each_statistic_aggregated_alone_bit_for_bit():
    """Reduced per array and observing column at once; a min or max zero over zeros of both signs
    falls back to the statistic alone (numpy's SIMD picks either zero by position)."""
    rng = np.random.default_rng(5)
    for trial in range(1500):
        R, n = int(rng.integers(1, 12)), int(rng.integers(0, 30))
        arrays = {k: _values(rng, (R, n, len(columns.fields(k))), np.float64) for k in columns.ARRAYS}
        got = reductions.aggregate_all(arrays)
        want = {s.name: reductions.aggregate(arrays[s.array][..., s.column], reductions.observed(s, arrays[s.array]), s.aggs)
                for s in columns.STATISTICS}
        _same(got, want)


def test_lazy_aggregates_equal_aggregate_all_read_in_any_order_from_threads():
    """A grouped round's per-layer aggregates, worked out as read: aggregate_all's, bit for bit,
    each once whatever the threads reading them; an unknown name is a KeyError."""
    import threading

    rng = np.random.default_rng(13)
    names = [s.name for s in columns.STATISTICS]
    for trial in range(40):
        R, n = int(rng.integers(1, 12)), int(rng.integers(0, 30))
        arrays = {k: _values(rng, (R, n, len(columns.fields(k))), np.float64) for k in columns.ARRAYS}
        want = reductions.aggregate_all(arrays)
        lazy = reductions.LazyAggregates(arrays)
        assert len(lazy) == len(want) and list(lazy) == names
        got = {}
        order = [list(rng.permutation(names)) for _ in range(3)]
        threads = [threading.Thread(target=lambda o=o: [got.setdefault((id(o), k), lazy[k]) for k in o]) for o in order]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for k in names:
            _same(lazy[k], want[k], k)
            assert all(got[id(o), k] is lazy[k] for o in order)  # worked out once
    with pytest.raises(KeyError):
        reductions.LazyAggregates({})["no_such_statistic"]


def _reduceat_sum(xs: list) -> float:
    """np.add.reduceat's sum of one segment of float64 values, written out (np.sum differs: it adds
    the first value in order): the first value plus numpy's pairwise sum of the rest
    (numpy/_core/src/umath/loops_utils.h.src: sequential from -0.0 under 8 values, 8 accumulators
    up to 128, halves beyond)."""
    def pairwise(a):
        n = len(a)
        if n < 8:
            r = -0.0
            for v in a:
                r += v
            return r
        if n <= 128:
            acc = list(a[:8])
            i = 8
            while i < n - n % 8:
                for j in range(8):
                    acc[j] += a[i + j]
                i += 8
            r = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
            for k in range(i, n):
                r += a[k]
            return r
        half = n // 2
        half -= half % 8
        return pairwise(a[:half]) + pairwise(a[half:])

    return xs[0] + pairwise(xs[1:]) if xs else 0.0


def _extreme(xs: list, least: bool) -> float:
    """min or max of floats, NaN if any, a tie of zeros settled by sign (-0.0 < 0.0)."""
    if any(math.isnan(x) for x in xs):
        return math.nan
    key = lambda x: (x, math.copysign(1.0, x))  # noqa: E731
    return (min if least else max)(xs, key=key)


class _RefReducer:
    """The merge's reductions, one group and one rank at a time in Python."""

    def __init__(self, groups):
        self.bounds = list(itertools.accumulate([0] + [len(g) for g in groups]))

    def _each(self, x, fn):
        x = np.asarray(x, np.float64)
        return np.array([[fn(x[r, a:b].tolist()) for a, b in zip(self.bounds, self.bounds[1:])] for r in range(x.shape[0])])

    def total(self, x):
        return self._each(x, lambda xs: _reduceat_sum(xs) + 0.0)

    def least(self, x):
        return self._each(x, lambda xs: _extreme(xs, True) if xs else math.inf)

    def most(self, x):
        return self._each(x, lambda xs: _extreme(xs, False) if xs else -math.inf)


def _merge_reference(array, values, present, groups):
    """reductions.merge by its definition: each group's members gathered in order, reduced one
    group and rank at a time (:class:`_RefReducer`), the rules applied as the table says."""
    rows = columns.of(array)
    R = values.shape[0]
    order = np.concatenate(groups) if groups else np.zeros(0, np.int64)
    vals = values[:, order]
    masks = {s.observed_by: (reductions.observed(s, values) & present)[:, order] for s in rows}
    red = _RefReducer(groups)
    counts = {k: red.total(m.astype(np.float64)).astype(np.int64) for k, m in masks.items()}
    members = {s.field: vals[..., s.column] for s in rows}
    out = np.full((R, len(groups), len(rows)), np.nan)
    done = {}
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for s in rows:
            o, cnt = masks[s.observed_by], counts[s.observed_by]
            x = reductions.MERGE_FUNCS[s.merge](members[s.field], o, cnt, members, done, red)
            if s.observed_by is not None:
                x = np.where(cnt == 0, np.nan, x)
            done[s.field] = x
            out[..., s.column] = x
    return out


def test_merge_equals_its_definition_bit_for_bit():
    """Groups in order or shuffled, with and without members, ranks missing members, NaN, inf and
    zeros of both signs: each group reduced by its definition (_RefReducer), by the plan or by the
    groups; and the sums are not np.sum's (which adds the first member in order)."""
    rng = np.random.default_rng(6)
    for trial in range(500):
        R, n = int(rng.integers(1, 5)), int(rng.integers(1, 40))
        perm = np.arange(n) if rng.random() < 0.5 else rng.permutation(n)
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, int(rng.integers(0, 5))), replace=False)) if n > 1 else []
        groups = [np.asarray(g, np.int64) for g in np.split(perm, cuts)]
        if rng.random() < 0.2:
            groups = groups[:-1]  # members in no group
        if rng.random() < 0.1:
            groups.insert(int(rng.integers(0, len(groups) + 1)), np.zeros(0, np.int64))  # a group without members
        for array in columns.ARRAYS:
            values = _values(rng, (R, n, len(columns.fields(array))), np.float64)
            if rng.random() < 0.3:
                values[np.isnan(values)] = 1.0  # observed everywhere: the healthy round's shortcut
            present = rng.random((R, n)) < 0.9 if rng.random() < 0.5 else np.ones((R, n), bool)
            want = _merge_reference(array, values, present, groups)
            _same(reductions.merge(array, values, present, groups), want)
            _same(reductions.merge(array, values, present, reductions.merge_plan(groups)), want)
            if present.all():
                _same(reductions.merge(array, values, None, groups), want)
    assert _reduceat_sum([1.0, 1e16, -1e16]) == 1.0 != np.sum([1.0, 1e16, -1e16])
    plan = reductions.merge_plan([np.arange(3)])
    assert reductions._Reducer(plan).total(np.array([[1.0, 1e16, -1e16]]))[0, 0] == 1.0


@pytest.mark.parametrize("n", [1, 2, 3, 8, 33])
def test_finite_median_and_nanmedian_equal_numpys_bit_for_bit(n):
    rng = np.random.default_rng(n)
    for trial in range(2000):
        v = rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 300)
        u = rng.random(n)
        v[u < 0.2] = 0.0
        v[(u >= 0.2) & (u < 0.4)] = -0.0
        if rng.random() < 0.1:
            v[u > 0.9] = np.inf
        with np.errstate(over="ignore", invalid="ignore"):
            want = np.median(v)
            assert np.array(reductions.finite_median(v)).tobytes() == want.tobytes(), v
            for axis, a in ((0, v[:, None]), (1, v[None, :])):
                got = reductions.nanmedian(a, axis)
                assert got.tobytes() == _nanmedian_reference(a, axis).tobytes() == want.reshape(1).tobytes()
                assert np.array_equal(got, np.nanmedian(a, axis=axis), equal_nan=True)


def test_nanmedian_equals_np_median_of_each_column_bit_for_bit_whatever_its_count_of_nans(monkeypatch):
    """Columns partitioned per count of values (NaN-free, a few counts, and past _MEDIAN_COUNTS
    the sort): each is np.median of its values, zeros of both signs, ties and infinities included."""
    rng = np.random.default_rng(10)
    for limit in (reductions._MEDIAN_COUNTS, 0):
        monkeypatch.setattr(reductions, "_MEDIAN_COUNTS", limit)
        for trial in range(600):
            shape = tuple(int(x) for x in rng.integers(1, 14, size=int(rng.integers(1, 4))))
            a = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 300)
            u = rng.random(shape)
            a[u < 0.15] = 0.0
            a[(u >= 0.15) & (u < 0.3)] = -0.0
            a[(u >= 0.3) & (u < 0.35)] = np.inf
            if rng.random() < 0.7:
                a[rng.random(shape) < rng.uniform(0, 0.6)] = np.nan
            if rng.random() < 0.3:
                a = np.round(a)
            for axis in range(a.ndim):
                with np.errstate(over="ignore", invalid="ignore"):
                    got, want = reductions.nanmedian(a, axis), _nanmedian_reference(a, axis)
                assert got.shape == want.shape and got.tobytes() == want.tobytes(), (a, axis)


def _nanmedian_reference(a, axis):
    """np.median of each column's values without NaN, one column at a time (NaN where it has none)."""
    cols = np.moveaxis(a, axis, -1)
    out = [np.median(c[~np.isnan(c)]) if (~np.isnan(c)).any() else np.nan for c in cols.reshape(-1, cols.shape[-1])]
    return np.array(out, np.float64).reshape(cols.shape[:-1])


# --- the checks ------------------------------------------------------------------------------------


def test_fingerprints_all_seen_find_what_a_vote_on_every_parameter_finds():
    """The first rank's fingerprints as the reference when every rank has every one: the same
    minorities and ties as a majority vote on each parameter."""
    rng = np.random.default_rng(7)
    for trial in range(2000):
        R, P = int(rng.integers(1, 7)), int(rng.integers(1, 6))
        fp = rng.integers(0, int(rng.integers(1, 4)), (R, P)).astype(np.uint64)
        want_bad, want_tied = collections.defaultdict(list), []
        for p in range(P):
            (top, n), *rest = collections.Counter(fp[:, p].tolist()).most_common()
            if rest and rest[0][1] == n:
                want_tied.append(p)
                continue
            for k in np.flatnonzero(fp[:, p] != top).tolist():
                want_bad[k].append(p)
        assert minority(fp, np.ones((R, P), bool)) == (dict(want_bad), want_tied)


def test_layer_norm_history_medians_equal_statistics_median_of_each_modules_deque():
    rng = np.random.default_rng(8)
    window, need = 5, 3
    hist, deques = _LayerNorms(window), collections.defaultdict(lambda: collections.deque(maxlen=window))
    pool = [f"m{i}" for i in range(8)]
    modules = tuple(pool[:5])
    for step in range(300):
        if rng.random() < 0.1:  # the modules change (a schema change)
            modules = tuple(rng.choice(pool, size=int(rng.integers(1, 8)), replace=False))
        rows = hist.at(modules)
        judged = np.flatnonzero(rng.random(len(modules)) < 0.8)
        v = np.round(rng.random(len(judged)) * 4) / 4
        got = hist.medians(rows[judged], need)
        want = [pystats.median(deques[modules[i]]) if len(deques[modules[i]]) >= need else np.nan for i in judged]
        assert np.array_equal(got, np.array(want, np.float64), equal_nan=True)
        hist.append(rows[judged], v)
        for i, x in zip(judged, v):
            deques[modules[i]].append(float(x))


def test_explosion_judges_a_lone_step_as_it_judges_it_among_others():
    rng = np.random.default_rng(9)
    for trial in range(3000):
        row = rng.random(int(rng.integers(1, 9))) * 10.0 ** rng.uniform(-3, 300)
        if rng.random() < 0.3:
            row[rng.random(len(row)) < 0.5] = float(rng.choice([0.0, -0.0, np.inf, np.nan]))
        other = rng.random(len(row))
        with np.errstate(over="ignore", invalid="ignore"):
            assert _medians([row]).tobytes() == _medians([row, other])[:1].tobytes()
            hist = np.round(rng.random(int(rng.integers(0, 25))) * 8) / 8
            window, need = int(rng.integers(3, 21)), int(rng.integers(1, 6))
            x = rng.random(2)
            assert (_rolling_medians(hist, x[:1], window, need).tobytes()
                    == _rolling_medians(hist, x, window, need)[:1].tobytes())


class _OutliersByTheBook:
    """outlier_rank as its documentation states it, rank by rank in float64 with numpy's medians:
    per group of at least three peers (``part``), each rank's modified z-score ``0.6745 * (x -
    median) / MAD`` of its local gradient norm, activation scale (the median over layers of its
    activation std over the peers' median of that layer) and non-finite count (MAD floored at
    ``outlier_min_mad * |median|``, at one element for the count, and at 1e-12); its score the
    largest, the first statistic reaching it naming it; named after ``outlier_probes``
    consecutive probed steps beyond ``outlier_z``. :meth:`round` returns None (no evaluation), or
    ``(outcome, [(rank, step, details)])``."""

    def __init__(self, t: Thresholds):
        self.t = t
        self.last_step = None
        self.streak: dict[int, int] = {}
        self.z: dict[int, float] = {}
        self.why: dict[int, dict] = {}

    @staticmethod
    def _z(values: list[float], floor: float, min_mad: float) -> list[float]:
        ok = [v for v in values if math.isfinite(v)]
        if len(ok) < 3:
            return [math.nan] * len(values)
        med = float(np.median(ok))
        mad = float(np.median([abs(v - med) for v in ok]))
        scale = max(mad, min_mad * abs(med), floor, 1e-12)
        return [0.6745 * (v - med) / scale if math.isfinite(v) else math.nan for v in values]

    def _features(self, r, rows: list[int]) -> list[tuple[str, list[float], float]]:
        """``(statistic, value per row, the MAD's absolute floor)`` in the documented order."""
        out = []
        if r.local_grad_norm is not None:
            out.append(("local_grad_norm", [float(r.local_grad_norm[k]) for k in rows], 0.0))
        std = np.asarray(r.act, np.float64)[rows][:, :, columns.at("act").std]
        std = np.where(np.isfinite(std), std, np.nan)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # layers and ranks without a finite std
            layer = [float(np.nanmedian(std[:, i])) for i in range(std.shape[1])]
            usable = [i for i, m in enumerate(layer) if math.isfinite(m) and m > 0]
            if usable:
                out.append(("activation_std", [float(np.nanmedian([std[k, i] / layer[i] for i in usable]))
                                               for k in range(len(rows))], 0.0))
        out.append(("nonfinite", [float(np.nansum(np.asarray(r.rank_totals, np.float64)[k])) for k in rows], 1.0))
        return out

    def round(self, job, r):
        parts = [0] * len(r.ranks) if r.part is None else [int(p) for p in r.part]
        groups = [[k for k in range(len(r.ranks)) if parts[k] == p] for p in dict.fromkeys(parts)]
        groups = [g for g in groups if len(g) >= 3]
        if not groups:
            named = [k for k, n in self.streak.items() if n >= self.t.outlier_probes]
            if self.last_step is not None and all(k in job.ranks and not job.ranks[k].closing for k in named):
                return None
            self.streak = {}
            return Outcome.NO_DATA, []
        if self.last_step is not None and r.step <= self.last_step:
            return None
        self.last_step = r.step
        score, worst, peers = {}, {}, {}  # by row
        for g in groups:
            scored = False
            best = {k: 0.0 for k in g}
            for stat, values, floor in self._features(r, g):
                zs = self._z(values, floor, self.t.outlier_min_mad)
                if not any(math.isfinite(z) for z in zs):
                    continue
                scored = True
                med = float(np.median([v for v in values if math.isfinite(v)]))
                for k, v, z in zip(g, values, zs):
                    if math.isfinite(z) and abs(z) > best[k]:
                        best[k] = abs(z)
                        worst[k] = {"statistic": stat, "value": v, "median": med, "z": z}
            if scored:
                for k in g:
                    score[k], peers[k] = best[k], [r.ranks[q] for q in g]
        if not score:
            return Outcome.NO_DATA, []
        for k, rank in enumerate(r.ranks):
            if k not in score:  # in no group scored: forgotten
                self.streak.pop(rank, None)
                self.z.pop(rank, None)
                continue
            self.z[rank] = score[k]
            if score[k] > self.t.outlier_z:
                self.streak[rank] = self.streak.get(rank, 0) + 1
                if self.streak[rank] >= self.t.outlier_probes:
                    self.why[rank] = dict(worst.get(k, {}), step=r.step, probes=self.streak[rank], peers=peers[k])
            else:  # back among its peers: its streak ends
                self.streak.pop(rank, None)
                self.why.pop(rank, None)
        for rank in [k for k in self.z if k not in job.ranks]:  # ranks the job forgot
            self.streak.pop(rank, None)
            self.z.pop(rank, None)
        found = []
        for rank, n in sorted(self.streak.items()):
            if n < self.t.outlier_probes:
                self.why.pop(rank, None)
                continue
            found.append((rank, self.why[rank]["step"], {**self.why[rank], "ranks": list(r.ranks),
                                                          "zscores": {str(k): v for k, v in sorted(self.z.items())}}))
        return (Outcome.FINDING if found else Outcome.HEALTHY), found

    def values(self) -> dict:
        return {"rank_outlier_zscore": {(str(k),): v for k, v in self.z.items()}}


class _FakeJob:
    def __init__(self, world):
        self.job = "j"
        self.ranks = {k: types.SimpleNamespace(closing=False) for k in range(world)}


@pytest.mark.parametrize("seed", range(3))
def test_outlier_rank_streaks_as_arrays_equal_the_rank_by_rank_loop(seed):
    """Random rounds: outlying ranks that come and go, ranks missing from a round, pipeline
    stages too small to score, ranks forgotten."""
    rng = np.random.default_rng(seed)
    world, t = 9, Thresholds(outlier_probes=2)
    s = _schema(0, world, MODULES[:4])
    base = reconcile(world, {s.hash: s}, 0, {r: _report(rng, r, s) for r in range(world)}, True)
    fast, ref, job = OutlierRank(t), _OutliersByTheBook(t), _FakeJob(world)
    for step in range(1, 120):
        ranks = tuple(sorted(rng.choice(world, size=int(rng.integers(2, world + 1)), replace=False).tolist()))
        k = np.array(ranks)
        local = 1.0 + 0.05 * rng.standard_normal(len(k))
        local[np.isin(k, rng.choice(world, size=int(rng.integers(0, 3))))] *= 8.0
        act = np.abs(base.act[k]) + 1.0
        part = None if rng.random() < 0.7 else (k >= 6).astype(np.int64)  # a stage of at most 3 ranks
        rr = dataclasses.replace(base, step=step, ranks=ranks, local_grad_norm=local, act=act,
                                 rank_totals=np.zeros((len(k), 3)), part=part)
        if rng.random() < 0.05:
            job.ranks.pop(int(rng.integers(0, world)), None)
        a, b = fast.on_round(job, rr), ref.round(job, rr)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.outcome == b[0]
            assert [(f.rank, f.step, f.details) for f in a.findings] == b[1]
        assert fast.values("j") == ref.values()


def test_a_capped_round_exports_the_merge_of_what_is_left():
    """cap_series cuts a round over the job's series budget; the layers merged for export with
    the round (RoundResult.grouped) must be those of the cut round, or the cap would not hold."""
    from gradwatch.aggregator.series import SERIES_PER_LAYER, SERIES_PER_MODULE, cap_series

    rng = np.random.default_rng(9)
    s = _schema(0, 3, MODULES)
    reports = {r: _report(rng, r, s) for r in range(3)}
    rr = reconcile(3, {s.hash: s}, 3, reports, True, group_depth=2)
    assert rr.grouped.layers == ("blocks.0", "blocks.1", "blocks.2")
    cut, dropped = cap_series(rr, 3 * (SERIES_PER_LAYER + SERIES_PER_MODULE))  # 3 of the 9 layers
    assert dropped > 0 and cut.layers == tuple(MODULES[:3])
    assert cut.grouped.layers == ("blocks.0",)
    _same_round(cut.grouped, group_layers(dataclasses.replace(cut, grouped=None), 2))
    plain, _ = cap_series(reconcile(3, {s.hash: s}, 3, reports, True), 3 * (SERIES_PER_LAYER + SERIES_PER_MODULE))
    assert plain.grouped is None
