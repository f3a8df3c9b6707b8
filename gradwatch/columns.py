"""Every per-layer and per-parameter statistic, declared once: the table of columns.

A :class:`Statistic` row says everything the pipeline needs to know about one statistic: the wire
array and column it travels in, the field of the agent's on-device record it comes from, how
several calls of one module combine on the agent's host, how members merge (the parameters of a
module, and layers under ``--layer-depth``), which rows of its array count as observed, how ranks
aggregate, and its help text and unit. :data:`STATISTICS` is the table; :mod:`gradwatch.wire`
(array columns), the agent's step frame, report and host combine (``gradwatch.agent.combine``),
the aggregator's reconciliation, reductions, checks and exporter, and the catalog iterate it and
read its columns by name (:func:`at`, :func:`record_at`), never by position. Adding a statistic
is one row here plus its on-device reducer in the agent (which must emit the row's ``record``
field).

Wire arrays (float32, row-major, one row per slot or parameter; see :mod:`gradwatch.wire`):

    act        per activation slot: the output of a leaf module
    act_grad   per activation slot: the gradient reaching that output
    act_count  per activation slot: calls of its module and elements it output in the step
    param      per parameter; the aggregator merges them into their owning module

A NaN in a row's ``observed_by`` column marks "not observed" (a module that did not run, a
gradient that never arrived); a statistic without ``observed_by`` is always observed.

The rules (:data:`CALL_RULES`, :data:`MERGE_RULES`, :data:`AGGREGATIONS`) are declared here by
name; each side implements them where it runs them (the agent's host combine, the aggregator's
reductions), and tests check that every declared rule has its implementation. This module imports
the standard library only: no numpy, no torch, neither the agent nor the aggregator.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

#: cross-rank aggregations a statistic may ask for, the ``agg`` label's values (the aggregator
#: reduces over the ranks that observed a column, ignoring NaN)
AGGREGATIONS = ("min", "median", "max")
#: the aggregations a statistic exports unless its row says otherwise
AGGS = AGGREGATIONS


@dataclass(frozen=True)
class WireArray:
    """One float32 array of a probe report.

    Attributes:
        key: the msgpack key and the :class:`~gradwatch.wire.Report` attribute.
        rows: ``"slots"`` (one row per schema slot) or ``"params"`` (one per schema parameter).
        exported_per: what one exported series is about: ``"layer"`` (the slot's name) or
            ``"module"`` (the module owning the parameters).
        optional: added after protocol version 1 first shipped: a report without it decodes with
            the array all NaN (not observed), and a :class:`~gradwatch.wire.Report` built without
            it encodes so.
    """

    key: str
    rows: str
    exported_per: str
    optional: bool = False


ARRAYS: dict[str, WireArray] = {
    a.key: a
    for a in (
        WireArray("act", "slots", "layer"),
        WireArray("act_grad", "slots", "layer"),
        WireArray("param", "params", "module"),
        WireArray("act_count", "slots", "layer", optional=True),
    )
}


# --- rules -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallRule:
    """Host combine: how one slot's records of several calls of its module in one step (weight
    tying, gradient accumulation) become one wire value.

    Attributes:
        doc: what the rule does, for the catalog.
        host: the agent's host combine (``gradwatch.agent.combine.combine_calls``) applies it;
            False: the agent's vectorised report code combines this array itself.
        empty: its value when the calls saw no element.
    """

    doc: str
    host: bool = True
    empty: float = float("nan")


CALL_RULES: dict[str, CallRule] = {
    "weighted_mean": CallRule("mean weighted by element counts (exact)"),
    "pooled_std": CallRule("pooled exactly from each call's mean and M2 (Chan et al. 1979)"),
    "min": CallRule("min"),
    "max": CallRule("max"),
    "ratio": CallRule("counts summed, over elements summed", empty=0.0),
    "sum": CallRule("summed", empty=0.0),
    "l2": CallRule("sums of squares summed, then the square root", host=False),
    "once": CallRule("one value per step", host=False),
    "count": CallRule("calls counted", host=False),
}


@dataclass(frozen=True)
class MergeRule:
    """Member merge: how the rows of a module's parameters, or of a group's layers under
    ``--layer-depth``, become one row (the aggregator's reductions implement it). Members are
    weighted equally: element counts are not on the wire.

    Attributes:
        doc: what the rule does, for the catalog.
        squares: members combine as the square root of their summed squares (a norm), the rule
            a shard group's parts of one parameter combine by too; else as their plain sum when
            the rule is ``sum``.
    """

    doc: str
    squares: bool = False


MERGE_RULES: dict[str, MergeRule] = {
    "l2": MergeRule("L2 norm over members", squares=True),
    "sum": MergeRule("summed"),
    "min": MergeRule("min"),
    "max": MergeRule("max"),
    "mean": MergeRule("mean of the members' means"),
    "pooled_std": MergeRule("pooled from the members' means and stds"),
}


# --- the table ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Statistic:
    """One per-layer or per-parameter statistic.

    Attributes:
        name: exported as ``gradwatch_layer_<name>``; the key of ``RoundResult.agg``.
        array: key of :data:`ARRAYS` it travels in.
        field: its column's name within the array (``wire.ACT_FIELDS`` and friends).
        record: field of the agent's on-device record its column is combined from.
        combine: key of :data:`CALL_RULES`: several calls of one module in one step.
        merge: key of :data:`MERGE_RULES`: members (parameters of a module; layers of a group).
        help: help text of the exported metric.
        unit: Prometheus unit ("" for none).
        observed_by: field of the same array whose NaN marks the row not observed; None: always.
        aggs: cross-rank aggregations exported, the ``agg`` label (names in :data:`AGGREGATIONS`).
        rank_total: ``(metric name, help)`` of a per-rank gauge summing this statistic over the
            rank's layers, or None.
        column: column in the array, assigned by :func:`declare` from the table's order.
    """

    name: str
    array: str
    field: str
    record: str
    combine: str
    merge: str
    help: str
    unit: str = ""
    observed_by: Optional[str] = None
    aggs: tuple[str, ...] = AGGS
    rank_total: Optional[tuple[str, str]] = None
    column: int = -1


def declare(*rows: Statistic) -> tuple[Statistic, ...]:
    """The table from ``rows``: columns numbered per array in order, every reference checked.

    Raises:
        ValueError: an unknown array, rule, aggregation or ``observed_by`` field, a duplicate
            name, field or record (within its array), or a ``pooled_std`` row without a ``mean`` field before it.
    """
    out, cols, names, recs = [], {}, set(), {}
    for r in rows:
        if r.array not in ARRAYS:
            raise ValueError(f"{r.name}: unknown array {r.array!r}")
        if r.combine not in CALL_RULES or r.merge not in MERGE_RULES or not set(r.aggs) <= set(AGGREGATIONS):
            raise ValueError(f"{r.name}: unknown rule or aggregation")
        fields = cols.setdefault(r.array, [])
        if r.name in names or r.field in fields or r.record in recs.setdefault(r.array, set()):
            raise ValueError(f"{r.name}: duplicate name, field or record")
        if "pooled_std" in (r.combine, r.merge) and "mean" not in fields:
            raise ValueError(f"{r.name}: pooled_std needs a 'mean' field earlier in {r.array}")
        names.add(r.name)
        recs[r.array].add(r.record)
        out.append(replace(r, column=len(fields)))
        fields.append(r.field)
    for r in out:
        if r.observed_by is not None and r.observed_by not in cols[r.array]:
            raise ValueError(f"{r.name}: observed_by {r.observed_by!r} is not a field of {r.array}")
    return tuple(out)


_ACT = dict(array="act", observed_by="nonfinite")
_COUNT = dict(array="act_count", observed_by="calls", aggs=("min", "max"))
_GRAD = dict(array="act_grad", observed_by="nonfinite")

#: every statistic, in export order; within an array, in wire column order
STATISTICS: tuple[Statistic, ...] = declare(
    Statistic("activation_mean", field="mean", record="mean", combine="weighted_mean", merge="mean",
              help="Mean of the layer's output activations.", **_ACT),
    Statistic("activation_std", field="std", record="m2", combine="pooled_std", merge="pooled_std",
              help="Standard deviation (population) of the layer's output activations.", **_ACT),
    Statistic("activation_min", field="min", record="min", combine="min", merge="min",
              help="Smallest output activation of the layer.", **_ACT),
    Statistic("activation_max", field="max", record="max", combine="max", merge="max",
              help="Largest output activation of the layer.", **_ACT),
    # the largest member's ratio: a dead member stays visible in its group
    Statistic("activation_zero_ratio", field="zero_ratio", record="zeros", combine="ratio", merge="max",
              help="Fraction of the layer's output activations that are exactly zero (0-1).", unit="ratio", **_ACT),
    Statistic("activation_nonfinite", field="nonfinite", record="nonfinite", combine="sum", merge="sum",
              help="NaN/Inf elements in the layer's output activations.", **_ACT,
              rank_total=("rank_activation_nonfinite", "NaN/Inf activation elements summed over the rank's layers at the latest probed step.")),
    Statistic("output_grad_norm", field="norm", record="sumsq", combine="l2", merge="l2",
              help="L2 norm of the gradient reaching the layer's output (local to the rank, before all-reduce).", **_GRAD),
    Statistic("output_grad_nonfinite", field="nonfinite", record="nonfinite", combine="sum", merge="sum",
              help="NaN/Inf elements in the gradient reaching the layer's output.", **_GRAD,
              rank_total=("rank_output_grad_nonfinite", "NaN/Inf output-gradient elements summed over the rank's layers at the latest probed step.")),
    # a slot whose calls saw no element (an empty output; a module with no floating output) has
    # calls and elements here and no act row at all: no mean, std, min or max to export
    Statistic("activation_calls", field="calls", record="calls", combine="count", merge="sum",
              help="Calls of the layer's module in the step (all micro-steps); absent when it did not run.", **_COUNT),
    Statistic("activation_elements", field="elements", record="elements", combine="sum", merge="sum",
              help="Elements of the layer's output summed over its calls (0: empty, or no floating tensor).", **_COUNT),
    Statistic("grad_norm", array="param", field="grad_norm", record="sumsq", combine="once", merge="l2",
              observed_by="grad_nonfinite", help="L2 norm of the gradient of the layer's own parameters after all-reduce."),
    Statistic("weight_norm", array="param", field="weight_norm", record="norm", combine="once", merge="l2",
              help="L2 norm of the layer's own parameters after the optimizer step."),
    Statistic("grad_nonfinite", array="param", field="grad_nonfinite", record="nonfinite", combine="once", merge="sum",
              observed_by="grad_nonfinite", help="NaN/Inf elements in the gradient of the layer's own parameters.",
              rank_total=("rank_param_grad_nonfinite", "NaN/Inf parameter-gradient elements summed over the rank's parameters at the latest probed step.")),
)


def of(array: str) -> tuple[Statistic, ...]:
    """The rows of ``array`` in column order."""
    return _index(STATISTICS).rows.get(array, ())


def fields(array: str) -> tuple[str, ...]:
    """Column names of ``array``, in order (``wire.ACT_FIELDS`` and friends)."""
    return _index(STATISTICS).fields.get(array, ())


def records(array: str) -> tuple[str, ...]:
    """On-device record fields of ``array``, in column order (the agent's ``MOMENT_FIELDS``)."""
    return tuple(s.record for s in of(array))


def named(name: str) -> Optional[Statistic]:
    """The row of the statistic called ``name``, or None."""
    return _index(STATISTICS).by_name.get(name)


def observing() -> tuple[tuple[Statistic, ...], ...]:
    """The table's rows grouped by array and ``observed_by`` column (the rows one mask of
    observed ranks serves), groups in order of first appearance, rows in table order."""
    return _index(STATISTICS).observing


def at(array: str):
    """The columns of ``array`` by field name: a named tuple whose attribute ``F`` is the
    position of field ``F`` in the array's last axis (``at("param").weight_norm``), in
    :func:`fields` order. Code reads and writes a column through it, never by a literal position.

    Raises:
        KeyError: ``array`` is not a key of :data:`ARRAYS`.
    """
    return _index(STATISTICS).at[array]


def record_at(array: str):
    """:func:`at` for the agent's on-device records of ``array`` (:func:`records`): the position
    of each record field in a record (``record_at("act_grad").sumsq``).

    Raises:
        KeyError: ``array`` is not a key of :data:`ARRAYS`.
    """
    return _index(STATISTICS).record_at[array]


class _TableIndex(NamedTuple):
    """What readers look up in a table of statistics, derived from it once."""

    rows: dict  # array -> its rows, in column order
    fields: dict  # array -> its fields, in column order
    by_name: dict  # statistic name -> its row
    observing: tuple  # the rows grouped by (array, observed_by), in order of first appearance
    at: dict  # array -> named tuple of its columns' positions, by field
    record_at: dict  # array -> named tuple of its record fields' positions


_INDEX: list = [None, None]  # (the table, its _TableIndex): readers ask often


def _named(array: str, names) -> tuple:
    return collections.namedtuple(f"{array}_columns", names)(*range(len(names)))


def _index(table) -> _TableIndex:
    if _INDEX[0] is not table:  # the table may be replaced (tests add a row)
        rows: dict[str, list] = {}
        observing: dict[tuple, list] = {}
        for s in table:
            rows.setdefault(s.array, []).append(s)
            observing.setdefault((s.array, s.observed_by), []).append(s)
        rows_ = {k: tuple(rows.get(k, ())) for k in ARRAYS}
        fields_ = {k: tuple(s.field for s in v) for k, v in rows_.items()}
        _INDEX[:] = [table, _TableIndex(
            {k: v for k, v in rows_.items() if v}, {k: v for k, v in fields_.items() if v},
            {s.name: s for s in table}, tuple(tuple(g) for g in observing.values()),
            {k: _named(k, v) for k, v in fields_.items()},
            {k: _named(k, tuple(s.record for s in v)) for k, v in rows_.items()},
        )]
    return _INDEX[1]
