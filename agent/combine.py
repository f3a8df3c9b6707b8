"""The agent's host combine: one slot's records of several calls of its module in one step (weight
tying, gradient accumulation) become one wire row, by each row's ``combine`` rule in the table of
columns (:data:`gradwatch.columns.CALL_RULES`; the rules marked ``host``).

Sender thread, numpy; no torch. Reads the table, never a column by position: a statistic added to
the table is combined by its rule with no change here.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from gradwatch import columns

# Each rule maps (n int64 [k] element counts of each call, total = n.sum() > 0, x float64 [k] this
# row's record of each call, rec {wire field: its row's records, float64 [k]}, done {wire field:
# combined float}) to one float.


def _weighted_mean(n, total, x, rec, done):
    return float((n * x).sum() / total)


def _pooled_std(n, total, x, rec, done):
    # Chan, Golub and LeVeque 1979, "Updating formulae and a pairwise algorithm for computing
    # sample variances": M2 = sum M2_i + sum n_i (mean_i - mean)^2; population std = sqrt(M2 / N)
    m2 = float(x.sum() + (n * (rec["mean"] - done["mean"]) ** 2).sum())
    return float(np.sqrt(max(m2, 0.0) / total)) if np.isfinite(m2) else float("nan")


#: the implementation of every rule :data:`gradwatch.columns.CALL_RULES` marks ``host``
CALL_FUNCS: dict[str, Callable] = {
    "weighted_mean": _weighted_mean,
    "pooled_std": _pooled_std,
    "min": lambda n, total, x, rec, done: float(x.min()),
    "max": lambda n, total, x, rec, done: float(x.max()),
    "ratio": lambda n, total, x, rec, done: float(x.sum() / total),
    "sum": lambda n, total, x, rec, done: float(x.sum()),
}


def combine_calls(array: str, n: np.ndarray, rec: np.ndarray) -> tuple[float, ...]:
    """Combine one slot's records of several calls into one wire row of ``array``.

    Args:
        array: key of :data:`gradwatch.columns.ARRAYS` whose rows all have a host combine (``"act"``).
        n: int64 [k] element counts of each call.
        rec: float64 [k, width] records, columns in :func:`gradwatch.columns.records` order.

    Returns:
        One float per field of ``array``, in column order; each row's rule's ``empty`` value when
        the calls saw no element.

    Raises:
        ValueError: a row of ``array`` has no host combine (the agent combines it itself).
    """
    rows = columns.of(array)
    rules = [columns.CALL_RULES[s.combine] for s in rows]
    if not all(r.host for r in rules):
        raise ValueError(f"{array}: not combined by combine_calls")
    total = n.sum()
    if total == 0:
        return tuple(r.empty for r in rules)
    cols = {s.field: rec[:, s.column] for s in rows}
    done: dict[str, float] = {}
    for s in rows:
        done[s.field] = CALL_FUNCS[s.combine](n, total, cols[s.field], cols, done)
    return tuple(done[s.field] for s in rows)
