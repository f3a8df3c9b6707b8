"""The step report: from a step's frame on the host to a :class:`gradwatch.wire.Report` (sender thread).

The training thread only launches kernels and records what it knows without the device: a
:class:`StepLayout`. The sender thread, once the frame's copy has landed, calls :func:`build`:
it unpacks the frame (:mod:`.frame`), takes square roots and sums, combines the per-call
moments records of each slot and divides what was measured on scaled gradients by the loss
scale. A pure function of its inputs, so it runs and is tested without a model.
"""

from __future__ import annotations

import math
from typing import Optional

import msgspec
import numpy as np

from gradwatch import columns, wire

from . import frame
from .stats import SPLIT_MAX, combine_chunks, combine_moments


class StepLayout(msgspec.Struct, frozen=True):
    """What the training thread knows of a step without reading the device.

    A frozen msgspec Struct rather than a frozen dataclass: the sender thread makes one per step,
    and a frozen dataclass of 23 fields costs several microseconds to construct.

    Attributes:
        step: optimizer steps completed before this one.
        step_time: seconds from the previous step's end to this one's.
        compute_time: the rank's own time in the step, seconds: from the previous step's end to
            this step's first DDP bucket, plus from the end of its backward pass (DDP's wait for
            the all-reduce included) to this step's end, where that end was timed (CPU buckets) (NaN without a
            communication hook).
        waits: ``(start, end)`` or ``(start, end, start, end)``, the schedstat readings
            (:class:`.measure.RunQueueWait`) of the training thread (and of the thread that ran
            the communication hook, when another) at the previous step's end and at this step's
            first bucket, then at the end of backward and at this step's end, for the wire's
            ``compute_wait`` (:func:`waited_s`); () when unknown.
        skipped: steps the loss scaler skipped since the previous report.
        nonfinite_skipped: 1 when the agent's breaker took this step's gradients away (not finite).
        schema: hash of the schema the report refers to.
        present: indices (into the model's parameters) of the parameters that had a gradient, in
            the order of the frame's ``grad_norm``, ``grad_nonfinite`` and ``grad_fp`` sections.
        counts: items per frame section, from :func:`frame.pack`.
        rows: chunks of each present parameter's gradient in the ``grad_norm`` section
            (:func:`.stats.chunk_norms`); empty: one value each.
        split: the ``split`` of that section's layout (:func:`.stats.chunk_norms`).
        unscaled: the step's DDP buckets and output gradients were divided by the loss scale
            already (:class:`.amp.Unscale`, a huge scale), so ``bucket_norm`` and ``out_grad`` are
            not divided again.
        probe: a probed step; the fields below only matter then.
        burst: probed because of a burst rather than the cadence.
        batch: samples seen in the step (0 when unknown).
        micro: forward passes with gradients in the step.
        n_params: parameters of the model.
        n_slots: activation slots known so far.
        act: ``(slot, numel)`` of each record in the ``act`` section.
        grad: slot of each record in the ``out_grad`` section.
        calls: ``(slot, calls, elements)`` of each slot whose module ran in the step.
        agent_cost: the agent's measured average cost over the training step time (NaN until measured).
        probe_interval: probe interval in use, steps.
        over_budget: the budget cannot be met even at the longest interval.
        shard_dims: per parameter (all of them, schema order), the mesh dims it is sharded along;
            empty without a mesh (DDP). With it, the report carries ``grad_sq``.
        norms: the report carries each parameter's gradient norm (wire ``grad_norms``), every
            step: the rank has replicas the aggregator compares them with.
        guard: the NaN guard's slot of each value in the frame's ``guard`` section, in call
            order; None when the guard did not run this step (off, or a probed step).
    """

    step: int
    step_time: float
    compute_time: float
    skipped: int
    schema: str
    present: tuple[int, ...]
    counts: dict = msgspec.field(default_factory=dict)
    rows: tuple[int, ...] = ()
    split: int = SPLIT_MAX
    unscaled: bool = False
    probe: bool = False
    burst: bool = False
    batch: int = 0
    micro: int = 0
    n_params: int = 0
    n_slots: int = 0
    act: tuple[tuple[int, int], ...] = ()
    grad: tuple[int, ...] = ()
    calls: tuple[tuple[int, int, int], ...] = ()
    agent_cost: float = math.nan
    waits: tuple[bytes, ...] = ()
    probe_interval: int = 0
    over_budget: bool = False
    shard_dims: tuple[tuple[int, ...], ...] = ()
    norms: bool = False
    guard: Optional[tuple[int, ...]] = None
    nonfinite_skipped: int = 0


