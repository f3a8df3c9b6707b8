"""DDP: the communication-hook takeover that shows each rank's own gradient before all-reduce (case C13).

After all-reduce every rank holds the same gradient, so a rank whose data or device misbehaves
only shows in what it contributed. DDP hands each gradient bucket to a communication hook before
reducing it; :class:`CommHook` registers one (only when the model has none) that records the
L2 norms of the bucket's chunks on the device (:func:`.stats.chunk_norms`, summed in float64 on the host) and the moment the step's first bucket was ready and,
for CPU buckets (gloo), the moment its backward pass ended, DDP's wait for the all-reduce included
(the rank's own time is the step less what lies between: no waiting for peers), each with the CPU wait so far of the
threads the monitor follows (:class:`.measure.RunQueueWait`), and the id of the thread running
the hook, then delegates to :func:`allreduce_mean`, which reduces exactly as DDP does without a
hook. A user's hook registered later becomes the delegate instead of
failing; one registered before attach can be wrapped with :meth:`CommHook.wrap`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import torch

from .amp import Unscale
from .stats import SPLIT_MAX, chunk_norms, chunks_of, dense_values, l2_norms, split_max

log = logging.getLogger("gradwatch.agent")

PART = "comm-hook"  # the name its failures are counted, warned about and switched off under

#: the running backward pass's id, -1 outside one (private to torch: where absent, a hook called
#: outside backward finds out from queue_callback refusing, and its end is no longer timed)
_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", None)


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


class CommHook:
    """Observes the gradient buckets of one step, before all-reduce.

    Attributes:
        local_sq: float32 1-D device tensors, one per bucket seen this step: the L2 norms of its
            chunks (:func:`.stats.chunk_norms`), or for a bucket of more than
            :data:`.stats.SPLIT_MAX` chunks its norm (:func:`.stats.l2_norms`); squared and summed
            in float64 by the report builder.
        first_bucket: ``clock()`` time the step's first bucket was ready, or None.
        first_wait: ``wait.read()`` at that moment (the followed threads' schedstat, parsed by
            :func:`.report.waited_s` on the sender thread), b"" when unknown.
        backward_end: ``clock()`` time the latest backward pass that handed over a CPU bucket
            ended, after DDP waited for its all-reduce (an autograd final callback queued behind
            DDP's own), or None (also while a later backward pass of the step runs, and on
            accelerators, where DDP's wait returns once the collective is queued on the device).
        end_wait: ``wait.read()`` at that moment, b"" when unknown.
        host_s: seconds spent observing buckets since the last reset (the agent's own cost, for
            its budget and ``agent_cost``).
        hook_tid: native id of the thread that ran the hook for the first bucket (the training
            thread on CPU, an autograd device thread on CUDA), 0 before one.
        wait: the monitor's :class:`.measure.RunQueueWait`, or None.
        live: cleared by the monitor when it closes or the process forks: observation stops, the
            delegate keeps reducing (DDP cannot drop a hook).
        unscale: divides each bucket by a huge loss scale before its norms (:class:`.amp.Unscale`,
            the monitor's, shared with the output-gradient hooks).
        disabled: the monitor's set of parts switched off; observation stops when it holds
            ``"comm-hook"``.

    Args:
        on_error: called as ``on_error("comm-hook", exc)`` when observing fails; never raises.
        disabled: the set shared with the monitor.
        clock: seconds, monotonic.
    """

    def __init__(self, on_error: Callable[[str, BaseException], None], disabled: set,
                 clock: Callable[[], float] = time.perf_counter):
        self.on_error = on_error
        self.disabled = disabled
        self.clock = clock
        self.live = True
        self.local_sq: list[torch.Tensor] = []
        self.first_bucket: Optional[float] = None
        self.first_wait = b""
        self.backward_end: Optional[float] = None
        self.end_wait = b""
        self.host_s = 0.0
        self._queued = False  # this backward pass's end is awaited
        self._timed = True  # cleared if autograd refuses a final callback: the end is then unknown
        self.hook_tid = 0
        self._hook_ident = 0
        self.wait = None  # the monitor's RunQueueWait
        self.unscale = Unscale()  # the monitor's replaces it
        self._inner = None  # (state, hook) the buckets go on to
        self.wrapped = False  # wrap() handed out a hook that observes

    @property
    def observing(self) -> bool:
        """Buckets may reach :meth:`observe` (installed, or a user's hook wrapped)."""
        return self._inner is not None or self.wrapped

    def install(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register on ``ddp`` unless it already has a hook (then log how to wrap it)."""
        if getattr(ddp, "_comm_hooks", None):
            log.info("gradwatch: the model already has a DDP communication hook; per-rank local gradient "
                     "norms need it wrapped: ddp.register_comm_hook(state, monitor.wrap_comm_hook(hook))")
            return
        self._inner = (ddp.process_group, allreduce_mean)
        try:
            ddp.register_comm_hook(None, self._hook)
        except Exception as e:
            self._inner = None
            self.on_error(PART, e)
            return

        def register_comm_hook(state, hook):
            # DDP accepts one hook per model; ours is in place, so the user's becomes its delegate
            # instead of raising "can only be called once" (case C13).
            self._inner = (state, hook)

        ddp.register_comm_hook = register_comm_hook

    def wrap(self, hook):
        """``hook`` (a DDP communication hook) observed first; see ``Monitor.wrap_comm_hook``."""

        def wrapped(state, bucket):
            self.observe(bucket)
            return hook(state, bucket)

        self.wrapped = True
        return wrapped

    def _hook(self, state, bucket):
        self.observe(bucket)
        inner_state, inner = self._inner
        return inner(inner_state, bucket)

    def observe(self, bucket) -> None:
        """Record one bucket's chunk norms (on the device, no sync) and, for the first, the time."""
        if not self.live or PART in self.disabled:
            return
        t0 = time.perf_counter()
        try:
            if self.first_bucket is None:
                self.first_bucket = self.clock()
                self.first_wait = self.wait.read() if self.wait is not None else b""
                ident = threading.get_ident()  # pthread_self: no system call, unlike the native id
                if ident != self._hook_ident:
                    self._hook_ident, self.hook_tid = ident, threading.get_native_id()
            t = bucket.buffer()
            if not self._queued and self._timed and t.is_cpu:
                self._await_end()
            if t.layout != torch.strided:  # a sparse gradient's bucket (nn.Embedding(sparse=True)): its values
                t = dense_values(t)
            t = self.unscale.apply(t)  # a copy only under a huge loss scale: the bucket is DDP's to reduce
            k = chunks_of(t.numel())
            # up to SPLIT_MAX chunks, its chunk norms (one foreach over views, or by rows past
            # split_max's chunks: on the CPU past 4): half the kernels of a norm taken to one value; a larger bucket
            # (DDP's default 25 MB) as one value, or its chunk norms would grow every step's frame
            # by one value per 32 kB of gradient
            self.local_sq.append(chunk_norms((t,), (k,), split_max(t)) if k <= SPLIT_MAX else l2_norms([t])[0].reshape(1))
        except Exception as e:
            self.on_error(PART, e)
        self.host_s += time.perf_counter() - t0

    def _await_end(self) -> None:
        """Time the end of the running backward pass. DDP queues its own final callback, which
        waits for the all-reduce, only once its last bucket is handed over, after this first
        one: so a callback queued now queues the one that reads the clock, which autograd runs
        after DDP's. CPU buckets only: on an accelerator DDP's wait returns once the collective is
        queued on the device, so a host sync after backward (GradScaler's step, a logged
        ``.item()``) would put the wait for peers into the rank's own time."""
        if _GRAPH_TASK is not None and _GRAPH_TASK() < 0:
            return  # outside backward (DDP Join's shadow all-reduce): nothing to time, no reason to stop
        if self._queue(self._behind_ddp):
            self._queued = True
            # a second backward pass before the optimizer step (accumulation without no_sync, two
            # losses) waits for its own all-reduce until it ends
            self.backward_end, self.end_wait = None, b""

    def _behind_ddp(self) -> None:
        # autograd's thread, at the end of backward, like _ended: never raises into it
        self._queue(self._ended)

    def _queue(self, callback) -> bool:
        """Queue an autograd final callback; False (and no more timing) where autograd refuses:
        the rank's own time stays the time until the first bucket."""
        try:
            torch.autograd.Variable._execution_engine.queue_callback(callback)
            return True
        except Exception as e:
            self._timed = False
            log.debug("gradwatch: the end of backward cannot be timed: %s", e)
            return False

    def _ended(self) -> None:
        try:
            self._queued = False
            self.backward_end = self.clock()
            self.end_wait = self.wait.read() if self.wait is not None else b""
        except Exception:  # (neither raises: a guard for the thread it runs on)
            self.backward_end = None

    def reset(self) -> None:
        """Forget the step's buckets (a step ended or was skipped)."""
        self.local_sq = []
        self.first_bucket = None
        self.first_wait = b""
        self.backward_end = None
        self.end_wait = b""
        self.host_s = 0.0
        self._queued = False  # a backward pass that raised never ran its callbacks
