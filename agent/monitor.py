"""The monitor: step boundaries, the every-step sentinel, probe scheduling, one copy per step.

Step boundary is the optimizer step (``register_step_pre_hook`` / ``register_step_post_hook``),
never a count of backward passes, so gradient accumulation under ``no_sync`` reports once per
optimizer step (case C13).

Every step (the *sentinel*), in the step pre-hook: per-parameter gradient norms with one
``torch._foreach_norm`` (float32 accumulation, case C10), their global L2 norm and the number of
parameters whose gradient is not finite; and the step's wall time. Every ``every``-th step (the
*probe*), leaf-module forward hooks and output tensor hooks record activation and output-gradient
moments (see :mod:`.hooks`); the pre-hook adds per-parameter non-finite counts and the post-hook
weight norms. Module hooks exist only while a probed step runs.

With DDP, a communication hook (installed only when the model has none, case C13) adds the rank's
gradient norm *before* all-reduce and the moment its first bucket is ready (the rank's own work,
without waiting for peers); on probes, a fingerprint of each gradient after all-reduce and of each
weight after the step lets the aggregator compare replicas bit for bit. When the sender thread sees
a non-finite or spiking gradient norm it asks for a *burst*: the next ``burst`` steps are probed
regardless of cadence (the request reaches the training thread a step or two later, never by a
host synchronisation).

At the end of each step all of that is concatenated into one flat device tensor and copied to the
host once, non-blocking; a CUDA event marks the copy. The sender thread waits on the event,
finalises (combines per-call records, takes square roots) and encodes. The training thread never
synchronises with the device and never sees an exception from the agent: failures are counted,
warned about once, and the failing part is switched off.
"""

from __future__ import annotations

import atexit
import collections
import logging
import math
import os
import secrets
import statistics
import threading
import time
import warnings
import weakref
from typing import Optional

import numpy as np
import torch

from gradwatch import wire

from .config import AgentConfig, job_key, resolve_identity
from .hooks import ProbeRecorder, leaf_modules, normalise
from .stats import Reducer, combine_moments, nonfinite_count
from .transport import Sender

log = logging.getLogger("gradwatch.agent")

_MONITORS: "weakref.WeakSet[Monitor]" = weakref.WeakSet()
_PART_ERRORS = 10  # a part of the agent failing this often is switched off, the rest goes on
_MAX_ERRORS = 1000  # every part together: the agent switches itself off
_PARTS = ("forward", "output-grad", "sentinel", "comm-hook")  # what can be switched off alone


def _disable_in_forked_child() -> None:
    # A DataLoader worker forked from a rank inherits the agent without its threads; it must
    # never touch the parent's sockets or locks (case C23).
    for m in list(_MONITORS):
        m._forked = True


os.register_at_fork(after_in_child=_disable_in_forked_child)


_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """int64 scalar: sum of ``t``'s elements reinterpreted as signed integers of their own width,
    wrapping modulo 2**64. Exact and independent of reduction order; on the device, no sync."""
    x = t.detach().reshape(-1)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    return torch.sum(x.view(_INT_OF_WIDTH[x.element_size()]), dtype=torch.int64)


def _on(dev: torch.device, tensors):
    """``tensors`` (0-d) on ``dev``: moves only those elsewhere (a model spread over devices)."""
    return [t if t.device == dev else t.to(dev) for t in tensors]


def _bitcast_f32(t: torch.Tensor) -> torch.Tensor:
    """int64 [n] -> float32 [2n] with the same bytes, so one flat float32 copy carries both."""
    return t.contiguous().view(torch.float32)


