"""Majority vote over per-rank fingerprints, shared by the gradient-agreement and drift checks."""

from __future__ import annotations

import collections

import numpy as np


def minority(fp: np.ndarray, seen: np.ndarray, holders: np.ndarray | None = None) -> tuple[dict[int, list[int]], list[int]]:
    """Find ranks whose fingerprint differs from the majority, per parameter.

    Args:
        fp: uint64 [n_ranks, n_params] fingerprints.
        seen: bool [n_ranks, n_params]: which entries exist.
        holders: int64 [n_ranks, n_params], or None: ranks are only compared with ranks of an
            equal number in the column, those holding the same bytes (sharded parameters:
            :func:`gradwatch.aggregator.shards.combine_params`). None: all ranks hold the same.

    Returns:
        ``{rank index: [parameter indices where it is in the minority]}``, and the parameter
        indices whose values split with no strict majority (e.g. two ranks that disagree).
    """
    if holders is not None and holders.any():
        out: dict[int, list[int]] = collections.defaultdict(list)
        tied: list[int] = []
        for h in np.unique(holders):
            bad, t = minority(fp, seen & (holders == h))
            for k, ps in bad.items():
                out[k].extend(ps)
            tied.extend(t)
        return {k: sorted(v) for k, v in out.items()}, sorted(set(tied))
    ref = fp[np.argmax(seen, axis=0), np.arange(fp.shape[1])]
    suspect = np.flatnonzero(((fp != ref) & seen).any(axis=0))  # fast path: usually empty
    out: dict[int, list[int]] = collections.defaultdict(list)
    tied: list[int] = []
    for p in suspect:
        rows = np.flatnonzero(seen[:, p])
        counts = collections.Counter(fp[rows, p].tolist())
        (top, n), *rest = counts.most_common()
        if rest and rest[0][1] == n:
            tied.append(int(p))
            continue
        for r in rows[fp[rows, p] != top]:
            out[int(r)].append(int(p))
    return dict(out), tied
