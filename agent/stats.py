"""On-device reductions: each returns a small float32 tensor and never synchronises with the host.

A *moments record* summarises one tensor in 6 float32 values, ``MOMENT_FIELDS``:
``mean``, ``m2`` (sum of squared deviations from the mean), ``min``, ``max``, ``zeros`` (count of
exact zeros) and ``nonfinite`` (count of NaN and +-Inf). Records of several calls of one module
combine exactly on the host (:func:`combine_moments`, Chan, Golub and LeVeque 1979, "Updating
formulae and a pairwise algorithm for computing sample variances"), so a module called twice per
step (weight tying, gradient accumulation) is summarised over all its calls.

Two implementations compute the same record: eager ops (the default), and one fused
``torch.compile`` kernel (one pass over memory) that :class:`Reducer` builds in a background thread
so compilation never stalls a training step. Half-precision inputs are upcast to float32 before
reducing (case C10: 300**2 overflows float16). The fused kernel accumulates deviations from the
tensor's first element, which keeps the variance accurate when ``|mean| >> std``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from gradwatch.columns import records

from .combine import combine_calls

log = logging.getLogger("gradwatch.agent")

#: the record's fields, in order: the ``record`` of each ``act`` row of the statistics table
MOMENT_FIELDS = records("act")


def _eager_moments(x: torch.Tensor) -> torch.Tensor:
    # mean() and var() separately: torch.var_mean ran ~8x slower on this CPU.
    var = x.var(correction=0) if x.numel() > 1 else x.new_zeros(())
    mn, mx = torch.aminmax(x)
    return torch.stack(
        [
            x.mean(),
            var * x.numel(),
            mn,
            mx,
            x.numel() - nonzero_count(x),
            nonfinite_count(x),
        ]
    )


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def dense_values(g: torch.Tensor) -> torch.Tensor:
    """The values a gradient's statistics are taken over, never densified, no host sync.

    A strided tensor is returned as it is. A sparse COO tensor (``nn.Embedding(sparse=True)``)
    gives its coalesced values: duplicate indices summed, as ``g.coalesce().values()`` would, but
    without ``coalesce`` (whose output size depends on the data and costs a host sync on CUDA):
    indices are linearised and sorted, each run of equal indices gets a segment number by a
    cumulative sum, and ``index_add_`` sums each run into row ``segment`` of a zero tensor shaped
    like ``g.values()``; rows past the last segment stay zero, which changes neither a norm, a
    non-finite count nor a fingerprint. An already coalesced tensor gives ``g.values()``.
    Compressed layouts (CSR, CSC, BSR, BSC) hold no duplicates and give ``g.values()``.

    Returns:
        A strided tensor of ``g``'s dtype: ``g`` itself, or [nnz, *dense dims] values.
    """
    if g.layout == torch.strided:
        return g
    if g.layout in _COMPRESSED:
        return g.values()
    if g.is_coalesced():
        return g._values()
    idx, vals = g._indices(), g._values()
    lin = idx[0]
    for d in range(1, idx.shape[0]):  # row-major linear index over the sparse dimensions
        lin = lin * g.shape[d] + idx[d]
    order, perm = torch.sort(lin, stable=True)
    new = torch.ones_like(order, dtype=torch.bool)
    new[1:] = order[1:] != order[:-1]
    segment = torch.cumsum(new, 0) - 1
    return torch.zeros_like(vals).index_add_(0, segment, vals[perm])


#: elements one float32 partial sum of squares covers in :func:`l2_norms` (see bench/norm_precision.py)
NORM_CHUNK = 1 << 13


#: dtypes torch takes a float32 norm of directly (``dtype=torch.float32``, no copy); a norm of
#: another (float64: no narrowing; complex: by magnitude) is taken in its own precision, made float32
_NARROW = frozenset((torch.float16, torch.bfloat16, torch.float32))


def _foreach_norms(tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """float32 0-d L2 norm of each tensor (``torch._foreach_norm``; complex by magnitude). One
    call where every tensor's dtype is in :data:`_NARROW`, the usual case (tried first: checking
    each dtype would cost Python per tensor every step); otherwise those apart."""
    try:
        return torch._foreach_norm(tensors, 2, dtype=torch.float32)
    except RuntimeError:  # a float64 or complex tensor among them
        out: list = [None] * len(tensors)
        for narrow in (True, False):
            idx = [i for i, t in enumerate(tensors) if (t.dtype in _NARROW) == narrow]
            if idx:
                norms = torch._foreach_norm([tensors[i] for i in idx], 2, **({"dtype": torch.float32} if narrow else {}))
                for i, n in zip(idx, norms):
                    out[i] = n if narrow else n.float()
        return out


def _row_norms(x: torch.Tensor, dim=None) -> torch.Tensor:
    """float32 L2 norms of ``x`` (over ``dim``; complex by magnitude), in float32 for the
    :data:`_NARROW` dtypes, else in ``x``'s own precision."""
    if x.dtype in _NARROW:
        return torch.linalg.vector_norm(x, dim=dim, dtype=torch.float32)
    return torch.linalg.vector_norm(x, dim=dim).float()


