"""Non-finite provenance: where NaN or Inf first appeared — step, rank, module and pass.

Step and rank, from every step's records (evaluated once per step, see :mod:`..steps`). The event
is the first step where a rank's gradient held NaN/Inf: ``grad_nonfinite > 0`` or an infinite
``grad_norm`` (a NaN ``grad_norm`` with no non-finite parameter means the step had no gradients),
or a rank's local gradient norm (before all-reduce, from the DDP communication hook) is
non-finite. After all-reduce every rank's gradient is non-finite, so only the local norms tell the
*origin* rank(s): those whose local norm was non-finite. A NaN local norm also means "unknown"
(no communication hook), so a rank's NaN counts only once the rank has reported a finite local
norm before. A non-finite local norm counts only when the rank's all-reduced gradient is
non-finite too (a NaN or Inf spreads through the all-reduce): otherwise the norm was not measured,
or its float32 sum of squares overflowed on finite gradients (a loss scale grown past ~2^60).
Local norms all finite but the all-reduced one not: the reduction itself overflowed (or a
compressing communication hook did); no rank is named.

Module and pass, from probed steps at or after the event, on the origin rank, in the order the
values are computed:

1. ``activation``: the first module in forward order whose output held NaN/Inf;
2. ``output_gradient``: else the *last* module in forward order whose output gradient did (the
   first one backward reaches);
3. ``parameter_gradient``: else the last module whose parameters' gradient did (after
   all-reduce, so not rank-specific);
4. ``weight``: else the first module whose weights after the optimizer step did.

At an event step that was not probed, a rank whose agent runs the NaN guard (wire
``nonfinite_slot``: every step, the first slot whose output went non-finite) tells where a NaN or
Inf was made in the forward pass: that slot's module is named, pass ``activation`` (``from:
guard``), the origin rank's first, else the lowest rank's, unless the gradient norms below locate
a backward NaN (gradients that stayed finite prove the loss's forward pass finite). The every-step
per-parameter gradient norms (wire
``grad_norms``, sent by ranks with replicas) can still tell where a NaN came in through the
backward pass: it makes non-finite the gradient of the module it entered and of every module
before it in forward order, and leaves those after it finite. So when the parameters whose norm
went non-finite (finite at the step before) are exactly those, among the ones that had a finite
norm, of the modules up to some module in forward order, and some stay finite, that module is
named, pass ``parameter_gradient`` (``from: grad_norms``). Forward order is the schema's slots'
(the order the probed steps saw the modules run); a parameter whose module is not a slot is left
out of the test. A schema without slots falls back to registration order, which DDP also takes
for the reverse of the order gradients arrive. A NaN made in the forward pass leaves no finite
gradient and is not located this way; nor is one whose non-finite set is not such a prefix (two
parallel branches, say): no module rather than a wrong one.

A probed step *after* the event whose weights are already non-finite cannot locate it: the
optimizer has applied the non-finite gradient, so every forward pass is non-finite from the first
module using those weights on. The finding then says so, with pass ``weight`` and no module. With
the agent's defaults the event step is probed when it falls on the cadence (``every``); otherwise
the agent's burst probes the following steps, which with an optimizer like AdamW already see
non-finite weights.

Lifetime: one finding per job, raised once with everything known (keyed by the origin rank and the
module), and kept active for the job's life — a NaN run does not heal, and a finding that
resolved and re-raised would only repeat itself. To raise with the module, the finding waits for
the probed step of the event (when that step was probed) or for the next probed step, at most
``HOLD_STEPS`` steps or ``HOLD_S`` seconds of the aggregator's clock; then it is raised with what
is known. Values that are NaN or Inf travel in the finding's details as strings (case C36).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from gradwatch import columns

from . import Check, Evaluation, Finding, register
from .view import owner

PASSES = ("activation", "output_gradient", "parameter_gradient", "weight")
#: steps past the event the finding waits for a probed step to locate the module
HOLD_STEPS = 16
#: seconds (aggregator clock) the finding waits for a probed step to locate the module
HOLD_S = 5.0

_ACT, _GRAD, _PARAM = columns.at("act"), columns.at("act_grad"), columns.at("param")


@dataclass
class _Job:
    known_local: set = field(default_factory=set)  # ranks that reported a finite local norm
    rounds: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8))
    event: Optional[dict] = None
    event_seen: Optional[float] = None  # aggregator clock at the first tick after the event
    prev_norms: Optional[dict] = None  # the latest step's per-parameter norms before the event (StepView.norms)
    last_step: int = -1
    finding: Optional[Finding] = None
    evaluated: bool = False


@dataclass(frozen=True)
class _Clean:
    """A probed step without a non-finite value anywhere (see :func:`_may_locate`)."""

    step: int


def _may_locate(r) -> bool:
    """Whether :meth:`NonFinite._locate` can find anything in round ``r``: any of the conditions
    it searches holds somewhere (a non-finite weight norm, or a positive non-finite count)."""
    return bool((~np.isfinite(r.module[:, :, _PARAM.weight_norm])).any() or (r.act[:, :, _ACT.nonfinite] > 0).any()
                or (r.act_grad[:, :, _GRAD.nonfinite] > 0).any() or (r.module[:, :, _PARAM.grad_nonfinite] > 0).any())




def forward_positions(s) -> np.ndarray:
    """int64 [n_params]: each parameter's module's position in forward order (its first slot in
    ``s.slots``), -1 for a parameter whose module is not a slot (e.g. one of the root module).
    Not cached: it is read once per job, at the non-finite event."""
    first: dict[str, int] = {}
    for i, slot in enumerate(s.slots):
        first.setdefault(slot[0], i)
    return np.array([first.get(owner(p[0]), -1) for p in s.params], np.int64)


def _entry(went: np.ndarray, had: np.ndarray, pos: np.ndarray) -> Optional[int]:
    """The index of the parameter a backward NaN came in at, or None: its module is the last in
    forward order (``pos``; -1: left out) among those whose norm went non-finite, and exactly the
    parameters that had a finite norm, of modules up to it, went (module docstring)."""
    known = had & (pos >= 0)
    if not (went & known).any():
        return None
    last = int(pos[went & known].max())
    if not np.array_equal(went[known], pos[known] <= last):
        return None
    return int(np.flatnonzero(went & (pos == last))[-1])


def _ranks_in_order(origin: list, per_rank: dict) -> list:
    """The ranks of ``per_rank`` whose record tells where a NaN came from: the origin ranks first
    (in their order), then every rank in rank order."""
    return [*(r for r in origin if r in per_rank), *sorted(per_rank)]


def guarded(schemas: dict, guard: dict, origin: list) -> Optional[dict]:
    """Where the NaN guard saw a forward NaN at a step (``rank -> (schema hash, slot)``,
    :attr:`StepView.guard`), or None: the first origin rank's report, else the lowest rank's,
    whose schema is known and lists the slot.

    Returns:
        ``{"module", "output", "slot", "rank"}``: the slot's module path and output path.
    """
    for rank in _ranks_in_order(origin, guard):
        h, slot = guard[rank]
        s = schemas.get(h)
        if s is not None and 0 <= slot < len(s.slots):
            return {"module": s.slots[slot][0], "output": s.slots[slot][1], "slot": slot, "rank": rank}
    return None


def boundary(schemas: dict, before: Optional[dict], now: dict, origin: list) -> Optional[dict]:
    """Where a NaN came in through the backward pass, from two consecutive steps' per-parameter
    gradient norms (``rank -> (schema hash, float32 [n_params])``, :attr:`StepView.norms`; NaN
    where a parameter had no gradient), or None (module docstring). One rank's norms tell: the
    first origin rank's, else the lowest rank's whose norms of both steps share a known schema.

    Returns:
        ``{"module", "param", "rank", "went_nonfinite", "stayed_finite"}``: the module and name of
        the parameter the NaN came in at (the last, in registration order, of the module last in
        forward order whose norm went non-finite), and the counts of parameters with a finite
        norm before whose norm went non-finite or stayed finite.
    """
    if not before or not now:
        return None
    for rank in _ranks_in_order(origin, now):
        h, row = now[rank]
        prev = before.get(rank)
        s = schemas.get(h)
        if prev is None or prev[0] != h or s is None or len(row) != len(s.params) or len(prev[1]) != len(row):
            continue
        had = np.isfinite(prev[1])
        went = had & ~np.isfinite(row)
        stayed = int((had & ~went).sum())
        if not went.any() or not stayed:
            return None  # nothing went non-finite, or everything did: a forward NaN
        pos = forward_positions(s) if s.slots else np.arange(len(row))  # no slots: registration order
        at = _entry(went, had, pos)
        if at is None:
            return None
        name = s.params[at][0]
        return {"module": owner(name), "param": name, "rank": rank, "went_nonfinite": int(went.sum()),
                "stayed_finite": stayed}
    return None


@register
class NonFinite(Check):
    name = "nonfinite"
    severity = "critical"
    description = (
        "Finds where NaN/Inf first appeared: the first step with a non-finite gradient, the origin rank "
        "(the one whose local gradient norm before all-reduce was non-finite) and, from the probed steps, "
        "the first module in forward order and the pass (forward activation, output gradient, parameter "
        "gradient, weight); at an unprobed step, the module whose output the agent's NaN guard saw go "
        "non-finite in the forward pass, or the module a NaN came in at through the backward pass, "
        "from every step's per-parameter gradient norms. One finding per job, kept active."
    )
    dashboard = "gradient_flow"

    per_job = _Job

    # --- events ---------------------------------------------------------------------------------

    def on_steps(self, job, views):
        st = self.state(job.job)
        self._released(st, views, job.world, job.schemas)
        self._maybe_raise(job.job, st, None)
        return self._evaluation(st)

    def on_round(self, job, r):
        st = self.state(job.job)
        # a round in which _locate can find nothing is kept as its step alone: 8 whole rounds of a
        # 16,384-rank job held 2 GB
        st.rounds.append(r if _may_locate(r) else _Clean(r.step))
        if st.event is None or st.finding is not None:
            return None
        return self._evaluation(st) if self._maybe_raise(job.job, st, None) else None

    def on_tick(self, job, now):
        st = self.kept(job.job)
        if st is None:
            return None
        if st.event is not None and st.event_seen is None:
            st.event_seen = now
        raised = self._maybe_raise(job.job, st, now)
        return self._evaluation(st) if raised else None

    # --- the event ------------------------------------------------------------------------------

    def _released(self, st: _Job, views, world: int, schemas: dict) -> None:
        for v in views:
            st.evaluated = True
            st.last_step = max(st.last_step, v.step)
            if st.event is None:
                st.event = self._detect(st, v, world)
                if st.event is None:
                    st.prev_norms = v.norms or st.prev_norms  # a reference: nothing computed per step
                elif not st.event["probed"]:
                    st.event["guard"] = guarded(schemas, v.guard, st.event["origin_ranks"])
                    st.event["boundary"] = boundary(schemas, st.prev_norms, v.norms, st.event["origin_ranks"])
            st.known_local.update(v.ranks[np.isfinite(v.local_grad_norm)].tolist())

    def _detect(self, st: _Job, v, world: int) -> Optional[dict]:
        """The event at released step ``v`` (a :class:`~..steps.StepView`), if its gradients are
        non-finite anywhere (module docstring)."""
        bad = (v.grad_nonfinite > 0) | np.isinf(v.grad_norm)
        if not bad.any() and not np.isinf(v.local_grad_norm).any() and not np.isnan(v.local_grad_norm).any():
            return None  # the usual step: nothing to look at
        ranks = v.ranks.tolist()
        has_grad = ~(np.isnan(v.grad_norm) & (v.grad_nonfinite == 0))
        known = np.fromiter((k in st.known_local for k in ranks), bool, len(ranks))
        local = v.local_grad_norm
        # a NaN or Inf spreads through the all-reduce: with the rank's all-reduced gradient finite,
        # its NaN local norm was not measured (its communication hook switched off after errors),
        # and its Inf one overflowed while finite gradients were measured (float32 sums of squares
        # past 3.4e38: a GradScaler's scale grown past ~2^60 on gradients that never overflow,
        # bf16 autocast), no fault
        spread = ~np.isfinite(v.grad_norm) | (v.grad_nonfinite > 0)
        local_bad = (np.isinf(local) | (np.isnan(local) & known & has_grad)) & spread
        bad_grad = [k for k, b in zip(ranks, bad) if b]
        origin = [k for k, b in zip(ranks, local_bad) if b]
        if not bad_grad and not origin:
            return None
        if origin:
            where = "local"
        elif np.isfinite(local).all():
            where = "all-reduce"
        elif world == 1:
            where, origin = "local", bad_grad
        else:
            where = "unknown"
        return {
            "step": v.step,
            "origin_ranks": origin,
            "where": where,
            "probed": bool(v.probe.any()),
            "ranks_reporting": ranks,
            "local_grad_norms": dict(zip(ranks, local.tolist())),
            "grad_norms": dict(zip(ranks, v.grad_norm.tolist())),
            "grad_nonfinite_params": dict(zip(ranks, (int(x) for x in v.grad_nonfinite))),
        }

    # --- locating the module --------------------------------------------------------------------

    def _maybe_raise(self, job_id: str, st: _Job, now: Optional[float]) -> bool:
        ev = st.event
        if ev is None or st.finding is not None:
            return False
        loc = self._locate_in(st)
        expired = st.last_step >= ev["step"] + HOLD_STEPS or (
            now is not None and st.event_seen is not None and now - st.event_seen >= HOLD_S
        )
        if loc is None and not expired:
            return False
        st.finding = self._finding(job_id, ev, loc)
        return True

    def _locate_in(self, st: _Job) -> Optional[dict]:
        ev = st.event
        b = ev.get("boundary")
        if b is not None:  # the unprobed event's own gradients tell: no probe after it can
            # (first: gradients that stayed finite prove the loss's forward pass finite, so a
            # non-finite output the guard saw was off that path)
            return {"module": b["module"], "pass": "parameter_gradient", "located": True, "probed_step": None,
                    "from": "grad_norms", "rank": b["rank"], "values": b}
        g = ev.get("guard")
        if g is not None:  # the unprobed event's own forward pass, seen by the NaN guard
            return {"module": g["module"], "pass": "activation", "located": True, "probed_step": None,
                    "from": "guard", "rank": g["rank"], "values": g}
        rounds = sorted((r for r in st.rounds if r.step >= ev["step"]), key=lambda r: r.step)
        if ev["probed"] and not any(r.step == ev["step"] for r in rounds):
            return None  # the event step's own probe is on its way: it is the one that can tell
        for r in rounds:
            loc = self._locate(r, ev["step"], ev["origin_ranks"])
            if loc is not None:
                return loc
        return None

    def _locate(self, r, event_step: int, origin: list[int]) -> Optional[dict]:
        if isinstance(r, _Clean):
            return None
        if r.step > event_step:
            w = ~np.isfinite(r.module[:, :, _PARAM.weight_norm])
            if w.any():
                first = int(np.flatnonzero(w.any(axis=0))[0])
                return {
                    "module": None, "pass": "weight", "located": False, "probed_step": r.step,
                    "first_nonfinite_weight_module": r.modules[first],
                }
        if origin:
            ks = [r.ranks.index(o) for o in origin if o in r.ranks]
            if not ks:
                return None  # the origin rank's report is missing from this round
        else:
            ks = list(range(len(r.ranks)))
        searches = (
            ("activation", r.act[:, :, _ACT.nonfinite] > 0, r.layers, min),
            ("output_gradient", r.act_grad[:, :, _GRAD.nonfinite] > 0, r.layers, max),
            ("parameter_gradient", r.module[:, :, _PARAM.grad_nonfinite] > 0, r.modules, max),
            ("weight", ~np.isfinite(r.module[:, :, _PARAM.weight_norm]), r.modules, min),
        )
        for pass_, bad, names, pick in searches:
            hits = [(int(i), k) for k in ks for i in np.flatnonzero(bad[k])]
            if not hits:
                continue
            i, k = pick(hits, key=lambda h: (h[0], -h[1]) if pick is max else h)
            values = self._values(r, pass_, k, i)
            return {
                "module": names[i], "pass": pass_, "located": True, "probed_step": r.step,
                "rank": r.ranks[k], "values": values,
                "modules_nonfinite": int(bad[k].sum()),
            }
        return None

    @staticmethod
    def _values(r, pass_: str, k: int, i: int) -> dict:
        if pass_ == "activation":
            a = r.act[k, i].tolist()
            return {"nonfinite_elements": a[_ACT.nonfinite], "mean": a[_ACT.mean], "std": a[_ACT.std],
                    "min": a[_ACT.min], "max": a[_ACT.max]}
        if pass_ == "output_gradient":
            g = r.act_grad[k, i].tolist()
            return {"nonfinite_elements": g[_GRAD.nonfinite], "norm": g[_GRAD.norm]}
        p = r.module[k, i].tolist()
        return {"grad_norm": p[_PARAM.grad_norm], "weight_norm": p[_PARAM.weight_norm],
                "grad_nonfinite_elements": p[_PARAM.grad_nonfinite]}

    # --- the finding ----------------------------------------------------------------------------

    def _finding(self, job_id: str, ev: dict, loc: Optional[dict]) -> Finding:
        step, origin = ev["step"], ev["origin_ranks"]
        rank = origin[0] if origin else None
        if rank is None and loc and loc.get("located") and loc["pass"] in ("activation", "output_gradient"):
            rank = loc["rank"]  # activations and output gradients are the rank's own, before all-reduce
        if origin:
            v = ev["local_grad_norms"][origin[0]]
            who = (
                f"on rank{'s' if len(origin) > 1 else ''} {', '.join(map(str, origin))} "
                f"(local gradient norm {v} before all-reduce)"
            )
        elif ev["where"] == "all-reduce":
            who = "in the all-reduce (every rank's local gradient norm was finite)"
        elif rank is not None:
            seen = "its NaN guard" if loc and loc.get("from") == "guard" else "its probe"
            who = f"on rank {rank} (seen in {seen}; no local gradient norms)"
        else:
            who = "on an unknown rank (no local gradient norms)"
        summary = f"first non-finite gradient at step {step} {who}"
        layer = None
        if loc is None:
            summary += "; not located: no probed step at or after it arrived"
            details = {"module": None, "pass": None, "located": False}
        elif not loc["located"]:
            summary += (
                f"; cannot be located: at probed step {loc['probed_step']} the weights were already "
                f"non-finite (first {loc['first_nonfinite_weight_module']}), the optimizer had applied it"
            )
            details = dict(loc)
        else:
            layer = loc["module"]
            what = loc["pass"].replace("_", " ")
            if loc.get("from") == "guard":
                out = loc["values"]["output"]
                summary += (f"; it was made in the forward pass: the output{' ' + out if out else ''} of {layer} was the "
                            "first to hold NaN/Inf (the agent's NaN guard)")
            elif loc.get("from") == "grad_norms":
                b = loc["values"]
                summary += (f"; it came in through the backward pass at {layer}: the gradients of {b['param']} "
                            f"and the {b['went_nonfinite'] - 1} parameters before it went non-finite, the "
                            f"{b['stayed_finite']} after it stayed finite")
            else:
                summary += f"; first seen in the {what} of {layer} at probed step {loc['probed_step']}"
            details = dict(loc)
        details = dict(ev, **details)
        return Finding(self.name, job_id, step, summary, rank=rank, layer=layer, details=details)

    def _evaluation(self, st: _Job) -> Optional[Evaluation]:
        if st.finding is not None:
            return Evaluation.found(st.finding)
        if not st.evaluated or st.event is not None:
            return None  # nothing evaluated yet, or an event waiting to be located
        return Evaluation.healthy()
