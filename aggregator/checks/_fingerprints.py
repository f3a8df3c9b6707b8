"""Majority vote over per-rank values of each parameter, shared by the gradient-agreement and drift
checks: fingerprints, compared bit for bit, and gradient norms, compared within a relative tolerance."""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np


def close(a: np.ndarray, b: np.ndarray, rtol: float) -> np.ndarray:
    """bool, broadcast: ``a == b``, or both finite with ``|a - b| <= rtol * max(|a|, |b|)``."""
    with np.errstate(invalid="ignore", over="ignore"):
        return (a == b) | (np.isfinite(a) & np.isfinite(b) & (np.abs(a - b) <= rtol * np.maximum(np.abs(a), np.abs(b))))


def _clusters(values: np.ndarray, rtol: Optional[float]) -> np.ndarray:
    """int64 [n]: a cluster id per value; equal values (``rtol`` None) or, ascending, values
    within ``rtol`` of their cluster's smallest share one."""
    if rtol is None:
        return np.unique(values, return_inverse=True)[1].reshape(-1)
    order = np.argsort(values, kind="stable")
    ids = np.empty(len(values), np.int64)
    cid, first = -1, None
    for i in order:
        if first is None or not close(values[i], first, rtol):
            cid, first = cid + 1, values[i]
        ids[i] = cid
    return ids


def minority(fp: np.ndarray, seen: np.ndarray, holders: np.ndarray | None = None,
             rtol: Optional[float] = None) -> tuple[dict[int, list[int]], list[int]]:
    """Find ranks whose value differs from the majority, per parameter.

    Args:
        fp: [n_ranks, n_params] values: uint64 fingerprints (``rtol`` None: equal bit for bit), or
            float64 norms (``rtol``: equal within it, :func:`close`).
        seen: bool [n_ranks, n_params]: which entries exist.
        holders: int64 [n_ranks, n_params], or None: ranks are only compared with ranks of an
            equal number in the column, those holding the same bytes (sharded parameters:
            :func:`gradwatch.aggregator.shards.holders`). None: all ranks hold the same.
        rtol: relative tolerance for float values; None compares exactly.

    Returns:
        ``{rank index: [parameter indices where it is in the minority]}``, and the parameter
        indices whose values split with no single largest group (e.g. two ranks that disagree).
        With ``rtol``, groups are formed in ascending order, each value joining the group of the
        smallest value within ``rtol`` of it.
    """
    if holders is not None and holders.any():
        return _within_holders(fp, seen, holders, rtol)
    if rtol is None and seen.all():  # every rank has every value: the first rank's are the reference
        suspect = np.flatnonzero((fp != fp[:1]).any(axis=0))
    else:
        ref = fp[np.argmax(seen, axis=0), np.arange(fp.shape[1])]
        differ = (fp != ref) if rtol is None else ~close(fp, ref, rtol)
        suspect = np.flatnonzero((differ & seen).any(axis=0))  # usually empty
    out: dict[int, list[int]] = collections.defaultdict(list)
    tied: list[int] = []
    for p in suspect:
        rows = np.flatnonzero(seen[:, p])
        ids = _clusters(fp[rows, p], rtol)
        counts = collections.Counter(ids.tolist())
        (top, n), *rest = counts.most_common()
        if rest and rest[0][1] == n:
            tied.append(int(p))
            continue
        for r in rows[ids != top]:
            out[int(r)].append(int(p))
    return dict(out), tied


def _within_holders(fp: np.ndarray, seen: np.ndarray, holders: np.ndarray,
                    rtol: Optional[float]) -> tuple[dict[int, list[int]], list[int]]:
    """:func:`minority` with ``holders``: each column's vote held among the ranks of one holders
    number, every (number, column) set at once. Each seen entry is compared with its set's first
    (in rank order); only sets where one differs are voted on one by one (usually none), each a
    slice of one stable sort. A sharded 16,384-rank job has ~1,600 sets per column group: one full
    pass per set took seconds."""
    P = fp.shape[1]
    if seen.all():  # the usual round: every entry, rank-major, is the arrays' own order
        r_idx = p_idx = None  # worked out below only for a vote
        keys = (holders * P + np.arange(P)).reshape(-1)
        vals = fp.reshape(-1)
    else:
        r_idx, p_idx = np.nonzero(seen)  # rank-major: a set's entries in rank order
        if not len(r_idx):
            return {}, []
        keys = holders[r_idx, p_idx] * P + p_idx
        vals = fp[r_idx, p_idx]
    first, inv = _sets(keys)
    ref = vals[first][inv]
    differ = (vals != ref) if rtol is None else ~close(vals, ref, rtol)
    out: dict[int, list[int]] = collections.defaultdict(list)
    tied: set[int] = set()
    bad = np.unique(inv[differ])
    if not len(bad):
        return {}, []
    if r_idx is None:
        r_idx, p_idx = np.divmod(np.arange(fp.size), P)
    by_set = np.argsort(inv, kind="stable")  # each set's entries together, in rank order
    ends = np.cumsum(np.bincount(inv))
    for g in bad.tolist():
        members = by_set[(ends[g - 1] if g else 0):ends[g]]
        p = int(p_idx[members[0]])
        ids = _clusters(vals[members], rtol)
        (top, n), *rest = collections.Counter(ids.tolist()).most_common()
        if rest and rest[0][1] == n:
            tied.add(p)
            continue
        for r in r_idx[members[ids != top]].tolist():
            out[r].append(p)
    return {k: sorted(v) for k, v in out.items()}, sorted(tied)


def _sets(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_index=True, return_inverse=True)[1:]`` of int64 [n] keys >= 0:
    each distinct key's first position, and each entry's set number (sets in ascending key order).
    Keys below a few times n are counted in a table instead of sorted (a sharded 16,384-rank
    round: 3.3 million keys under 330,000, 18 against 75 ms)."""
    top = int(keys.max()) + 1 if len(keys) else 0
    if top > 4 * len(keys) + 4096:
        _, first, inv = np.unique(keys, return_index=True, return_inverse=True)
        return first, inv.reshape(-1)
    used = np.zeros(top, bool)
    used[keys] = True
    number = np.cumsum(used) - 1  # a key's set number: how many smaller keys are used
    inv = number[keys]
    first = np.full(int(number[-1]) + 1 if top else 0, len(keys), np.int64)
    np.minimum.at(first, inv, np.arange(len(keys)))
    return first, inv