def waited_s(*readings: bytes) -> float:
    """Seconds the threads waited for a CPU between :attr:`RunQueueWait.read` readings of the
    same threads, taken in pairs ``(start, end, start, end, ...)`` and summed over the intervals
    (run-queue wait, schedstat's second field of each thread, summed); NaN when any is unknown or
    unreadable, or the readings are not pairs. Parsed here, on the sender thread, not where it was
    read (:class:`.measure.RunQueueWait`)."""
    if not readings or len(readings) % 2:
        return math.nan
    total = 0
    try:
        for start, end in zip(readings[::2], readings[1::2]):
            a, b = start.split(), end.split()
            if not a or len(a) != len(b) or len(a) % 3:
                return math.nan
            total += sum(map(int, b[1::3])) - sum(map(int, a[1::3]))
    except ValueError:
        return math.nan
    return total * 1e-9


def grad_sq(sq: np.ndarray, present, shard_dims) -> tuple[tuple[tuple[int, ...], float], ...]:
    """Sums of squared local gradient elements per set of sharded-along mesh dims (wire
    ``grad_sq``), from ``sq`` float64 [len(present)], each present parameter's squared norm."""
    out: dict[tuple[int, ...], float] = {}
    for i, v in zip(present, sq):
        d = shard_dims[i]
        out[d] = out.get(d, 0.0) + float(v)
    for d in set(shard_dims):  # a class without a gradient this step still says 0
        out.setdefault(d, 0.0)
    return tuple(sorted(out.items()))


class GuardMemory:
    """The NaN guard's verdicts of one rank (wire ``nonfinite_slot``), made in step order on the
    sender thread: the first slot, in call order, whose output held NaN or Inf at a step while it
    held none at the rank's previous guarded step, -1 when no slot went non-finite. A slot that is
    non-finite at every step (an attention mask of -inf, say) is no news, and must not hide the
    module a NaN later comes from behind it in call order.

    Attributes:
        before: the slots that were non-finite at the previous guarded step.
    """

    def __init__(self):
        self.before: frozenset = frozenset()

    def verdict(self, slots: tuple[int, ...], sums: np.ndarray) -> int:
        """The verdict of one step: ``sums`` float64 [n], one per guarded output in call order,
        ``slots`` their slots (:class:`StepLayout` ``guard``); remembered for the next step."""
        now = [slots[i] for i in np.flatnonzero(~np.isfinite(sums)).tolist()]
        self.before, before = frozenset(now), self.before
        return next((int(k) for k in now if k not in before), -1)


