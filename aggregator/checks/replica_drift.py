"""Replicas must stay identical: each parameter's weights after the optimizer step, bit for bit.

Three or more holders of the same bytes name the rank in the minority (:mod:`._fingerprints`). Two
holders that disagree (two tensor-parallel ranks holding a ``Replicate`` LayerNorm weight, two
replicas of an HSDP shard) have no majority; the tie is broken by each rank's own history of the
parameter's weight norm (``RoundResult.own_param``, float32 on the wire), which the two ranks shared
while their fingerprints agreed:

* ``w0``: the norm both held at the previous probed step (they agreed there: equal bytes, equal
  norms), ``m``: how far it moved between the probed step before that and the previous one (the
  optimizer's typical move over one probe interval; both agreed at both steps);
* ``d_a = |w_a - w0|``, ``d_b = |w_b - w0|``: how far each rank's norm moved since.

The healthy rank moves by the optimizer's update, as it did before; a rank whose bytes were
corrupted also jumps. Rank ``a`` is named when ``d_a > drift_tie_ratio * max(d_b, m, floor)``
(``drift_tie_ratio`` 2 by default) with ``floor = 1e-6 * |w0|`` (ten times float32's resolution of
a norm): it moved more than twice both its peer's move and the parameter's previous move. Naming
the healthy rank would take its norm moving more than twice as far as in the previous interval
while the corrupted one's moved less than half as far (a flip cancelling the update). In
tests/test_sharded.py healthy ranks move 0.6-1.3 times the previous move; a zeroed element of a
4-element LayerNorm weight moves its norm 2.7 times as far. Over the
parameters the pair disagrees on, ``a`` is named when at least one is decisive for ``a`` and none
for ``b``; otherwise (a flip that barely changes the norm — a low mantissa bit, a sign — no
history, both jumping) the finding names no rank and lists both as ``candidates``. A verdict
stands while the pair keeps disagreeing (later probes mix in updates computed from the diverged
weights): one fault, one finding.

Drift found while ``grad_agreement`` has a finding of the job active, or resolved within
``knock_on_window_s`` (a gradient altered after all-reduce: the optimizer applied it to one
replica, whose weights differ from then on), is that fault's knock-on (``knock_on_of``): the
runner folds it into the gradient finding (``details["knock_on"]``), which stays active while the
replicas still differ, instead of raising it. Drift with no such cause (a bit flip in the weights,
a missed broadcast) is raised as always; this check's status says ``finding`` either way.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

import numpy as np
from pydantic import Field

from gradwatch import columns

from . import Check, Finding, register
from ._fingerprints import Agreement, AgreementState, minority

_WEIGHT = columns.at("param").weight_norm
_FLOOR = 1e-6  # of |w0|: ten times float32's relative resolution, below which norms do not differ


def _pairs(fp: np.ndarray, seen: np.ndarray, holders, p: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Rank indices of a tied column ``p``: pairs of exactly two holders that disagree, and the
    ranks of larger ties (no tie-break)."""
    rows = np.flatnonzero(seen[:, p])
    h = holders[rows, p] if holders is not None else np.zeros(len(rows), np.int64)
    pairs, others = [], []
    for g in np.unique(h):
        members = rows[h == g]
        counts = collections.Counter(fp[members, p].tolist()).most_common()
        if len(counts) < 2 or counts[0][1] != counts[1][1]:
            continue  # agrees, or a strict majority (named by minority())
        if len(members) == 2:
            pairs.append((int(members[0]), int(members[1])))
        else:
            others.extend(int(k) for k in members)
    return pairs, others


class _Index:
    """``{item: its position}`` of a tuple (a round's ranks or parameter names), built on the
    first lookup: only a tie between two holders looks anything up."""

    __slots__ = ("items", "_pos")

    def __init__(self, items: tuple):
        self.items, self._pos = items, None

    def get(self, key):
        if self._pos is None:
            self._pos = {k: i for i, k in enumerate(self.items)}
        return self._pos.get(key)


@dataclass
class _Drift(AgreementState):
    #: the two latest rounds' (step, ranks, params, weight norms, agreed mask)
    hist: collections.deque = field(default_factory=lambda: collections.deque(maxlen=2))
    #: (rank, rank) pair -> the rank named for its disagreement (None: undecided)
    verdict: dict = field(default_factory=dict)


def _weights(r):
    """float64 [n_ranks, n_params]: each rank's own weight norm of each parameter, or None."""
    own = getattr(r, "own_param", None)
    return None if own is None else own[..., _WEIGHT]


