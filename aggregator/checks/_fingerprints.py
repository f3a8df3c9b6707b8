"""Majority vote over per-rank values of each parameter, shared by the gradient-agreement and drift
checks: fingerprints, compared bit for bit, and gradient norms, compared within a relative tolerance
(:func:`minority`); and :class:`Agreement`, the base both checks are built on (a vote over a
round's fingerprints, one finding per fault)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from . import Check, Evaluation, Finding, ranks_live


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


@dataclass
class AgreementState:
    """What :class:`Agreement` keeps per job."""

    active: dict = field(default_factory=dict)  # finding key -> Finding (its first step's)
    last_bad: dict = field(default_factory=dict)  # finding key -> latest step that found it
    norms_judged: bool = False  # a step's gradient norms were judged: that path speaks for the check
    judged: bool = False  # a round was judged: a later round too small to judge changes nothing


def _named_live(job, st: AgreementState) -> bool:
    """The ranks ``st``'s active findings are about are live (:func:`..checks.ranks_live`): the
    rank each names, or for one naming none (a tie) the ranks it was between (``candidates``, else
    the round's ``ranks``), so such a finding resolves too once one of them is gone for good."""
    return ranks_live(job, (k for f in st.active.values()
                            for k in ((f.rank,) if f.rank is not None else f.details.get("candidates", f.details.get("ranks", ())))))


class Agreement(Check):
    """Majority vote over fingerprints at probed steps, one finding per fault (module docstring)."""

    #: the RoundResult attributes compared: fingerprints uint64 [R, P] and which exist, bool [R, P]
    fingerprints: tuple[str, str] = ("fp_grad", "fp_grad_seen")
    what = "gradients"

    per_job = AgreementState

    def _too_small(self, job, st: AgreementState, fp) -> Optional[Evaluation]:
        """A round too small to judge (no fingerprints, or fewer than two of a parameter): None
        while its findings stand (the norm path speaks for the check, or a burst of probes on the
        one rank whose own norm spiked made a round of one, and the ranks the findings are about
        are live: no_data would drop them and the next full round raise the same fault again),
        else no data, and the findings go with it."""
        if st.norms_judged or (st.judged and fp is not None and _named_live(job, st)):
            return None
        st.active.clear(), st.last_bad.clear()  # no data: the runner drops the findings too
        return Evaluation.no_data()

    def on_round(self, job, r):
        fp, seen = getattr(r, self.fingerprints[0]), getattr(r, self.fingerprints[1])
        st = self.state(job.job)
        if fp is None or len(r.ranks) < 2 or seen.sum(axis=0).max(initial=0) < 2:
            return self._too_small(job, st, fp)
        st.judged = True
        bad, tied = minority(fp, seen, getattr(r, "holders", None))
        found = self._findings(job.job, r.step, r.ranks, r.params, bad, tied, "fingerprints")
        return self._judged(st, r.step, found)

    def _findings(self, job_id: str, step: int, ranks, params, bad: dict, tied: list, evidence: str,
                  values=None) -> list[Finding]:
        """One finding per rank in the minority, and one for the parameters without a majority."""
        out = []
        for k, ps in sorted(bad.items()):
            names = [params[p] for p in ps]
            extra = values(k, ps[0]) if values is not None else {}
            norm = (f": norm {extra['grad_norm']:.7g}, majority {extra['majority_grad_norm']:.7g}"
                    if "grad_norm" in extra else "")
            out.append(Finding(
                self.name, job_id, step,
                f"rank {ranks[k]}'s {self.what} differ from the majority of ranks in {len(ps)} parameter(s), "
                f"first {names[0]}{norm} (step {step}, {evidence})",
                rank=ranks[k],
                details={"params": names[:50], "n_params": len(ps), "ranks": list(ranks), "evidence": [evidence],
                         "last_step": step, **extra},
            ))
        if tied:
            names = [params[p] for p in tied]
            out.append(Finding(
                self.name, job_id, step,
                f"ranks disagree on the {self.what} of {len(tied)} parameter(s) with no majority, first {names[0]} "
                f"(step {step}, {evidence}; with 2 ranks the faulty one cannot be told apart)",
                details={"params": names[:50], "n_params": len(tied), "ranks": list(ranks), "evidence": [evidence],
                         "last_step": step},
            ))
        return out

    @staticmethod
    def _judged(st: AgreementState, step: int, found: list[Finding]) -> Evaluation:
        """Fold one judged step's findings into the job's active ones; a finding not seen again at
        a later step resolves."""
        for f in found:
            old = st.active.get(f.key)
            if old is None:
                st.active[f.key] = f
            else:  # the same fault seen again: evidence for the finding already raised
                ev = sorted(set(old.details.get("evidence", [])) | set(f.details["evidence"]))
                st.active[f.key] = replace(old, details={**old.details, "evidence": ev,
                                                         "last_step": max(old.details.get("last_step", old.step), step)})
            st.last_bad[f.key] = max(st.last_bad.get(f.key, step), step)
        keys = {f.key for f in found}
        for key in [k for k in st.active if k not in keys and st.last_bad[k] < step]:
            del st.active[key], st.last_bad[key]
        return Evaluation.found(*st.active.values())