def l2_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """float32 0-d L2 norm of each tensor (any floating or complex dtype, any device; complex by
    magnitude; float64 normed in float64), no host sync.

    Precision: a float32 accumulator drifts as tensors grow (on CPU rel 1e-5 at 2^20
    elements, 6e-3 at 2^26), and float64 accumulation costs ~50x on CPU. So the sum of squares is
    taken in two levels: float32 over chunks of :data:`NORM_CHUNK` elements (rel error ~1e-7 each),
    float64 across the chunks; the result is within rel 1e-6 of a float64 reference up to 2^27
    elements at about the cost of the float32 norm (figures in bench/README.md). Tensors of at most
    one chunk take a single ``torch._foreach_norm`` (float32); NaN and Inf propagate.
    """
    out: list = [None] * len(tensors)
    small = [i for i, t in enumerate(tensors) if t.numel() <= NORM_CHUNK]
    if small:
        for i, n in zip(small, _foreach_norms([tensors[i] for i in small])):
            out[i] = n
    for i, t in enumerate(tensors):
        if out[i] is None:
            out[i] = _chunked_norm(t)
    return out


#: on an accelerator, a tensor of up to this many chunks joins :func:`chunk_norms`'s one
#: ``_foreach_norm`` call as views; a larger one takes one ``vector_norm`` over its rows (a view per
#: chunk would cost Python per chunk)
SPLIT_MAX = 64

#: the same on the CPU, whose ``_foreach_norm`` is a loop of one norm per view: by rows from 5
#: chunks on (one chunk's view ~2.5 us; on this project's CPU a 37-chunk tensor takes 107 us as
#: views, 44 us by rows; 2-4 chunks, with a short last chunk, are cheaper as views)
CPU_SPLIT_MAX = 4


def split_max(t: torch.Tensor) -> int:
    """The most chunks a tensor on ``t``'s device is split into views for :func:`chunk_norms`'s
    foreach: :data:`SPLIT_MAX` on an accelerator, where the foreach saves kernel launches,
    :data:`CPU_SPLIT_MAX` on the CPU."""
    return CPU_SPLIT_MAX if t.is_cpu else SPLIT_MAX


def chunks_of(numel: int) -> int:
    """Chunks of :data:`NORM_CHUNK` elements :func:`chunk_norms` gives a tensor of ``numel``
    elements (1 for at most one chunk, an empty tensor included)."""
    return 1 if numel <= NORM_CHUNK else -(-numel // NORM_CHUNK)


def chunk_norms(tensors: Sequence[torch.Tensor], rows: Sequence[int], split: int = SPLIT_MAX) -> torch.Tensor:
    """float32 L2 norms of the chunks of each tensor, as one flat tensor; no host sync.

    The sentinel's every-step form of :func:`l2_norms`, with the float64 sum across chunks left to
    the host (:func:`combine_chunks`): tensors of at most ``split`` chunks are split into
    views and normed by one ``torch._foreach_norm`` with everything else, so a step costs a split
    per such tensor, one foreach and one stack instead of five kernels per large tensor; a larger
    one takes a ``vector_norm`` over its rows (and one over its short last chunk), joined by a cat.

    Args:
        tensors: strided floating tensors, any device (the first one's receives the result).
        rows: ``chunks_of(t.numel())`` of each tensor (precomputed by the caller: a parameter's
            gradient keeps its size).
        split: the most chunks a tensor joins the foreach with (:func:`split_max` of the
            tensors' device); :func:`combine_chunks` must be given the same.

    Returns:
        float32 [sum(rows)]: the chunk norms of the tensors with at most ``split`` chunks,
        in order, then those of the larger ones, in order (the layout :func:`combine_chunks` reads).
    """
    views: list[torch.Tensor] = []
    huge: list[torch.Tensor] = []
    for t, k in zip(tensors, rows):
        if k == 1:
            views.append(t)
        elif k <= split:
            views.extend(t.reshape(-1).split_with_sizes(_chunk_sizes(t.numel())))  # Tensor.split's Python costs 2x
        else:
            x = t.detach().reshape(-1)
            m = x.numel() // NORM_CHUNK * NORM_CHUNK
            huge.append(_row_norms(x[:m].view(-1, NORM_CHUNK), dim=1))
            if m < x.numel():
                huge.append(_row_norms(x[m:]).reshape(1))
    out = _stack(_foreach_norms(views)) if views else None
    if not huge:
        return out if out is not None else torch.empty(0)
    dev = out.device if out is not None else huge[0].device
    return torch.cat(([out] if out is not None else []) + [h.to(dev) for h in huge])


@functools.lru_cache(maxsize=1024)
def _chunk_sizes(numel: int) -> tuple[int, ...]:
    """The sizes ``Tensor.split(NORM_CHUNK)`` would give a tensor of ``numel`` elements."""
    full, rest = divmod(numel, NORM_CHUNK)
    return (NORM_CHUNK,) * full + ((rest,) if rest else ())


def _stack(norms: list[torch.Tensor]) -> torch.Tensor:
    try:
        return torch.stack(norms)
    except RuntimeError:  # a model spread over devices: everything to the first one's (rare, so not checked first)
        dev = norms[0].device
        return torch.stack([n.to(dev) for n in norms])


def combine_chunks(values: np.ndarray, rows: Sequence[int], split: int = SPLIT_MAX) -> np.ndarray:
    """Host side of :func:`chunk_norms`: each tensor's L2 norm, ``sqrt(sum of squared chunk
    norms)`` in float64 (NaN and Inf propagate).

    Args:
        values: [sum(rows)] chunk norms in :func:`chunk_norms`'s layout.
        rows: chunks of each tensor.
        split: the ``split`` :func:`chunk_norms` was given.

    Returns:
        float64 [len(rows)].

    Raises:
        ValueError: ``values`` does not hold ``sum(rows)`` norms.
    """
    v = np.asarray(values, np.float64).reshape(-1)
    seg = _segments(tuple(rows), split)
    if v.size != (len(rows) if seg is None else seg.size):
        raise ValueError(f"{v.size} chunk norms for {sum(rows)} chunks")
    if seg is None:
        return v
    # bincount adds in the order of ``seg``, as a sequential sum over each tensor's chunks would
    return np.sqrt(np.bincount(seg, weights=v * v, minlength=len(rows)))


@functools.lru_cache(maxsize=64)
def _segments(rows: tuple[int, ...], split: int) -> Optional[np.ndarray]:
    """int64 [sum(rows)]: the tensor each value of :func:`chunk_norms`'s layout belongs to; None
    when every tensor has one chunk. Cached: a rank's gradients keep their sizes, so the sender
    thread works this out once, not every step."""
    if all(k == 1 for k in rows):
        return None
    k = np.asarray(rows, np.int64)
    order = np.concatenate((np.flatnonzero(k <= split), np.flatnonzero(k > split)))
    seg = np.repeat(order, k[order])
    seg.flags.writeable = False  # shared by every call
    return seg


def _chunked_norm(t: torch.Tensor) -> torch.Tensor:
    x = t.detach().reshape(-1)
    m = x.numel() // NORM_CHUNK * NORM_CHUNK
    rows = _row_norms(x[:m].view(-1, NORM_CHUNK), dim=1)
    if m < x.numel():
        rows = torch.cat((rows, _row_norms(x[m:]).reshape(1)))
    # float64 across the chunks in one kernel: sqrt of the sum of the squared chunk norms
    return torch.linalg.vector_norm(rows, dtype=torch.float64).float()


def nonfinite_count(x: torch.Tensor) -> torch.Tensor:
    """float32 scalar: NaN and +-Inf elements of ``x``. ``x * 0`` is 0 exactly where ``x`` is
    finite, and count_nonzero over a tensor of zeros is ~5x faster than ``(~isfinite(x)).sum()``
    on this CPU."""
    return torch.count_nonzero(x * 0).to(torch.float32)


def nonzero_count(x: torch.Tensor) -> torch.Tensor:
    """float32 scalar: non-zero elements of ``x``, as ``sum(|sign(x)|)`` with NaN mapped to 1 first
    (sign(NaN) is 0 on CPU and would count as a zero). ~10x faster than count_nonzero on ReLU
    outputs, whose zero ratio is what matters."""
    return x.nan_to_num(1.0).sign_().abs_().sum()


def _fused_moments(x: torch.Tensor) -> torch.Tensor:
    x = x.float()  # half precision read as float32 inside the kernel: no float32 copy of the tensor
    d = x - x[0]
    n = x.numel()
    s = d.sum()
    mean_d = s / n
    return torch.stack(
        [
            x[0] + mean_d,
            torch.dot(d, d) - s * mean_d,
            x.amin(),
            x.amax(),
            (x == 0).sum().to(torch.float32),
            (~torch.isfinite(x)).sum().to(torch.float32),
        ]
    )


#: dtypes the fused kernel reads as they are (others are upcast to float32 and reduced eagerly)
_FUSED_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))


@contextlib.contextmanager
def _compiled_state(device: torch.device, state: tuple) -> Iterator[None]:
    """No grad, and ``device``'s autocast off with ``state`` = (dtype, cache enabled): the global
    state the fused kernel is compiled and called in."""
    with torch.no_grad(), torch.autocast(device.type, dtype=state[0], enabled=False, cache_enabled=state[1]):
        yield


class Reducer:
    """Computes moments records, eagerly or with a fused kernel compiled off the training thread.

    The fused kernel reads float32, bfloat16 and float16 tensors as they are (half precision is
    upcast inside it, one pass over memory and no float32 copy); it is compiled and checked
    against the eager record for each device and dtype it is to run on, in a background thread,
    and until it is ready for a tensor's device and dtype, that tensor is reduced eagerly. It is
    always called in the grad mode and autocast state it was compiled in (no grad, autocast off
    with that thread's dtype): dynamo guards on both, and a forward pass sets them otherwise. So
    the caller's thread never compiles: a kernel compiled for one device or dtype, or called
    inside the training forward's ``torch.autocast``, would recompile on the caller's thread.

    Args:
        mode: "on" compile now for float32 on the CPU in a background thread, and for any other
            device and dtype the first time one of its tensors is seen; "off" eager only; "auto"
            compile in the background the first time a CUDA tensor of a dtype is seen.
    """

    def __init__(self, mode: str = "auto"):
        self.mode = mode
        self._fused = None  # the compiled function (one for every device and dtype: dynamo keeps a graph each)
        self._ready: frozenset = frozenset()  # (device, dtype) the fused kernel was compiled and checked for
        self._started: set = set()  # (device, dtype) a compile was started for (done, failed or running)
        self._autocast: dict = {}  # device -> (dtype, cache_enabled) of the autocast state it was compiled in
        self._lock = threading.Lock()
        if mode == "on":
            self._start_compile(torch.device("cpu"), torch.float32)

    @property
    def fused_ready(self) -> bool:
        """The fused kernel is ready for some device and dtype."""
        return bool(self._ready)

    def ready_for(self, device, dtype: torch.dtype = torch.float32) -> bool:
        """The fused kernel is ready for ``device`` (a ``torch.device`` or its name; ``"cuda"``
        without an index: for any CUDA device) and ``dtype``: such tensors take it from now on."""
        dev = torch.device(device)
        return any(d.type == dev.type and (dev.index is None or d.index == dev.index) and t == dtype
                   for d, t in self._ready)

    def _start_compile(self, device: torch.device, dtype: torch.dtype) -> None:
        key = (device, dtype)
        with self._lock:
            if key in self._started or self.mode == "off":
                return
            self._started.add(key)

        def build():
            try:
                with self._lock:
                    if self._fused is None:
                        self._fused = torch.compile(_fused_moments, dynamic=True)
                    fn = self._fused
                state = (torch.autocast(device.type, enabled=False).fast_dtype, torch.is_autocast_cache_enabled())
                for n in (4099, 17):  # two sizes so the graph is shape-generic from the start
                    probe = torch.linspace(-1, 1, n, device=device, dtype=dtype)
                    with _compiled_state(device, state):
                        got = fn(probe)
                    want = _eager_moments(probe.float())
                    if not torch.allclose(got, want, rtol=1e-4, atol=1e-3):
                        raise RuntimeError(f"fused kernel disagrees with eager: {got} vs {want}")
                with self._lock:
                    self._autocast.setdefault(device, state)
                    self._ready = self._ready | {key}
                log.info("gradwatch: fused statistics kernel ready on %s for %s", device, dtype)
            except Exception as e:  # compile is an optimisation; eager stays correct
                log.warning("gradwatch: fused statistics unavailable on %s for %s, staying eager (%s)", device, dtype, e)

        log.info("gradwatch: compiling the fused statistics kernel for %s, %s in the background (eager until ready)",
                 device, dtype)
        threading.Thread(target=build, name="gradwatch-compile", daemon=True).start()

    def moments(self, t: torch.Tensor) -> torch.Tensor:
        """Moments record of ``t`` (any shape, floating or complex dtype; complex by magnitude
        ``|z|``) as a float32 tensor of shape [6]. An empty ``t`` gives NaN mean, min and max and
        zero counts (the recorder sends no record for one: it only counts the call)."""
        x = t.detach().reshape(-1)
        if x.is_complex():
            x = x.abs()
        if x.numel() == 0:  # no host-to-device copy: new_full and slicing fill on the device
            out = x.new_full((6,), float("nan"), dtype=torch.float32)
            out[1:2].zero_()
            out[4:].zero_()
            return out
        key = (x.device, x.dtype)
        if key in self._ready:
            with _compiled_state(key[0], self._autocast[key[0]]):
                return self._fused(x)
        if key not in self._started and x.dtype in _FUSED_DTYPES and (self.mode == "on" or (self.mode == "auto" and x.is_cuda)):
            self._start_compile(*key)
        return _eager_moments(x if x.dtype == torch.float32 else x.float())

    @staticmethod
    def sumsq_nonfinite(t: torch.Tensor) -> torch.Tensor:
        """``[sum of squares, non-finite count]`` of ``t`` as float32 [2]; used for gradients.
        The norm is :func:`l2_norms`'s (float64 across chunks). A complex ``t`` counts by magnitude."""
        x = t.detach()
        if x.is_complex():
            x = torch.view_as_real(x)  # |z|^2 = re^2 + im^2: the same sum of squares
        norm = l2_norms([x])[0]
        return torch.stack([norm * norm, nonfinite_count(x)])


def combine_moments(n: np.ndarray, rec: np.ndarray) -> tuple[float, float, float, float, float, float]:
    """Combine per-call moments records of one slot into ``ACT_FIELDS`` of the wire format, by
    the ``combine`` rule each ``act`` row of :data:`gradwatch.columns.STATISTICS` declares.

    Args:
        n: int64 [k] element counts of each call.
        rec: float64 [k, 6] records in ``MOMENT_FIELDS`` order.

    Returns:
        mean (count-weighted), std (population, pooled by Chan et al.), min, max, zero ratio (0-1),
        non-finite count; NaN for the first four and 0 for the others when no element was seen.
    """
    return combine_calls("act", n, rec)