@register
class ReplicaDrift(Agreement):
    name = "replica_drift"
    severity = "critical"
    description = (
        "Compares each parameter's weight fingerprint across ranks after the optimizer step at every "
        "probed step (Megatron-LM does this with SHA-1 on the CPU every 20,000 iterations). Names the "
        "replica that drifted from the majority and its parameters (silent data corruption, a "
        "non-deterministic optimizer, a missed broadcast); between two holders, the one whose weight norm "
        "jumped beyond drift_tie_ratio times the other's and its own previous move."
    )
    dashboard = "consistency"
    fingerprints = ("fp_weight", "fp_weight_seen")
    what = "weights"
    knock_on_of = ("grad_agreement",)  # a desynced gradient leaves the weights it updated different

    class Thresholds(Check.Thresholds):
        drift_tie_ratio: float = Field(2.0, gt=1, description="Two holders that disagree: a rank is named when its weight norm moved more than this many times both the other holder's move and the parameter's move over the previous probe interval.")

    per_job = _Drift

    def on_round(self, job, r):
        fp, seen = r.fp_weight, r.fp_weight_seen
        st = self.state(job.job)
        if fp is None or len(r.ranks) < 2 or seen.sum(axis=0).max(initial=0) < 2:
            return self._too_small(job, st, fp)
        st.judged = True
        holders = getattr(r, "holders", None)
        bad, tied = minority(fp, seen, holders)
        findings = self._findings(job.job, r.step, r.ranks, r.params, bad, [], "fingerprints")
        hist, verdicts = st.hist, st.verdict
        by_pair: dict[tuple[int, int], list[int]] = {}
        loose: set[int] = set()  # ranks of ties of three or more holders: candidates only
        loose_params: list[int] = []
        for p in tied:
            pairs, others = _pairs(fp, seen, holders, p)
            for ab in pairs:
                by_pair.setdefault((r.ranks[ab[0]], r.ranks[ab[1]]), []).append(p)
            if others:
                loose.update(r.ranks[k] for k in others)
                loose_params.append(p)
        for ab in [ab for ab in verdicts if ab not in by_pair]:
            del verdicts[ab]  # the pair agrees again
        undecided: dict[tuple[int, int], list[int]] = {}
        why: dict[str, dict] = {}
        for (a, b), ps in by_pair.items():
            if (a, b) not in verdicts:
                verdicts[(a, b)], evidence = self._decide(r, hist, a, b, ps)
            else:
                evidence = None
            named = verdicts[(a, b)]
            if named is None:
                undecided[(a, b)] = ps
                if evidence:
                    why[f"{a},{b}"] = evidence
                continue
            names = [r.params[p] for p in ps]
            findings.append(Finding(
                self.name, job.job, r.step,
                f"ranks {a} and {b} disagree on the weights of {len(ps)} parameter(s), first {names[0]}; rank "
                f"{named}'s weight norm jumped, the other's moved as the optimizer moves it (step {r.step})",
                rank=named,
                details={"params": names[:50], "n_params": len(ps), "ranks": list(r.ranks), "candidates": [a, b],
                         "evidence": ["fingerprints", "weight norms"], "last_step": r.step,
                         **({"norms": evidence} if evidence else {})},
            ))
        ps = sorted({p for v in undecided.values() for p in v} | set(loose_params))
        if ps:
            names = [r.params[p] for p in ps]
            candidates = sorted(loose | {k for ab in undecided for k in ab})
            findings.append(Finding(
                self.name, job.job, r.step,
                f"ranks disagree on the weights of {len(ps)} parameter(s) with no majority, first {names[0]} "
                f"(step {r.step}; candidates {candidates}: their weight norms do not tell the faulty one apart)",
                details={"params": names[:50], "n_params": len(ps), "ranks": list(r.ranks), "candidates": candidates,
                         "evidence": ["fingerprints"], "last_step": r.step, **({"norms": why} if why else {})},
            ))
        ok = seen  # agreed with every holder of the same bytes: a baseline for later ties
        if bad or tied:
            ok = seen.copy()
            for k, v in bad.items():
                ok[k, v] = False
            ok[:, tied] = False
        hist.append((r.step, _Index(r.ranks), _Index(r.params), _weights(r), ok))
        return self._judged(st, r.step, findings)

    def _decide(self, r, hist, a: int, b: int, ps: list[int]) -> tuple[int | None, dict]:
        """The rank of pair ``(a, b)`` whose weight norm jumped on tied columns ``ps`` (module
        docstring), or None; and the evidence per parameter name."""
        weight = _weights(r)
        if weight is None or len(hist) < 2:
            return None, {"history": f"{len(hist)} earlier probed step(s), 2 needed"}
        ka, kb = r.ranks.index(a), r.ranks.index(b)
        decisive = set()
        evidence = {}
        for p in ps:
            name = r.params[p]
            base, steps = [], []
            for step, ranks, params, before, ok in hist:  # older first
                i, j, q = ranks.get(a), ranks.get(b), params.get(name)
                if before is None or None in (i, j, q) or not (ok[i, q] and ok[j, q]):
                    break
                base.append(float(before[i, q]))
                steps.append(step)
            if len(base) < 2:
                evidence[name] = {"history": "the pair did not agree at the two previous probed steps"}
                continue
            w_prev, w0 = base
            da, db = abs(float(weight[ka, p]) - w0), abs(float(weight[kb, p]) - w0)
            m = abs(w0 - w_prev)
            floor = _FLOOR * abs(w0)
            if not (math.isfinite(da) and math.isfinite(db)):
                continue
            evidence[name] = {"moved": {str(a): da, str(b): db}, "previous_move": m, "steps": steps}
            for who, mine, theirs in ((a, da, db), (b, db, da)):
                if mine > self.t.drift_tie_ratio * max(theirs, m, floor):
                    decisive.add(who)
        return (decisive.pop() if len(decisive) == 1 else None), evidence