def allreduce_mean(process_group, bucket):
    """DDP communication hook doing exactly what DDP's reducer does without one: scale the bucket
    by 1/world size, then sum it over the ranks. ``torch.distributed``'s ``allreduce_hook`` divides
    instead, which rounds differently when the world size is not a power of two: training results
    would change with the agent attached."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    t = bucket.buffer()
    t.mul_(1.0 / group.size())
    return dist.all_reduce(t, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DistributedDataParallel or torch.compile wrappers."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


class Monitor:
    """Per-rank agent attached to one model and its optimizer; use :func:`gradwatch.agent.attach`.

    A context manager: leaving it (or :meth:`close`) removes every hook, stops the sender thread
    and closes the socket. Attributes ``step`` (optimizer steps completed), ``probes`` (probed
    steps submitted), ``errors`` and ``not_instrumented`` (modules that refused hooks, case C17)
    are for inspection.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: AgentConfig, scaler=None):
        self.cfg = cfg
        self.job, self.rank, self.world_size, self.local_rank, self.host = resolve_identity(cfg)
        self.job_key = job_key(cfg, self.job, self.world_size)
        self.boot = secrets.token_hex(8)
        inner = unwrap(model)
        self._model_ref = weakref.ref(inner)
        self._params = [(normalise(n), p) for n, p in inner.named_parameters()]
        self._leaves = [(path, weakref.ref(m)) for path, m in leaf_modules(inner)]
        self.reducer = Reducer(cfg.fused)
        self.recorder = ProbeRecorder(self.reducer, self._on_error)
        self.disabled: set[str] = set()  # parts switched off after failing repeatedly
        self.recorder.disabled = self.disabled
        self.step = 0
        self.probes = 0
        self.errors = 0
        self.not_instrumented: list[str] = []
        self._part_errors: dict[str, int] = {}
        self._warned: set[str] = set()
        self._closed = False
        self._close_reason = ""  # wire.CLOSE_REASONS; TODO(monitor rewrite): "finished" after the last step
        self._forked = False
        self._probing = False
        self._probe_handles: list = []
        self._pre: Optional[tuple] = None
        self._last_step_end = time.perf_counter()
        self._slots: tuple = ()
        self._schema: Optional[wire.Schema] = None
        self._burst_until = 0  # written by the sender thread, read at step boundaries
        self._recent_norms: collections.deque = collections.deque(maxlen=32)  # sender thread only
        self._local_sq: list = []  # per-bucket local gradient norms of this step
        self._losses: list = []
        self._stepped = True  # an optimizer step happened since the loss scaler's last update
        self._skipped = 0  # steps the loss scaler skipped since the last report (case C10)
        self._scaler = None
        self._first_bucket: Optional[float] = None
        self._comm_inner = None
        self._ddp_ref = None
        self._batch = 0
        # the socket first: if it cannot be made, attach fails before any hook is in place
        self.sender = Sender(
            cfg.endpoint,
            header=self._header,
            schema=lambda h: self._schema_msg(h),
            heartbeat=self._heartbeat_msg,
            queue_size=cfg.queue_size,
            send_hwm=cfg.send_hwm,
            heartbeat_s=cfg.heartbeat_s,
            schema_every_s=cfg.schema_every_s,
        )
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) and cfg.local_norms:
            self._install_comm_hook(model)
        self._param_meta = tuple(
            (name, tuple(p.shape), str(p.dtype).replace("torch.", "")) for name, p in self._params
        )
        self._step_handles = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]
        if scaler is not None:
            self._wrap_scaler(scaler)
        self.sender.start()
        _MONITORS.add(self)
        ref = weakref.ref(self)
        atexit.register(lambda: (m := ref()) and m.close("exit"))
        if self._is_probe(0):
            self._install_probe()

    # --- public ------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return not (self._closed or self._forked)

    def close(self, reason: str = "closed") -> None:
        """Remove every hook, stop the sender; idempotent, never raises. ``reason`` (one of
        ``wire.CLOSE_REASONS``) travels in the goodbye heartbeat."""
        if self._closed:
            return
        self._close_reason = reason
        self._closed = True
        self._remove_probe()
        for h in self._step_handles:
            h.remove()
        self._step_handles = []
        if self._scaler is not None and "update" in vars(self._scaler):
            del self._scaler.update
            self._scaler = None
        if not self._forked:
            try:
                self.sender.close()
                if not self.sender.connected:  # a wrong endpoint must not go unnoticed
                    warnings.warn(f"gradwatch: never connected to {self.cfg.endpoint}: no report reached an "
                                  "aggregator (is it running, and is GRADWATCH_ENDPOINT right?)", RuntimeWarning, stacklevel=2)
            except Exception:
                pass

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- wire messages (called from the sender thread) -----------------------------------------

    def _header(self, seq: int) -> wire.Header:
        return wire.Header(self.job, self.rank, self.world_size, self.boot, seq, time.time(), self.job_key)

    def _schema_msg(self, h: wire.Header) -> Optional[wire.Schema]:
        s = self._schema
        if s is None:
            return None
        return wire.Schema(h, s.host, s.local_rank, s.every, s.params, s.slots, s.hash)

    def _heartbeat_msg(self, h: wire.Header) -> wire.Heartbeat:
        return wire.Heartbeat(
            h, step=self.step - 1, sent=self.sender.sent, drops=self.sender.drops,
            errors=self.errors + self.sender.errors, closing=self._closed,
            in_step_s=time.perf_counter() - self._last_step_end, waiting=self._first_bucket is not None,
            reason=self._close_reason if self._closed else "",
        )

    # --- failure policy ----------------------------------------------------------------------

    def _on_error(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        kind = where.split(":")[0]
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"gradwatch: {where} failed and is skipped: {exc!r}", RuntimeWarning, stacklevel=3)
        self._part_errors[kind] = n = self._part_errors.get(kind, 0) + 1
        if n == _PART_ERRORS and kind in _PARTS:
            self.disabled.add(kind)
            warnings.warn(f"gradwatch: {kind} keeps failing and is switched off; the rest of the agent goes on",
                          RuntimeWarning, stacklevel=3)
        elif n == _PART_ERRORS and not self._closed:  # the step itself: nothing works without it
            self.errors = _MAX_ERRORS
        if self.errors >= _MAX_ERRORS and not self._closed:
            warnings.warn("gradwatch: too many agent errors; monitoring is switched off", RuntimeWarning, stacklevel=3)
            self.close("disabled")

    # --- probe scheduling ----------------------------------------------------------------------

    def _is_probe(self, step: int) -> bool:
        return step % self.cfg.every == 0 or step < self._burst_until

    # --- DDP communication hook (case C13) ------------------------------------------------------

    def _install_comm_hook(self, ddp) -> None:
        if getattr(ddp, "_comm_hooks", None):
            log.info("gradwatch: the model already has a DDP communication hook; per-rank local gradient "
                     "norms need it wrapped: ddp.register_comm_hook(state, monitor.wrap_comm_hook(hook))")
            return
        self._comm_inner = (ddp.process_group, allreduce_mean)
        try:
            ddp.register_comm_hook(None, self._comm_hook)
        except Exception as e:
            self._comm_inner = None
            self._on_error("comm-hook", e)
            return

        def register_comm_hook(state, hook):
            # DDP accepts one hook per model; ours is in place, so the user's becomes its delegate
            # instead of raising "can only be called once" (case C13).
            self._comm_inner = (state, hook)

        ddp.register_comm_hook = register_comm_hook

    # --- AMP loss scaler (case C10) --------------------------------------------------------------

    def _wrap_scaler(self, scaler) -> None:
        """Watch a ``torch.amp.GradScaler``: its ``update()`` runs once per iteration, and an
        iteration without an optimizer step before it is a step the scaler skipped (inf/NaN
        gradients, normal while the scale is searched). Such a step sends no report; its partial
        statistics are discarded and the next report counts it in ``skipped``."""
        ref = weakref.ref(self)
        original = scaler.update

        def update(*args, **kwargs):
            m = ref()
            if m is not None and m.active:
                m._scaler_update()
            return original(*args, **kwargs)

        scaler.update = update  # an instance attribute: close() deletes it, restoring the method
        self._scaler = scaler

    def _scaler_update(self) -> None:
        if not self._stepped:
            self._skipped += 1
            self._local_sq, self._losses, self._first_bucket, self._batch, self._pre = [], [], None, 0, None
            self.recorder.reset()
        self._stepped = False

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Report ``loss`` (a scalar tensor, any dtype and device) with this step, without a host
        sync: kept on the device and copied with the step's other statistics. Called once per
        micro-step, the step reports the mean."""
        if self.active and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach().reshape(()).float())

    def wrap_comm_hook(self, hook):
        """Wrap a user's DDP communication hook so the agent still sees local gradient norms.

        Use when the model already had a hook at attach time::

            ddp.register_comm_hook(state, monitor.wrap_comm_hook(fp16_compress_hook))
        """

        def wrapped(state, bucket):
            self._observe_bucket(bucket)
            return hook(state, bucket)

        return wrapped

    def _comm_hook(self, state, bucket):
        self._observe_bucket(bucket)
        inner_state, inner = self._comm_inner
        return inner(inner_state, bucket)

    def _observe_bucket(self, bucket) -> None:
        if not self.active or "comm-hook" in self.disabled:
            return
        try:
            if self._first_bucket is None:
                self._first_bucket = time.perf_counter()
            self._local_sq.append(torch.linalg.vector_norm(bucket.buffer(), dtype=torch.float32))
        except Exception as e:
            self._on_error("comm-hook", e)

    def _count_micro_step(self, module, args) -> None:
        if torch.is_grad_enabled():
            self.recorder.micro += 1
            if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
                self._batch += args[0].shape[0]

    def _install_probe(self) -> None:
        self._probing = True
        self.recorder.reset()
        for path, ref in self._leaves:
            m = ref()
            if m is None:
                continue
            try:
                self._probe_handles.append(m.register_forward_hook(self.recorder.forward_hook(path)))
            except Exception:  # e.g. a TorchScript submodule (case C17)
                if path not in self.not_instrumented:
                    self.not_instrumented.append(path)
        root = self._model_ref()
        if root is not None:
            try:
                self._probe_handles.append(root.register_forward_pre_hook(self._count_micro_step))
            except Exception:
                pass

    def _remove_probe(self) -> None:
        self._probing = False
        for h in self._probe_handles:
            h.remove()
        self._probe_handles = []

    # --- step hooks (training thread) ----------------------------------------------------------

    def _pre_step(self, optimizer, args, kwargs) -> None:
        if not self.active or "sentinel" in self.disabled:
            return
        try:
            present = [i for i, (_, p) in enumerate(self._params) if p.grad is not None]
            grads = [self._params[i][1].grad for i in present]
            if not grads:
                self._pre = (present, None, (0, 0, False))
                return
            dev = grads[0].device
            # Raw per-parameter norms, per-bucket local norms, losses and the loss scale go to the
            # host as they are; sums, square roots and counts are the sender thread's work, so a
            # step costs the training thread a handful of kernels.
            scalars = [*self._local_sq, *self._losses]
            scale = getattr(self._scaler, "_scale", None)  # a device tensor; get_scale() would sync
            if isinstance(scale, torch.Tensor):
                scalars.append(scale.reshape(()).float())
            parts = [torch.stack(_on(dev, torch._foreach_norm(grads, 2, dtype=torch.float32)))]
            if scalars:
                parts.append(torch.stack(_on(dev, scalars)))
            if self._probing:
                parts.append(torch.stack(_on(dev, [nonfinite_count(g) for g in grads])))
                if self.world_size > 1:  # fingerprints compare replicas: nothing to compare alone
                    parts.append(_bitcast_f32(torch.stack(_on(dev, [fingerprint(g) for g in grads]))))
            sizes = (len(self._local_sq), len(self._losses), isinstance(scale, torch.Tensor))
            self._pre = (present, torch.cat(parts) if len(parts) > 1 else parts[0], sizes)
        except Exception as e:
            self._pre = None
            self._on_error("sentinel", e)

    def _post_step(self, optimizer, args, kwargs) -> None:
        if not self.active:
            return
        step = self.step
        now = time.perf_counter()
        compute_time = (self._first_bucket - self._last_step_end) if self._first_bucket is not None else float("nan")
        step_time, self._last_step_end = now - self._last_step_end, now
        try:
            self._submit(step, step_time, compute_time)
        except Exception as e:
            self._on_error("step", e)
        self.step = step + 1
        self.recorder.reset()
        self._local_sq = []
        self._losses = []
        self._stepped = True
        self._first_bucket = None
        self._batch = 0
        try:
            if self._is_probe(self.step) and not self._probing:
                self._install_probe()
            elif not self._is_probe(self.step) and self._probing:
                self._remove_probe()
        except Exception as e:
            self._on_error("schedule", e)

    def _submit(self, step: int, step_time: float, compute_time: float) -> None:
        pre, self._pre = self._pre, None
        present, grad_part, sizes = pre if pre is not None else ([], None, (0, 0, False))
        probe = self._probing
        rec = self.recorder
        parts = [] if grad_part is None else [grad_part]
        act_meta = grad_meta = ()
        if probe:
            if self._schema is None or len(rec.slots) != len(self._slots):
                self._slots = tuple(rec.slots)
                self._schema = wire.Schema(
                    self._header(0), self.host, self.local_rank, self.cfg.every, self._param_meta, self._slots
                )
                self.sender.request_schema()
            weights = [p.detach() for _, p in self._params]
            if weights:
                dev = weights[0].device
                parts.append(torch.stack(_on(dev, torch._foreach_norm(weights, 2, dtype=torch.float32))))
                if self.world_size > 1:
                    parts.append(_bitcast_f32(torch.stack(_on(dev, [fingerprint(w) for w in weights]))))
            if rec.act:
                act_meta = tuple((i, n) for i, n, _ in rec.act)
                parts.append(torch.cat([r.to(parts[0].device if parts else r.device) for _, _, r in rec.act]))
            if rec.grad:
                grad_meta = tuple(i for i, _ in rec.grad)
                parts.append(torch.cat([r.to(parts[0].device) for _, r in rec.grad]))
            self.probes += 1
        flat = (torch.cat(parts) if len(parts) > 1 else parts[0]) if parts else torch.empty(0)
        event = None
        if flat.is_cuda:
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flat.device))  # the stream the copy runs on
        else:
            host = flat
        batch = self.cfg.batch_size * max(rec.micro, 1) if self.cfg.batch_size else self._batch
        layout = _Layout(
            step=step,
            step_time=step_time,
            compute_time=compute_time,
            batch=batch if probe else 0,
            burst=probe and step % self.cfg.every != 0,
            skipped=self._skipped,
            probe=probe,
            present=tuple(present),
            has_grads=grad_part is not None,
            sizes=sizes,
            fingerprints=self.world_size > 1,
            n_params=len(self._params),
            n_slots=len(self._slots),
            act=act_meta,
            grad=grad_meta,
            micro=rec.micro if probe else 0,
            schema=self._schema.hash if self._schema is not None else "",
        )
        self._skipped = 0
        # the sender polls the event rather than waiting on it: a collective stuck on the device
        # must not stop its heartbeats (they tell a hung rank from the peers waiting for it)
        self.sender.submit(lambda h: self._finalise(h, layout, host), None if event is None else event.query, urgent=probe)

    # --- finalisation (sender thread) ----------------------------------------------------------

    def _finalise(self, h: wire.Header, L: "_Layout", host: torch.Tensor) -> wire.Report:
        raw = host.numpy()  # float32; fingerprints are read from it before any conversion
        with np.errstate(invalid="ignore"):  # fingerprint bytes may read as NaN floats here
            flat = raw.astype(np.float64)
        k = len(L.present)
        off = 0
        grad_norm = local_norm = loss = loss_scale = float("nan")
        grad_nonfinite = 0
        sq = counts = fp_grad_present = None
        if L.has_grads:
            norms = flat[:k]
            sq = norms * norms
            grad_norm = math.sqrt(sq.sum())  # NaN or Inf when a parameter's norm is
            grad_nonfinite = int((~np.isfinite(norms)).sum())
            n_buckets, n_losses, has_scale = L.sizes
            off = k
            if n_buckets:
                local_norm = math.sqrt(float(np.square(flat[off : off + n_buckets]).sum()))
            off += n_buckets
            if n_losses:
                loss = float(flat[off : off + n_losses].mean())
            off += n_losses
            if has_scale:
                loss_scale = float(flat[off])
            off += has_scale
            if L.probe:
                counts = flat[off : off + k]
                off += k
                if L.fingerprints:
                    fp_grad_present = raw[off : off + 2 * k].view(np.uint64)
                    off += 2 * k
        self._watch_sentinel(L.step, grad_norm, grad_nonfinite)
        if math.isfinite(loss_scale) and loss_scale > 0:
            # the comm hook and output tensor hooks saw gradients multiplied by the loss scale;
            # the optimizer pre-hook sees them unscaled (case C10)
            local_norm /= loss_scale
        common = dict(
            drops=self.sender.drops, local_grad_norm=local_norm, compute_time=L.compute_time, loss=loss,
            loss_scale=loss_scale, skipped=L.skipped,
        )
        if not L.probe:
            return wire.Report(h, L.schema, L.step, L.step_time, grad_norm, grad_nonfinite, **common)
        param = np.full((L.n_params, 3), np.nan)
        fp_grad = np.zeros(L.n_params, np.uint64)
        fp_weight = np.zeros(L.n_params, np.uint64)
        if L.n_params:
            param[:, 1] = flat[off : off + L.n_params]
            off += L.n_params
            if L.fingerprints:
                fp_weight[:] = raw[off : off + 2 * L.n_params].view(np.uint64)
                off += 2 * L.n_params
        if k:
            idx = np.asarray(L.present)
            param[idx, 0] = np.sqrt(sq)
            param[idx, 2] = counts
            if fp_grad_present is not None:
                fp_grad[idx] = fp_grad_present
        n_act = len(L.act)
        recs = flat[off : off + 6 * n_act].reshape(n_act, 6)
        off += 6 * n_act
        act = np.full((L.n_slots, 6), np.nan)
        if n_act:
            slot_of = np.fromiter((i for i, _ in L.act), np.int64, n_act)
            numel = np.fromiter((n for _, n in L.act), np.int64, n_act)
            for s in np.unique(slot_of):
                sel = slot_of == s
                act[s] = combine_moments(numel[sel], recs[sel])
        g = flat[off : off + 2 * len(L.grad)].reshape(-1, 2)
        act_grad = np.full((L.n_slots, 2), np.nan)
        if len(L.grad):
            slot_of = np.asarray(L.grad, np.int64)
            sums = np.zeros((L.n_slots, 2))
            np.add.at(sums, slot_of, g)
            seen = np.unique(slot_of)
            act_grad[seen, 0] = np.sqrt(sums[seen, 0])
            if math.isfinite(loss_scale) and loss_scale > 0:
                act_grad[seen, 0] /= loss_scale
            act_grad[seen, 1] = sums[seen, 1]
        return wire.Report(
            h, L.schema, L.step, L.step_time, grad_norm, grad_nonfinite,
            micro=L.micro, probe=True, batch=L.batch, burst=L.burst,
            act=act.astype(np.float32), act_grad=act_grad.astype(np.float32), param=param.astype(np.float32),
            fp_grad=fp_grad, fp_weight=fp_weight, **common,
        )

    def _watch_sentinel(self, step: int, grad_norm: float, grad_nonfinite: int) -> None:
        """Sender thread: ask for a burst of probes after a non-finite or spiking gradient norm.
        (A NaN norm with no non-finite parameter means "no gradients", not a fault.)"""
        burst = self.cfg.burst
        recent = self._recent_norms
        spike = len(recent) >= 4 and grad_norm > self.cfg.spike_factor * statistics.median(recent)
        if burst and (grad_nonfinite > 0 or math.isinf(grad_norm) or spike):
            # ``burst`` probes from the first step the training thread has not yet scheduled: the
            # request arrives a step or two after the faulty one, and ranks may start one step apart
            self._burst_until = max(self._burst_until, max(step + 1, self.step + 1) + burst)
        if math.isfinite(grad_norm):
            recent.append(grad_norm)


class _Layout:
    """Host-side description of where each statistic sits in a step's flat tensor."""

    __slots__ = ("step", "step_time", "compute_time", "batch", "burst", "skipped", "probe", "sizes", "fingerprints", "present", "has_grads", "n_params", "n_slots", "act", "grad", "micro", "schema")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


class NullMonitor:
    """What :func:`attach` returns when the agent is disabled or cannot run: does nothing."""

    active = False
    step = probes = errors = 0
    not_instrumented: list = []

    def observe_loss(self, loss) -> None:
        pass

    def wrap_comm_hook(self, hook):
        return hook

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass
