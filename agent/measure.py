"""What a step measures on the device, as sections of the step frame (:mod:`.frame`).

Two plain functions, one per moment of the step. :func:`sentinel` runs in the optimizer's step
pre-hook, every step, while the gradients are there: per-parameter gradient norms
(:func:`.stats.l2_norms`: float32 within chunks, float64 across, case C10) and what
travels with them; on a probed
step also per-parameter non-finite counts and gradient fingerprints. :func:`probe` runs in the
post-hook of a probed step: weight norms and fingerprints after the update, and the recorder's
activation and output-gradient records. Raw values go to the host as they are; sums, square roots
and counts are the sender thread's work (:mod:`.report`), so a step costs a handful of kernels and
no host synchronisation.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Optional, Sequence

import torch

from .fingerprint import Fingerprints
from .hooks import ProbeRecorder
from .stats import chunk_norms, chunks_of, dense_values, l2_norms, nonfinite_count, split_max


def sentinel(params: Sequence[torch.Tensor], buckets: Sequence[torch.Tensor], losses: Sequence[torch.Tensor],
             scale: Optional[torch.Tensor], probing: bool, fingerprints: Fingerprints) -> tuple[list[int], dict, tuple[int, ...], int]:
    """Gradient statistics of one step, before the optimizer changes anything.

    Args:
        params: the model's parameters, in schema order.
        buckets: float32 1-D device tensors, the chunk norms of this rank's DDP buckets before
            all-reduce (:class:`.ddp.CommHook`).
        losses: float32 0-d device tensors passed to ``observe_loss``.
        scale: the AMP loss scale (0-d device tensor) or None.
        probing: the step is probed: add non-finite counts and fingerprints.
        fingerprints: computes gradient fingerprints when there are replicas.

    Returns:
        ``(present, sections, rows, split)``: indices into ``params`` of those with a gradient,
        frame sections, the chunks each present gradient has in the ``grad_norm`` section and the
        ``split`` that section's layout was made with (:func:`.stats.chunk_norms`, by the first
        gradient's device; the sender combines them with :func:`.stats.combine_chunks`).
        Without any gradient, no section at all (bucket norms, losses and the scale only travel
        with gradients).
    """
    present: list[int] = []
    grads: list[torch.Tensor] = []
    rows: list[int] = []
    for i, p in enumerate(params):  # every step: one pass, no call per parameter that can be avoided
        g = p.grad
        if g is None:
            continue
        if g.layout != torch.strided or g.is_complex():
            # sparse values vary in size from step to step, complex ones need their magnitude:
            # l2_norms' one value each (rare, so its extra kernels do not matter)
            g = l2_norms([dense_values(g)])[0].reshape(1)
            k = 1
        else:
            k = chunks_of(g.numel())
        present.append(i)
        grads.append(g)
        rows.append(k)
    if not grads:
        return present, {}, (), 0
    split = split_max(grads[0])
    sections = {
        "grad_norm": chunk_norms(grads, rows, split),
        "bucket_norm": buckets[0] if len(buckets) == 1 else (torch.cat(list(buckets)) if buckets else []),
        "loss": list(losses), "loss_scale": [] if scale is None else [scale],
    }
    if probing:
        dense = [dense_values(params[i].grad) for i in present]
        sections["grad_nonfinite"] = [nonfinite_count(g) for g in dense]
        sections["grad_fp"] = fingerprints.of(dense)
    return present, sections, tuple(rows), split


def probe(params: Sequence[torch.Tensor], recorder: ProbeRecorder, fingerprints: Fingerprints) -> dict:
    """Frame sections a probed step adds after the optimizer step: weight norms
    (:func:`.stats.l2_norms`) and fingerprints of every parameter, and the recorder's records."""
    sections: dict = {"act": [r for _, _, r in recorder.act], "out_grad": [r for _, r in recorder.grad]}
    weights = [p.detach() for p in params]
    if weights:
        sections["weight_norm"] = l2_norms(weights)
        sections["weight_fp"] = fingerprints.of(weights)
    return sections


def thread_run_s(tid: int) -> float:
    """Seconds thread ``tid`` of this process has been running or waiting for a CPU (Linux
    schedstat: it tells a training thread that is slow or starved from one blocked in a hang);
    NaN where unavailable."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            on_cpu, waiting, _ = f.read().split()
        return (int(on_cpu) + int(waiting)) / 1e9
    except (OSError, ValueError):
        return math.nan


def _unknown() -> bytes:
    return b""


def _reader(fds: tuple[int, ...]) -> Callable[[], bytes]:
    """A function returning the schedstat files open as ``fds``, as they read now (b"" on failure)."""
    pread = os.pread
    if not fds:
        return _unknown
    if len(fds) == 1:  # the common case (the training thread runs the hook too): no loop
        (fd,) = fds

        def read() -> bytes:
            try:
                return pread(fd, 64, 0)
            except Exception:  # the thread exited (ESRCH), the descriptor was closed meanwhile
                return b""

        return read

    def read_all() -> bytes:
        try:
            return b"".join([pread(fd, 64, 0) for fd in fds])
        except Exception:
            return b""

    return read_all


class RunQueueWait:
    """What some threads of this process have spent waiting for a CPU (runnable, not running:
    Linux schedstat's run-queue wait, ``/proc/self/task/<tid>/schedstat`` field 2, nanoseconds).

    Read every step on the training thread and in the DDP communication hook (whichever thread
    runs it), so it keeps a descriptor on each thread's file open and :attr:`read` takes one
    ``os.pread`` of each, nothing else: a system call, about 1 us in a tight loop and 3-6 us
    between training work on this project's loaded 2-core VM, where ``open`` + ``read`` + ``close``
    take several; the bytes are parsed later (:func:`.report.waited_s`, sender thread). ``pread`` moves no
    file offset, so two threads may read at once. :attr:`read` never raises: b"" where unavailable
    (no ``/proc``, a thread gone).
    """

    def __init__(self):
        self.tids: tuple[int, ...] = ()
        self._fds: tuple[int, ...] = ()
        self.read: Callable[[], bytes] = _unknown

    def follow(self, tids: tuple[int, ...]) -> bool:
        """Read the threads ``tids`` (native ids, distinct) from now on; True when that changed
        the threads read (a reading before is then not comparable with one after)."""
        if tids == self.tids:
            return False
        fds = []
        try:
            for tid in tids:
                fds.append(os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        except Exception:  # OSError: no /proc, a thread already gone
            self._close(fds)
            fds = []
        old, self.tids, self._fds = self._fds, tids, tuple(fds)
        self.read = _reader(self._fds)
        self._close(old)
        return True

    def close(self) -> None:
        fds, self._fds, self.tids, self.read = self._fds, (), (), _unknown
        self._close(fds)

    @staticmethod
    def _close(fds) -> None:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
