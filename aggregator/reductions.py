"""The aggregator's numpy reductions of the columns :mod:`gradwatch.columns` declares.

Each statistic's row names its rules; here they run: :data:`MERGE_FUNCS` merges members (a
module's parameters, a group's layers under ``--layer-depth``) per rank by the row's ``merge``
rule (:func:`merge`), and :data:`AGG_FUNCS` aggregates over ranks by its ``aggs``
(:func:`aggregate`, :func:`aggregate_all`, :class:`LazyAggregates`), where the row's
``observed_by`` column says the rank observed it (:func:`observed`). :func:`nanmedian` and
:func:`finite_median` are numpy's medians bit for bit, without their overhead on the arrays a round
holds; the checks take them too.

Pure numpy; reads the table, never a column by position.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from gradwatch import columns
from gradwatch.columns import AGGS, Statistic


def nanmedian(a: np.ndarray, axis: int = 0) -> np.ndarray:
    """The median along ``axis`` ignoring NaN, as ``np.nanmedian`` (NaN where all are), without its
    masked-array path for small arrays (20x slower).

    ``np.median``'s arithmetic, bit for bit: the middle value of an odd count, the mean of the two
    middles of an even one, each as a sum from 0.0 (a median of zeros is 0.0, never -0.0). The
    columns with the same count of values are done together: one ``np.partition`` at their two
    middle positions (NaNs go last, as in a sort), as ``np.median`` does. At most :data:`_MEDIAN_COUNTS` distinct counts are partitioned so; past
    that, one sort. A partition is about twice as fast as a sort along the ranks of a round
    (16,384 x 600 values: 160 against 340 ms).
    """
    m = a.shape[axis]
    if not m:
        return _sorted_nanmedian(a, axis)
    nan = np.isnan(a)
    if not nan.any():  # the usual round: every column has all m values
        return _middles(np.partition(a, _kth(m), axis=axis), m, axis)
    n = m - nan.sum(axis=axis)
    counts = np.unique(n)
    if len(counts) > _MEDIAN_COUNTS:
        return _sorted_nanmedian(a, axis)
    out = np.full(n.shape, np.nan)
    moved = np.moveaxis(a, axis, -1)  # a view: the columns as the leading axes
    for c in counts.tolist():
        if c:
            cols = n == c
            out[cols] = _middles(np.partition(moved[cols], _kth(c), axis=-1), c, -1)
    return out


#: distinct counts of values :func:`nanmedian` partitions one at a time (a pipeline job's stages
#: give a few; each partition is a pass over its columns)
_MEDIAN_COUNTS = 8


def _kth(n: int) -> list[int]:
    return [(n - 1) // 2, n // 2]


def _middles(p: np.ndarray, n: int, axis: int) -> np.ndarray:
    """The median of ``n`` values along ``axis`` of ``p``, partitioned at :func:`_kth` there."""
    def row(i):  # p[..., i, ...] along axis (basic indexing: np.take is 10x slower here)
        return p[(slice(None),) * (axis % p.ndim) + (i,)]

    return 0.0 + row(n // 2) if n % 2 else (0.0 + row(n // 2 - 1) + row(n // 2)) / 2


def _sorted_nanmedian(a: np.ndarray, axis: int) -> np.ndarray:
    """:func:`nanmedian` by one sort, NaNs last, then each column's middle values."""
    s = np.sort(a, axis=axis)
    n = (~np.isnan(a)).sum(axis=axis)
    lo, hi = (np.maximum(i, 0) for i in ((n - 1) // 2, n // 2))

    def at(i):
        return np.take_along_axis(s, np.expand_dims(i, axis), axis).squeeze(axis)

    with np.errstate(over="ignore", invalid="ignore"):
        out = np.where(n % 2 == 1, 0.0 + at(hi), (0.0 + at(lo) + at(hi)) / 2)
    return np.where(n > 0, out, np.nan)


def finite_median(v: np.ndarray) -> float:
    """``float(np.median(v))`` of a float64 [n > 0] without NaN, bit for bit, from one sort
    (np.median costs ten times more on a few dozen values): np.median's mean of the middle value
    or two, a sum starting from 0.0 (so that -0.0 comes out 0.0)."""
    s = np.sort(v)
    n = len(s)
    return 0.0 + float(s[n // 2]) if n % 2 else (0.0 + float(s[n // 2 - 1]) + float(s[n // 2])) / 2


#: the aggregations over ranks (:data:`gradwatch.columns.AGGREGATIONS`), each a NaN-ignoring
#: numpy reduction along the ranks' axis
AGG_FUNCS: dict[str, Callable] = {"min": np.nanmin, "median": nanmedian, "max": np.nanmax}


# Member merge (:data:`gradwatch.columns.MERGE_RULES`). Each rule maps (v float64 [R, m] member
# values, o bool [R, m] observed (or a scalar True), cnt int [R, G] (or [1, G]) members observed,
# members {wire field: float64 [R, m]}, done {wire field: float64 [R, G]}, red) to float64 [R, G]:
# ``m`` members laid out group after group, reduced per group by ``red`` (:class:`_Reducer`:
# ``total``, ``least``, ``most``).


def _merge_mean(v, o, cnt, members, done, red):
    return red.total(np.where(o, v, 0)) / cnt


def _merge_pooled_std(v, o, cnt, members, done, red):
    mean = done["mean"]
    var = red.total(np.where(o, v**2 + members["mean"] ** 2, 0)) / cnt - mean**2
    return np.sqrt(np.maximum(var, 0))


MERGE_FUNCS: dict[str, Callable] = {
    "l2": lambda v, o, cnt, members, done, red: np.sqrt(red.total(np.where(o, v**2, 0))),
    "sum": lambda v, o, cnt, members, done, red: red.total(np.where(o, v, 0)),
    "min": lambda v, o, cnt, members, done, red: red.least(np.where(o, v, np.inf)),
    "max": lambda v, o, cnt, members, done, red: red.most(np.where(o, v, -np.inf)),
    "mean": _merge_mean,
    "pooled_std": _merge_pooled_std,
}


def observed(stat: Statistic, values: np.ndarray) -> np.ndarray:
    """bool [...]: where ``stat`` was observed in ``values`` (float [..., width] of its array):
    its ``observed_by`` column is not NaN; everywhere for a statistic without one."""
    if stat.observed_by is None:
        return np.ones(values.shape[:-1], bool)
    return ~np.isnan(values[..., getattr(columns.at(stat.array), stat.observed_by)])


def observed_rows(array: str, values: np.ndarray) -> np.ndarray:
    """bool [...]: rows of ``values`` (float [..., width] of ``array``) where every statistic of
    the array was observed (for ``param``: the parameter had a gradient)."""
    out = np.ones(values.shape[:-1], bool)
    for s in columns.of(array):
        out &= observed(s, values)
    return out


@dataclass(frozen=True, eq=False)
class MergePlan:
    """Groups of members prepared for :func:`merge` once (a round's modules, a depth's layer
    groups: the same every round of a job), so a merge does no Python work per group.

    Attributes:
        groups: int64 index arrays into the members, one per group.
        order: int64 [M]: every group's members, group after group.
        ascending: ``order`` is 0 .. M - 1 (a model's layers and modules group so): with M
            members, :func:`merge` reads them where they are, without a gather.
        starts: int64 [G'] where each group with members starts in ``order``.
        sizes: int64 [1, G] members per group.
        filled: int64 [G'] the groups with members (None: every group).
    """

    groups: tuple
    order: np.ndarray
    ascending: bool
    starts: np.ndarray
    sizes: np.ndarray
    filled: Optional[np.ndarray]


def merge_plan(groups) -> MergePlan:
    """The :class:`MergePlan` of ``groups`` (int64 index arrays into the members)."""
    groups = tuple(np.asarray(g, np.int64).reshape(-1) for g in groups)
    sizes = np.array([len(g) for g in groups], np.int64)
    order = np.concatenate(groups) if groups else np.zeros(0, np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])) if groups else np.zeros(0, np.int64)
    filled = np.flatnonzero(sizes)
    return MergePlan(groups, order, bool(np.array_equal(order, np.arange(len(order)))), starts[filled],
                     sizes[None, :], None if len(filled) == len(groups) else filled)


class _Reducer:
    """Per-group reductions of [R, M] member columns laid out by a :class:`MergePlan` into [R, G],
    each with numpy's ``reduceat`` over the group's members in order:

    - ``total``: the first member plus numpy's pairwise sum of the others, ``x0 + (x1 + ... )``
      (``reduceat``'s order: left to right from the second member up to 9 members, numpy's
      pairwise blocks beyond; ``np.sum`` adds ``x0`` first, so the two differ in the last bits
      from 3 members on), then ``+ 0.0`` (a sum of zeros is 0.0, never -0.0); 0.0 for no member;
    - ``least``/``most``: the min and max, an observed NaN propagating; a zero result is -0.0 for
      the min when a member is -0.0 and 0.0 for the max when a member is 0.0 (IEEE 754-2019
      minimum/maximum: numpy's SIMD picks either zero of a tie by its position); +-inf for no
      member.
    """

    def __init__(self, plan: MergePlan):
        self.plan = plan

    def _at(self, ufunc, x: np.ndarray, empty, dtype=None) -> np.ndarray:
        p = self.plan
        if len(p.starts):
            got = ufunc.reduceat(x, p.starts, axis=1, dtype=dtype)
        else:
            got = np.zeros((x.shape[0], 0), dtype or x.dtype)
        if p.filled is None:
            return got
        out = np.full((x.shape[0], p.sizes.shape[1]), empty, got.dtype)
        out[:, p.filled] = got
        return out

    def total(self, x: np.ndarray) -> np.ndarray:
        return self._at(np.add, x, 0.0) + 0.0

    def count(self, o: np.ndarray) -> np.ndarray:
        return self._at(np.add, o, 0, np.int64)

    def least(self, x: np.ndarray) -> np.ndarray:
        return self._zeros(self._at(np.minimum, x, np.inf), x, np.signbit)

    def most(self, x: np.ndarray) -> np.ndarray:
        return self._zeros(self._at(np.maximum, x, -np.inf), x, lambda z: ~np.signbit(z))

    def _zeros(self, got: np.ndarray, x: np.ndarray, wins) -> np.ndarray:
        """``got`` with each zero signed as the min or max of zeros of both signs is (``wins``:
        the sign that wins a tie, as a test on the members)."""
        zero = got == 0
        if not zero.any():
            return got
        won = self._at(np.logical_or, (x == 0) & wins(x), False)  # a member is a winning zero
        return np.where(zero, np.where(won == wins(got), got, -got), got)


def merge(array: str, values: np.ndarray, present: Optional[np.ndarray], groups) -> np.ndarray:
    """Merge members of ``array`` into groups, per rank, by each row's ``merge`` rule.

    Args:
        array: key of :data:`ARRAYS`.
        values: float64 [R, N, width] member rows per rank.
        present: bool [R, N]: the member exists on that rank (the others count as not observed;
            an always-observed statistic merges over present members); None: every member exists.
        groups: int64 index arrays into N, the members of each group, or their
            :class:`MergePlan` (prepared once, for groups that come back every round).

    Returns:
        float64 [R, G, width]. Each group's members are reduced in their order by
        :class:`_Reducer` (each group's sum in one fixed order, signed zeros of a min or max settled), whatever their
        place in ``values``. An observed NaN propagates; a group none of whose members a rank
        observed is NaN for the rows with ``observed_by`` (0 for an always-observed L2 norm or
        sum over no member).
    """
    plan = groups if isinstance(groups, MergePlan) else merge_plan(groups)
    rows = columns.of(array)
    R = values.shape[0]
    out = np.empty((R, len(plan.groups), len(rows)))  # every column is written below
    if not len(plan.groups):
        return out
    # the members group after group, as one array: the values themselves in the usual layout
    inplace = plan.ascending and len(plan.order) == values.shape[1]
    vals = values if inplace else np.take(values, plan.order, axis=1)
    here = present if present is None or inplace else np.take(present, plan.order, axis=1)
    red = _Reducer(plan)
    empty = plan.filled is not None  # a group without members: NaN where observed
    masks, counts = {}, {}
    for s in rows:
        if s.observed_by not in masks:
            m = observed(s, vals) if here is None else observed(s, vals) & here
            # observed everywhere (the healthy round): the members as they are, counted by the plan
            masks[s.observed_by], counts[s.observed_by] = (np.True_, plan.sizes) if m.all() else (m, red.count(m))
    members = {s.field: vals[..., s.column] for s in rows}
    done: dict[str, np.ndarray] = {}
    with np.errstate(invalid="ignore", divide="ignore"):
        for s in rows:
            o, cnt = masks[s.observed_by], counts[s.observed_by]
            x = MERGE_FUNCS[s.merge](members[s.field], o, cnt, members, done, red)
            if s.observed_by is not None and (empty or o is not np.True_):
                x = np.where(cnt == 0, np.nan, x)
            done[s.field] = x
            out[..., s.column] = x
    return out


def aggregate(values: np.ndarray, seen: np.ndarray, aggs: tuple[str, ...] = AGGS) -> tuple[np.ndarray, np.ndarray]:
    """Aggregate over ranks (axis 0) where ``seen``.

    Args:
        values: float64 [R, n].
        seen: bool [R, n]: the rank observed the column.
        aggs: keys of :data:`AGG_FUNCS`.

    Returns:
        float64 [len(aggs), n] (NaN for a column no rank observed; an observed NaN propagates),
        and bool [n]: the columns any rank observed.
    """
    out = np.full((len(aggs), values.shape[1]), np.nan)
    cols = seen.any(axis=0)
    # a column with an observed NaN stays NaN; the others have at least one value to reduce
    clean = cols & ~(np.isnan(values) & seen).any(axis=0)
    if clean.any():
        vc = np.where(seen, values, np.nan)[:, clean]
        for a, name in enumerate(aggs):
            out[a, clean] = AGG_FUNCS[name](vc, axis=0)
    return out, cols


def aggregate_all(arrays: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every statistic aggregated over ranks: ``{name: aggregate(...)}``, in table order, equal to
    :func:`aggregate` of each row bit for bit.

    Args:
        arrays: key of :data:`ARRAYS` -> float64 [R, n, width] per-layer (or per-module) rows.

    The statistics of one array observed by one column are reduced together, one numpy call per
    aggregation over all their columns (a column's reduction does not depend on its neighbours).
    One exception: numpy's SIMD min and max pick either zero of a tie between 0.0 and -0.0
    depending on where the column sits in the array, so a statistic whose min or max is a zero
    over zeros of both signs is aggregated again by :func:`aggregate`, as it always was.
    """
    out = {}
    for stats in columns.observing():
        a = arrays[stats[0].array]
        seen = observed(stats[0], a)  # bool [R, n], shared by the group
        cols = seen.any(axis=0)
        names = tuple(dict.fromkeys(n for s in stats for n in s.aggs))
        if not a.shape[0] or not set(names) <= set(_FAST):
            out.update({s.name: aggregate(a[..., s.column], seen, s.aggs) for s in stats})
            continue
        k = [s.column for s in stats]
        v = a if k == list(range(a.shape[-1])) else a[..., k]  # float64 [R, n, len(stats)]
        if seen.all():
            masked, bad = v, np.isnan(v).any(axis=0)
        else:
            masked = np.where(seen[..., None], v, np.nan)
            bad = (np.isnan(v) & seen[..., None]).any(axis=0)
        clean = cols[:, None] & ~bad  # [n, len(stats)]: observed, no observed NaN
        got = np.where(clean, np.stack([_FAST[n](masked) for n in names]), np.nan)  # [len(names), n, len(stats)]
        redo = _mixed_zeros(got, names, masked)  # bool [len(stats)]
        for j, s in enumerate(stats):
            if redo[j]:
                out[s.name] = aggregate(a[..., s.column], seen, s.aggs)
            else:
                out[s.name] = (got[[names.index(n) for n in s.aggs], :, j], cols.copy())
    return {s.name: out[s.name] for s in columns.STATISTICS}


class LazyAggregates(Mapping):
    """:func:`aggregate_all` of ``arrays`` as a mapping whose statistics are aggregated when first
    read, each equal to its :func:`aggregate_all` entry bit for bit (its :func:`aggregate`).

    For a round whose layers are exported merged (``--layer-depth``): its per-layer aggregates
    are read by a few checks only (the median zero ratio and gradient norm), and working all of
    them out takes ~0.2 s of the writer at 16,384 ranks x 100 layers. Reads may come from any
    thread (one lock).
    """

    def __init__(self, arrays: dict[str, np.ndarray]):
        self._arrays, self._done, self._lock = arrays, {}, threading.Lock()

    def __getitem__(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        got = self._done.get(name)
        if got is None:
            stat = columns.named(name)
            if stat is None:
                raise KeyError(name)
            with self._lock:
                got = self._done.get(name)
                if got is None:
                    a = self._arrays[stat.array]
                    got = self._done[name] = aggregate(a[..., stat.column], observed(stat, a), stat.aggs)
        return got

    def __iter__(self):
        return (s.name for s in columns.STATISTICS)

    def __len__(self) -> int:
        return len(columns.STATISTICS)


#: aggregate_all's reductions over ranks, as :data:`AGG_FUNCS` computes them (np.nanmin is
#: np.fmin.reduce, without the warning for a column no rank observed)
_FAST: dict[str, Callable] = {
    "min": lambda x: np.fmin.reduce(x, axis=0),
    "median": lambda x: nanmedian(x, axis=0),
    "max": lambda x: np.fmax.reduce(x, axis=0),
}


def _mixed_zeros(got: np.ndarray, names: tuple, masked: np.ndarray) -> np.ndarray:
    """bool [k]: the statistics (last axis) with a min or max in ``got`` (float64 [len(names), n,
    k]) that is a zero of a column whose values (``masked`` float64 [R, n, k]) hold both 0.0 and
    -0.0."""
    ext = [i for i, n in enumerate(names) if n in ("min", "max")]
    out = np.zeros(got.shape[-1], bool)
    if not ext:
        return out
    z = (got[ext] == 0).any(axis=0)  # [n, k]: a min or a max is a zero
    # -0.0 anywhere at all is rare (it takes a min or a sum of negative zeros): one pass says so
    if z.any() and (masked.view(np.int64) == np.iinfo(np.int64).min).any():
        bits = masked[:, z].view(np.int64)  # [R, zeros]: 0.0 is all zero bits, -0.0 the sign bit alone
        mixed = (bits == 0).any(axis=0) & (bits == np.iinfo(np.int64).min).any(axis=0)
        out[np.nonzero(z)[1][mixed]] = True
    return out

