"""The monitor: one rank's agent, orchestrating small parts at the optimizer's step boundaries.

Step boundary is the optimizer step (``register_step_pre_hook`` / ``register_step_post_hook``),
never a count of backward passes, so gradient accumulation under ``no_sync`` reports once per
optimizer step (case C13). The pre-hook measures gradients every step (the *sentinel*), the
post-hook adds weights on probed steps (:mod:`.measure`); :class:`.schedule.ProbeSchedule` picks the
probed steps and switches the module hooks of :class:`.hooks.ProbeRecorder`; :class:`.ddp.CommHook`
sees buckets before all-reduce (case C13); :class:`.amp.ScalerWatch` counts steps the loss scaler
skips (case C10). At the end of a step :func:`.frame.pack` concatenates it all into one flat device
tensor copied to the host once, non-blocking; the sender thread builds the report from it
(:func:`.report.build`) and sends unprobed steps' reports coalesced (:mod:`.transport`); it also
takes the aggregator's commands and carries them out (:mod:`.control`). The training thread never
synchronises with the device and never sees an exception from the agent (every part reports
failures to one :class:`.failures.Failures`), with two opt-in exceptions: ``on_critical="halt"``,
where the step pre-hook raises :class:`gradwatch.Halt` at the step the aggregator named, and
``on_nonfinite="skip"``, where it reads whether the gradients are finite (one host read a step)
and takes them away when they are not, so the optimizer step changes nothing.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import secrets
import threading
import time
import weakref
from typing import Callable, Optional

import torch

from gradwatch import wire
from gradwatch.errors import Halt, warn_user

from . import frame, measure, parallel, report, targets
from .amp import UNSCALE_BELOW, UNSCALE_FROM, ScalerWatch, Unscale
from .config import AgentConfig, job_key, resolve_identity
from .control import Control, HaltAt, Training
from .failures import Failures
from .ddp import CommHook, allreduce_mean, unwrap  # noqa: F401  (re-exported)
from .fingerprint import Fingerprints, fingerprint  # noqa: F401  (re-exported)
from .hooks import ProbeRecorder
from .null import NullMonitor  # noqa: F401  (re-exported)
from .schedule import ProbeSchedule
from .stats import Reducer
from .transport import Identity, Sender

log = logging.getLogger("gradwatch.agent")

_MONITORS: "weakref.WeakSet[Monitor]" = weakref.WeakSet()


def _disable_in_forked_child() -> None:
    # A DataLoader worker forked from a rank inherits the agent without its threads; it must
    # never touch the parent's sockets or locks (case C23).
    for m in list(_MONITORS):
        m._forked = True
        m._stop_parts()


os.register_at_fork(after_in_child=_disable_in_forked_child)


class Monitor:
    """Per-rank agent attached to one model and its optimizer; use :func:`gradwatch.agent.attach`.

    A context manager: leaving it (or :meth:`close`) removes every hook, stops the sender thread
    and closes the socket; the goodbye says ``finished`` when the block ended normally, ``other``
    when an exception left it, ``closed`` after :meth:`close`, ``exit`` at interpreter exit,
    ``halted`` when it raised :class:`gradwatch.Halt`. Attributes ``step`` (optimizer steps
    completed), ``probes`` (probed steps submitted), ``errors``, ``disabled`` (parts switched off),
    ``not_instrumented`` (modules that refused hooks, case C17) and ``nonfinite_skipped`` (steps
    the breaker skipped) are for inspection.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: AgentConfig, scaler=None, mesh=None):
        self.cfg = cfg
        self.job, self.rank, self.world_size, self.local_rank, self.host = resolve_identity(cfg)
        self.job_key = job_key(cfg, self.job, self.world_size)
        self.boot = secrets.token_hex(8)
        if scaler is None:  # accelerate's optimizer wrapper steps through the GradScaler it holds
            scaler = targets.wrapped_scaler(optimizer)
        optimizer = targets.real_optimizer(optimizer)  # inside a framework's wrapper: the one that steps
        inner = unwrap(model)
        # DDP, FSDP1, FSDP2/HSDP, tensor and pipeline parallel: what this rank holds of each parameter
        self.layout = parallel.detect(inner, mesh)
        self._coord = self.layout.mesh.coord if self.layout.mesh is not None else ()  # every header's
        self._params = self.layout.params
        self._param_meta = self.layout.meta
        self.failures = Failures(lambda: self.close("disabled"))  # every part's on_error
        self.disabled = self.failures.disabled  # parts switched off after failing repeatedly
        self.reducer = Reducer(cfg.fused)
        self.recorder = ProbeRecorder(self.reducer, self.failures, inner)
        self.recorder.disabled = self.disabled
        self.not_instrumented = self.recorder.not_instrumented
        self.schedule = ProbeSchedule(cfg.every, cfg.burst, cfg.spike_factor, self.recorder, self.failures,
                                      budget=cfg.budget, max_interval_s=cfg.max_probe_interval_s,
                                      guard=cfg.nan_guard)
        self.comm = CommHook(self.failures, self.disabled)
        self._unscale = self.comm.unscale = self.recorder.unscale = Unscale()  # one decision per step for both
        self.fingerprints = Fingerprints(self.world_size)
        self.scaler: Optional[ScalerWatch] = None
        self.step = self.probes = 0
        self._number: Optional[Callable[[], int]] = None  # a framework's step numbering (number_steps)
        self._last_step = -1  # the number the latest step was reported under
        self._closed = self._forked = False
        self._close_reason = ""  # wire.CLOSE_REASONS, sent in the goodbye heartbeat
        self._pre: Optional[tuple[list[int], dict, tuple, int]] = None  # the sentinel's (present, sections, rows, split)
        self._losses: list[torch.Tensor] = []
        self._last_step_end = self._acct_end = time.perf_counter()
        self._pre_s = self._carry_s = 0.0  # the agent's own host time in this step so far (budget)
        self._train_tid = threading.get_native_id()  # the thread stepping the optimizer (see _post_step)
        # CPU wait of the training thread (and of the thread running the DDP hook, when another)
        # within the compute time: read where its intervals start and end (_post_step, the first
        # bucket, the end of backward)
        self._wait = measure.RunQueueWait()
        self._last_wait = b""  # its reading at the previous step's end (report.waited_s parses it)
        self._slots: tuple = ()
        self._schema: Optional[wire.Schema] = None
        self._guard_memory = report.GuardMemory()  # the sender thread's, in step order
        # the aggregator's commands: where the training thread is, the halt it may ask for
        comm = self.comm
        self.training = Training(waiting=lambda: comm.first_bucket is not None and comm.backward_end is None)
        self.halt = HaltAt()
        self.nonfinite_skipped = 0  # steps the breaker skipped (on_nonfinite="skip")
        self._skipped_now = 0  # 1 while the step being taken was skipped by it
        self.control = Control(self.training, self.schedule, self.halt, cfg.stack_source,
                               cfg.halt_on if cfg.on_critical == "halt" else None)
        self.identity = Identity(self.job, self.rank, self.world_size, self.boot, self.job_key, self._coord)
        # the socket first: if it cannot be made, attach fails before any hook is in place
        self.sender = Sender(
            cfg.endpoint, header=self.identity.header, schema=self._schema_msg, heartbeat=self._heartbeat_msg,
            queue_size=cfg.queue_size, send_hwm=cfg.send_hwm, heartbeat_s=cfg.heartbeat_s,
            schema_every_s=cfg.schema_every_s, world=self.world_size, coalesce_s=cfg.coalesce_s, watch=self._watch,
            errors=lambda: self.failures.errors, keys=cfg.curve_keys(), identity=self.identity, control=self.control,
        )
        self._step_handles: list = []
        self._at_close: list[Callable[[], None]] = []
        self._follow: Optional[targets.FollowDDP] = None
        try:
            self._install(model, inner, optimizer, scaler)
        except BaseException:
            # whatever was started goes: no hook left behind, no socket or context left for the
            # garbage collector to close on some training thread
            self._closed = self.failures.stopped = True
            self._teardown()
            raise
        _MONITORS.add(self)
        ref = weakref.ref(self)
        atexit.register(lambda: (m := ref()) and m.close("exit"))

    def _install(self, model: torch.nn.Module, inner: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler) -> None:
        """Hooks on the model, the optimizer and the scaler, then the sender thread."""
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            if self.cfg.local_norms:
                self.comm.install(model)
        elif self.world_size > 1 and self.layout.kind == "plain" and self.layout.mesh is None:
            # given the module inside DDP (a framework's callback, or attached before wrapping):
            # the wrapper is found when it first runs the module
            self._follow = targets.FollowDDP(inner, self._adopt_ddp, self._no_ddp, self.failures)
        self.comm.wait = self._wait
        self._follow_wait()
        self._step_handles = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]
        if scaler is not None:
            self.scaler = ScalerWatch(scaler, self._discard_step, self.failures)
        self._check_optimizer(inner, optimizer)
        self.sender.start()
        self.schedule.advance(0)

    # --- public ------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return not (self._closed or self._forked)

    @property
    def errors(self) -> int:
        return self.failures.errors

    @property
    def local_norms(self) -> bool:
        """Whether the ranks' own gradient norms (before all-reduce) are measured: a DDP
        communication hook of the agent's is in place or wrapped, or the DDP wrapper of the
        module it was given is awaited (:class:`.targets.FollowDDP`)."""
        return self.active and (self.comm.observing or self._follow is not None)

    def close(self, reason: str = "closed") -> None:
        """Remove every hook, stop the sender; idempotent, never raises. ``reason`` (one of
        ``wire.CLOSE_REASONS``) travels in the goodbye heartbeat."""
        if self._closed:
            return
        self._close_reason = reason
        self._closed = self.failures.stopped = True
        self._teardown()
        if not self._forked:
            try:
                if self.sender.refused and not self.sender.connected:  # wrong keys or port must not go unnoticed
                    warn_user(f"gradwatch: {self.sender.refusal()} ({self.sender.refused} failed handshakes)")
                elif not self.sender.connected:  # a wrong endpoint must not go unnoticed
                    warn_user(f"gradwatch: never connected to {self.cfg.endpoint}: no report reached an "
                              "aggregator (is it running, and is GRADWATCH_ENDPOINT right?)")
            except Exception:
                pass

    def _teardown(self) -> None:
        """Every part stopped and every hook removed; the sender closed unless in a forked child
        (the parent's socket is not the child's to close). Never raises."""
        for part in (self._stop_parts, self._wait.close, lambda: self.recorder.remove(final=True),
                     self._remove_step_hooks, self._close_scaler,
                     lambda: self._follow is not None and self._follow.remove(keep_traced=True),
                     lambda: self._forked or self.sender.close(), *self._at_close):
            try:
                part()
            except Exception:
                pass

    def _remove_step_hooks(self) -> None:
        handles, self._step_handles = self._step_handles, []
        for h in handles:
            h.remove()

    def _close_scaler(self) -> None:
        scaler, self.scaler = self.scaler, None
        if scaler is not None:
            scaler.close()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # leaving the block normally is the end of training; an exception out of it is not
        self.close("finished" if exc_type is None else "other")

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Report ``loss`` (a scalar tensor, any dtype and device) with this step, without a host
        sync: kept on the device and copied with the step's other statistics. Called once per
        micro-step, the step reports the mean."""
        if self.active and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach().reshape(()).float())

    def at_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the monitor closes (an integration undoing what it wrapped); its
        exceptions are swallowed."""
        self._at_close.append(fn)

    def number_steps(self, source: Callable[[], int]) -> None:
        """Number steps as a framework does: each optimizer step is reported as ``source()``, read
        in the optimizer's step hooks while the step is taken (Trainer's ``state.global_step + 1``,
        Lightning's ``trainer.global_step``). A step the loss scaler skips then keeps its number
        (the framework counts it), and steps of one optimizer among several are numbered as the
        framework numbers them all. A number that does not move past the previous step's (or
        ``source`` failing) gives the previous step + 1 instead; ``source`` never raises into
        training."""
        if not self.active:
            return
        self._number = source
        first = self._numbered(-1)
        if first >= 0:
            self.step = self.training.step = first
            self.schedule.advance(first)

    def _numbered(self, previous: int) -> int:
        """The number of the step being taken: ``source()`` when it moves past ``previous``, else
        ``previous + 1`` (with no source: the agent's own count)."""
        if self._number is None:
            return self.step
        try:
            n = self._number()
            if isinstance(n, int) and n > previous:
                return n
        except Exception as e:
            self.failures("step-number", e)
        return previous + 1

    def wrap_comm_hook(self, hook):
        """Wrap a user's DDP communication hook so the agent still sees local gradient norms.

        Use when the model already had a hook at attach time::

            ddp.register_comm_hook(state, monitor.wrap_comm_hook(fp16_compress_hook))
        """
        return self.comm.wrap(hook)

    # --- what the agent was given (training thread) ------------------------------------------

    def _adopt_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """The DDP wrapper found running the module the agent was given: its buckets are observed
        from now on (the ranks' own gradient norms)."""
        self._follow = None
        if self.active and self.cfg.local_norms:
            self.comm.install(ddp)
            log.info("gradwatch: found the DistributedDataParallel wrapper of the model it was given; "
                     "the ranks' own gradient norms are measured from this step on")

    def _no_ddp(self) -> None:
        self._follow = None
        if self.active:
            warn_user(
                f"gradwatch: rank {self.rank} of {self.world_size} trains a model that no DistributedDataParallel runs: "
                "the ranks' own gradient norms (before all-reduce) are not measured, so a blow-up under gradient "
                "clipping is not found and no finding names the rank it came from. Attach the model DDP wraps "
                "(gw.attach(ddp_model, optimizer)), or wrap your own communication hook with monitor.wrap_comm_hook")

    @staticmethod
    def _check_optimizer(inner: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Warn when the optimizer updates none of the parameters the agent watches (the model was
        wrapped, FSDP's flat or DTensor parameters made, after the agent was given it)."""
        mine = {id(p) for p in inner.parameters()}
        theirs = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if mine and theirs and not (mine & theirs):
            warn_user(
                "gradwatch: the optimizer updates none of the parameters of the model the agent was given (was "
                "the model wrapped, FSDP or fully_shard applied, after attach?): its gradient statistics would "
                "read parameters that never get gradients. Attach the model the optimizer was built from")

    # --- wire messages (called from the sender thread) -----------------------------------------

    def _schema_msg(self, h: wire.Header) -> Optional[wire.Schema]:
        s = self._schema
        if s is None:
            return None
        return wire.Schema(h, s.host, s.local_rank, s.every, s.params, s.slots, s.hash, s.mesh, s.shard, s.halt_on)

    def _heartbeat_msg(self, h: wire.Header) -> wire.Heartbeat:
        return wire.Heartbeat(
            h, step=self._last_step, sent=self.sender.sent, drops=self.sender.drops,
            errors=self.errors + self.sender.errors, closing=self._closed,
            in_step_s=time.perf_counter() - self._last_step_end,
            # in DDP's all-reduce: between the step's first bucket and its backward's end
            waiting=self.training.waiting(),
            reason=self._close_reason if self._closed else "", run_s=measure.thread_run_s(self._train_tid),
            schema=self._schema.hash if self._schema is not None else "",
        )

    def _follow_wait(self) -> bool:
        """Where the compute time's interval starts: follow the training thread and the latest
        hook thread (only while buckets are observed: else no compute time to split) and read
        them. True when that changed the threads followed (readings before are not comparable)."""
        if not self.comm.observing:
            self._last_wait = b""
            return True
        train, hook = self._train_tid, self.comm.hook_tid
        changed = self._wait.follow((train,) if hook in (0, train) else (train, hook))
        self._last_wait = self._wait.read()
        return changed

    def _stop_parts(self) -> None:
        """Hooks that cannot be removed (DDP's, the scaler's while forked) stop observing."""
        self.comm.live = False
        if self.scaler is not None:
            self.scaler.live = False

    # --- step hooks (training thread) ----------------------------------------------------------

    def _discard_step(self) -> None:
        """The loss scaler skipped the step: its partial statistics go, unreported (case C10).
        Under a framework's numbering the skipped step took a number: the next is one further."""
        self._pre, self._losses = None, []
        self.comm.reset()
        self.recorder.reset()
        self._unscale.reset()
        if self._number is not None and self.active:
            self._last_step, self.step = self.step, self.step + 1
            self.schedule.advance(self.step)

    def _pre_step(self, optimizer, args, kwargs):
        if not self.active:
            return None
        if self.halt.step >= 0:  # the aggregator asked for a halt (on_critical="halt" only)
            self._maybe_halt()
        if "sentinel" in self.disabled:
            return None
        # ``args`` holds the optimizer, then step's own arguments
        closure = kwargs["closure"] if "closure" in kwargs else args[1] if len(args) > 1 else None
        if callable(closure):
            # the closure computes this step's gradients (Lightning, LBFGS): measured after it runs
            wrapped = functools.partial(self._run_closure, closure, optimizer)
            if "closure" in kwargs:
                return args, {**kwargs, "closure": wrapped}
            return (args[0], wrapped, *args[2:]), kwargs
        self._take_sentinel(optimizer)
        return None

    def _maybe_halt(self) -> None:
        """Raise :class:`gradwatch.Halt` (once: the monitor closes first, goodbye ``halted``) when
        the step about to be taken is at or past the step the aggregator named; its optimizer step
        is not taken."""
        h = self.halt
        step = self._numbered(self._last_step) if self._number is not None else self.step
        if step < h.step:
            return
        check, summary = h.check, h.summary
        log.warning("gradwatch: halting before step %d on the aggregator's %s finding: %s", step, check, summary)
        self.close("halted")
        raise Halt(step, check, summary)

    def _run_closure(self, closure, optimizer, *args, **kwargs):
        """The user's closure (forward and backward), then the sentinel over the gradients it
        left; its loss is the step's unless ``observe_loss`` gave one. An optimizer calling it
        several times (LBFGS) gets the sentinel of the last call."""
        loss = closure(*args, **kwargs)
        if self.active and not self._losses and isinstance(loss, torch.Tensor):
            self.observe_loss(loss)
        if self.active and "sentinel" not in self.disabled:
            self._take_sentinel(optimizer)
        return loss

    def _take_sentinel(self, optimizer) -> None:
        t0 = time.perf_counter()
        try:
            scale = self.scaler.scale() if self.scaler is not None else None  # get_scale() would sync
            self._pre = measure.sentinel(self._params, self.comm.local_sq, self._losses, scale,
                                         self.recorder.probing, self.fingerprints)
        except Exception as e:
            self._pre = None
            self.failures("sentinel", e)
        if self.cfg.on_nonfinite == "skip" and self._pre is not None:
            self._breaker(optimizer)
        self._pre_s += time.perf_counter() - t0

    def _breaker(self, optimizer) -> None:
        """``on_nonfinite="skip"``: when the gradients the optimizer would apply are not finite
        (the sentinel's chunk norms: one host read), every parameter's gradient goes, so the
        optimizer's step changes nothing (optimizers skip parameters without a gradient; an LR
        scheduler still advances, as after a loss scaler's skipped step). Under DDP the
        all-reduced gradient is the same on every rank: every rank skips the same step."""
        norms = self._pre[1].get("grad_norm")
        if norms is None or not len(norms) or bool(torch.isfinite(norms).all()):
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        self._skipped_now = 1
        self.nonfinite_skipped += 1

    def _post_step(self, optimizer, args, kwargs) -> None:
        if not self.active:
            return
        step = self._numbered(self._last_step) if self._number is not None else self.step
        now = time.perf_counter()
        self._train_tid = threading.get_native_id()
        self.training.ident = threading.get_ident()  # the thread whose stack the aggregator may ask for
        first, end = self.comm.first_bucket, self.comm.backward_end
        compute_time = (first - self._last_step_end) if first is not None else float("nan")
        # the CPU wait over the same interval: both readings of the same threads' files (follow()
        # changes them only here, after this), parsed on the sender thread
        waits = (self._last_wait, self.comm.first_wait) if first is not None else None
        step_time, self._last_step_end = now - self._last_step_end, now
        changed = self._follow_wait()
        if waits is not None and end is not None and end >= first:
            # and the rank's own time after its backward pass (clipping, logging, the optimizer),
            # where a rank slow only there would keep its peers waiting unseen; the wait over it
            # ends at the reading just taken, unless that follows other threads
            compute_time += now - end
            waits += (self.comm.end_wait, b"" if changed else self._last_wait)
        probed, hooks_s, guard_s = self.recorder.probing, self.recorder.host_s + self.comm.host_s, self.recorder.guard_s
        try:
            self._submit(step, step_time, compute_time, waits)
        except Exception as e:
            self.failures("step", e)
        # the next step's number as far as can be told now (the probe schedule's choice for it):
        # one more, or as many more as the framework's numbers moved last time
        stride = step - self._last_step if self._number is not None and self._last_step >= 0 else 1
        self.step, self._last_step = step + max(stride, 1), step
        self.training.step, self.training.step_end = self.step, now
        self.recorder.reset()
        self.comm.reset()
        self._unscale.reset()
        self._losses = []
        if self.scaler is not None:
            self.scaler.stepped = True
        if self.active:  # a failed step may have switched the agent off: no hooks after close
            # the budget: this step's agent host time (sentinel, bucket observation, module hooks, submit, and the
            # previous boundary's hook switching) against its wall time, boundary to boundary
            end = time.perf_counter()
            agent_s = self._carry_s + self._pre_s + hooks_s + guard_s + (end - now)
            self.schedule.account(step, probed, agent_s, end - self._acct_end, guard_s)
            self.schedule.advance(self.step)
            self._acct_end, self._pre_s = end, 0.0
            self._carry_s = time.perf_counter() - end

    def _submit(self, step: int, step_time: float, compute_time: float, waits: Optional[tuple[bytes, ...]] = None) -> None:
        pre, self._pre = self._pre, None
        present, sections, rows, split = pre if pre is not None else ([], {}, (), 0)
        breaker, self._skipped_now = self._skipped_now, 0  # this step's: in its layout below
        probe, rec = self.recorder.probing, self.recorder
        if probe:
            if self._schema is None or len(rec.slots) != len(self._slots):
                self._slots = tuple(rec.slots)
                mesh = self.layout.mesh  # the schema has the mesh's shape; the rank's place is in its headers
                self._schema = wire.Schema(self.identity.header(0), self.host, self.local_rank, self.cfg.every or 0,
                                           self._param_meta, self._slots,
                                           mesh=None if mesh is None else wire.Mesh(mesh.names, mesh.sizes),
                                           shard=self.layout.dims,
                                           halt_on=self.cfg.halt_on if self.cfg.on_critical == "halt" else ())
                self.sender.request_schema()
            sections.update(measure.probe(self._params, rec, self.fingerprints))
            self.probes += 1
        elif rec.guarded:
            sections["guard"] = rec.sums
        flat, counts = frame.pack(sections)
        host, ready = frame.to_host(flat)
        batch = self.cfg.batch_size * max(rec.micro, 1) if self.cfg.batch_size else rec.batch
        # the layout is built on the sender thread: a frozen dataclass of 20-odd fields costs the
        # training thread several microseconds a step, a partial about one
        layout = functools.partial(
            report.StepLayout, step=step, step_time=step_time, compute_time=compute_time,
            skipped=self.scaler.take_skipped() if self.scaler is not None else 0, nonfinite_skipped=breaker,
            schema=self._schema.hash if self._schema is not None else "", present=tuple(present), rows=rows, split=split, unscaled=self._unscale.applied, counts=counts,
            probe=probe, burst=probe and not self.schedule.on_cadence(step), batch=batch if probe else 0,
            micro=rec.micro if probe else 0, n_params=len(self._params), n_slots=len(self._slots),
            act=tuple((i, n) for i, n, _ in rec.act) if probe else (), grad=tuple(i for i, _ in rec.grad) if probe else (),
            calls=tuple((i, c, n) for i, (c, n) in rec.counts.items()) if probe else (),
            probe_interval=self.schedule.interval, over_budget=self.schedule.over_budget, waits=waits or (),
            shard_dims=self.layout.dims, norms=self.fingerprints.enabled,
            guard=tuple(rec.guarded) if rec.guard and not probe else None,
        )
        # the sender polls ``ready`` rather than waiting: a collective stuck on the device must not
        # stop its heartbeats (they tell a hung rank from the peers waiting for it)
        self.sender.submit(lambda h: self._finalise(h, layout, host), ready, urgent=probe)

    def _finalise(self, h: wire.Header, partial_layout: Callable[..., report.StepLayout], host: torch.Tensor) -> wire.Report:
        """Sender thread: the step's report (unprobed ones join the sender's batch of steps)."""
        layout = partial_layout(agent_cost=self.schedule.fraction)
        return report.build(h, layout, host.numpy(), self.sender.drops, self._guard_memory)

    def _watch(self, r: wire.Report) -> bool:
        """Sender thread, each step's report in order: a burst of probes if its gradient norm asks
        for one; True (an anomaly) sends the batch it joins at once. Also switches the
        communication hook's and the output-gradient hooks' division by a huge loss scale
        (:class:`.amp.Unscale`) on or off for the steps to come."""
        scaler = self.scaler  # read once: close() clears it from the training thread
        if scaler is not None and r.loss_scale == r.loss_scale:  # NaN: no scale in this report
            if r.loss_scale >= UNSCALE_FROM:
                self._unscale.source = scaler.scale
            elif r.loss_scale < UNSCALE_BELOW:
                self._unscale.source = None
        return self.schedule.watch(r.step, r.grad_norm, r.grad_nonfinite, scheduled=self.step)