def build(h: wire.Header, L: StepLayout, host: np.ndarray, drops: int, guard: Optional[GuardMemory] = None) -> wire.Report:
    """The wire report of one step.

    Args:
        h: header from the sender.
        L: the step's layout.
        host: float32 frame copied to the host (:func:`frame.pack`'s tensor as numpy).
        drops: reports the sender dropped so far.
        guard: the rank's :class:`GuardMemory` (a fresh one when None: no step before this one).

    Returns:
        A sentinel report (with ``L.norms`` and gradients, ``grad_norms`` float32 [n_params]: the
        sentinel's norms as measured, NaN where a parameter had no gradient; with ``L.guard``,
        ``nonfinite_slot``, :meth:`GuardMemory.verdict` of the frame's ``guard`` section), or with ``L.probe``
        a probe report whose ``param`` is float32
        [n_params, 3] (gradient norm, weight norm, non-finite count; NaN where a parameter had no
        gradient), ``act`` float32 [n_slots, 6] (NaN where no call output an element),
        ``act_grad`` float32 [n_slots, 2], ``act_count`` float32 [n_slots, 2] (calls, elements;
        NaN where the module did not run) and fingerprints uint64 [n_params] (0 where not measured).

    Raises:
        ValueError: ``host`` does not match ``L.counts``.
    """
    f = frame.unpack(host, L.counts)
    norms = combine_chunks(f["grad_norm"], L.rows, L.split) if L.rows else f["grad_norm"]
    sq = norms * norms
    has_grads = len(norms) > 0  # the sentinel sends bucket norms, losses and scale only with gradients
    grad_norm = math.sqrt(sq.sum()) if has_grads else math.nan  # NaN or Inf when a parameter's is
    grad_nonfinite = int((~np.isfinite(norms)).sum())
    local_norm = math.sqrt(float(np.square(f["bucket_norm"]).sum())) if len(f["bucket_norm"]) else math.nan
    loss = float(f["loss"].sum()) / len(f["loss"]) if len(f["loss"]) else math.nan  # np.mean's sum, without its overhead
    loss_scale = float(f["loss_scale"][0]) if len(f["loss_scale"]) else math.nan
    scaled = math.isfinite(loss_scale) and loss_scale > 0
    if scaled and not L.unscaled:
        # the comm hook and output tensor hooks saw gradients multiplied by the loss scale; the
        # optimizer pre-hook sees them unscaled (case C10)
        local_norm /= loss_scale
    grad_norms = None
    if L.norms and has_grads:
        grad_norms = np.full(L.n_params, np.nan, np.float32)
        grad_norms[np.asarray(L.present)] = norms
    common = dict(
        grad_sq=grad_sq(sq, L.present, L.shard_dims) if L.shard_dims else None, grad_norms=grad_norms,
        drops=drops, local_grad_norm=local_norm, compute_time=L.compute_time,
        compute_wait=waited_s(*L.waits) if L.waits else math.nan, loss=loss,
        loss_scale=loss_scale, skipped=L.skipped, nonfinite_skipped=L.nonfinite_skipped,
        agent_cost=L.agent_cost, probe_interval=L.probe_interval, over_budget=L.over_budget,
    )
    if not L.probe:
        slot = None
        if L.guard is not None and len(f["guard"]) == len(L.guard):
            slot = (guard if guard is not None else GuardMemory()).verdict(L.guard, f["guard"])
        return wire.Report(h, L.schema, L.step, L.step_time, grad_norm, grad_nonfinite, nonfinite_slot=slot, **common)
    P, A, G, C = (columns.at(a) for a in ("param", "act", "act_grad", "act_count"))
    param = np.full((L.n_params, len(P)), np.nan)
    fp_grad = np.zeros(L.n_params, np.uint64)
    fp_weight = np.zeros(L.n_params, np.uint64)
    if len(f["weight_norm"]):
        param[:, P.weight_norm] = f["weight_norm"]
    if len(f["weight_fp"]):
        fp_weight[:] = f["weight_fp"]
    if has_grads:
        idx = np.asarray(L.present)
        param[idx, P.grad_norm] = np.sqrt(sq)
        if len(f["grad_nonfinite"]) == len(idx):
            param[idx, P.grad_nonfinite] = f["grad_nonfinite"]
        if len(f["grad_fp"]):
            fp_grad[idx] = f["grad_fp"]
    act = np.full((L.n_slots, len(A)), np.nan)
    if L.act:
        recs = f["act"]
        slot_of = np.fromiter((i for i, _ in L.act), np.int64, len(L.act))
        numel = np.fromiter((n for _, n in L.act), np.int64, len(L.act))
        for s in np.unique(slot_of):
            sel = slot_of == s
            act[s] = combine_moments(numel[sel], recs[sel])
    act_count = np.full((L.n_slots, len(C)), np.nan)
    if L.calls:
        slots, calls, elements = zip(*L.calls)
        act_count[list(slots), C.calls] = calls
        act_count[list(slots), C.elements] = elements
    act_grad = np.full((L.n_slots, len(G)), np.nan)
    if L.grad:
        R = columns.record_at("act_grad")  # an output gradient's record: its sum of squares and non-finite count
        slot_of = np.asarray(L.grad, np.int64)
        sums = np.zeros((L.n_slots, len(R)))
        np.add.at(sums, slot_of, f["out_grad"])
        seen = np.unique(slot_of)
        act_grad[seen, G.norm] = np.sqrt(sums[seen, R.sumsq])
        if scaled and not L.unscaled:
            act_grad[seen, G.norm] /= loss_scale
        act_grad[seen, G.nonfinite] = sums[seen, R.nonfinite]
    return wire.Report(
        h, L.schema, L.step, L.step_time, grad_norm, grad_nonfinite,
        micro=L.micro, probe=True, batch=L.batch, burst=L.burst,
        act=act.astype(np.float32), act_grad=act_grad.astype(np.float32), param=param.astype(np.float32),
        act_count=act_count.astype(np.float32),
        fp_grad=fp_grad, fp_weight=fp_weight, **common,
    )
