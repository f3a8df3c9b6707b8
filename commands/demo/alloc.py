"""The demo's and the fault matrix's rank processes: glibc malloc keeps the memory they free.

Not the agent's business (it never changes the training process's settings): the harnesses' own.
A training job of its own on CPUs can do the same with glibc's environment variables,
``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=2147483647``.
"""

from __future__ import annotations

import ctypes

#: glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: the largest block glibc may keep on its heaps instead of mapping it (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
MMAP_THRESHOLD_MAX = 32 << 20


def steady_allocator() -> bool:
    """Make glibc malloc keep the memory a rank has freed, so that a training step reuses the
    previous step's pages instead of faulting fresh ones in: no trimming of the heap's top, and
    blocks up to 32 MiB (every activation of the matrix's models) from the heap, not mmap.

    With glibc's defaults (a dynamic mmap threshold, the heap's top trimmed past twice that) whether
    a step's activations are handed back to the kernel and faulted in again (page zeroing: kernel
    time on the training thread) depends on the process's allocation history: one rank of a job
    takes 0 page faults per step, its peer 500-4,000 (2 MiB activations of the CNN: 512 pages each),
    several milliseconds of its compute time, persistently, and a step or an event (a probe burst,
    a pause) can move a rank between these modes. That is a straggler no injected fault made: on
    13-25 ms steps the ranks of one run differed by up to ~45 % (relative score 0.66, 6.5 ms: half
    the straggler check's 10 ms floor then), which the check rightly names (a real slowdown of
    the whole job; the likely cause of the CI slice's stray straggler findings). The matrix
    measures injected faults, so its ranks must be alike, and the demo's ranks are so too: a clean
demo job is one whose ranks work alike.

    Returns whether both settings took (False off glibc: nothing to do there)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # either setting also turns glibc's dynamic threshold off
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) & bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
