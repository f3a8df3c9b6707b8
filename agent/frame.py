"""The step frame: a step's statistics as one flat float32 tensor, packed on the device, unpacked on the host.

Copying many small device tensors to the host one by one costs a synchronisation each; the agent
instead concatenates everything a step measured into one flat float32 tensor, copies it once
(non-blocking) and lets the sender thread take it apart. The order of that tensor is a format of
its own, so it is declared once here, in :data:`SECTIONS`, and both sides iterate the declaration:
:func:`pack` (training thread, torch, no host synchronisation) and :func:`unpack` (sender thread,
numpy) are mirror images, and ``tests/test_frame.py`` proves them inverse over random layouts.

A section holds ``count`` items of ``width`` float32 values each. Bit sections carry int64
fingerprints bit-cast to two float32 values each; :func:`unpack` reads them from the raw float32
bytes before any conversion, since a float64 round trip would change NaN payloads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from gradwatch import columns


@dataclass(frozen=True)
class Section:
    """One run of items in the frame.

    Attributes:
        name: key in :func:`pack`'s input and :func:`unpack`'s output.
        width: float32 values per item.
        bits: items are int64 scalars carried bit for bit (``width`` is then 2).
        doc: what an item is.
    """

    name: str
    width: int = 1
    bits: bool = False
    doc: str = ""


SECTIONS: tuple[Section, ...] = (
    Section("grad_norm", doc="L2 norms of each present parameter's gradient chunks (stats.chunk_norms' layout)"),
    Section("bucket_norm", doc="L2 norms of the chunks of each DDP bucket on this rank before all-reduce"),
    Section("loss", doc="each loss passed to observe_loss during the step"),
    Section("loss_scale", doc="the AMP loss scale (0 or 1 item)"),
    Section("grad_nonfinite", doc="NaN and +-Inf elements of each present parameter's gradient"),
    Section("grad_fp", width=2, bits=True, doc="fingerprint of each present parameter's gradient"),
    Section("weight_norm", doc="L2 norm of every parameter after the optimizer step"),
    Section("weight_fp", width=2, bits=True, doc="fingerprint of every parameter after the step"),
    Section("act", width=len(columns.records("act")),
            doc="moments record of each recorded output (the act array's records, stats.MOMENT_FIELDS)"),
    Section("out_grad", width=len(columns.records("act_grad")),
            doc="record of each output gradient: the act_grad array's records (sum of squares, non-finite count)"),
    Section("guard", doc="the NaN guard's sum of each output it saw, in call order (not finite: the output held NaN/Inf)"),
)
NAMES = tuple(s.name for s in SECTIONS)
_NAME_SET = frozenset(NAMES)
_F32 = np.dtype(np.float32)

Counts = Mapping[str, int]  # items per section name; absent sections count 0


def on_device(dev: torch.device, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` on ``dev``: moves only those elsewhere (a model spread over devices)."""
    return [t if t.device == dev else t.to(dev) for t in tensors]


def pack(sections: Mapping[str, Sequence[torch.Tensor]]) -> tuple[torch.Tensor, dict[str, int]]:
    """Concatenate a step's statistics into one flat float32 tensor; training thread, no host sync.

    Args:
        sections: for any names of :data:`SECTIONS`, a sequence of items: float32 tensors of
            ``width`` elements (0-d for width 1; other float dtypes are converted), or 0-d int64
            tensors for bit sections; a width-1 section may also be one 1-D tensor of its items. Items may sit on different devices; everything moves to the
            first item's device.

    Returns:
        ``(flat, counts)``: float32 [sum of count * width] on the first item's device (an empty
        CPU tensor when there is no item), and the item count of every section, for :func:`unpack`.

    Raises:
        KeyError: a name not in :data:`SECTIONS`.
        TypeError: a bit section's items are not int64, or a tensor is given for a section that
            is not width 1.
    """
    if not _NAME_SET.issuperset(sections):
        raise KeyError(f"not a frame section: {sorted(set(sections) - _NAME_SET)}")
    parts: list[torch.Tensor] = []
    counts: dict[str, int] = dict.fromkeys(NAMES, 0)
    scalars: list[torch.Tensor] = []  # consecutive width-1 items: one stack for the run (fewer kernels)
    dev = None
    for s in SECTIONS:  # every step runs this loop: the sentinel's cost is mostly Python, keep it lean
        items = sections.get(s.name)
        if isinstance(items, torch.Tensor):  # a width-1 run already stacked on the device
            if s.width != 1 or s.bits or items.dim() != 1:
                raise TypeError(f"frame section {s.name}: a tensor is taken only as a 1-D run of width-1 items")
            if not items.numel():
                continue
            counts[s.name] = items.numel()
            dev = items.device if dev is None else dev
            if scalars:
                parts.append(_floats(torch.stack(scalars)))
                scalars = []
            parts.append(_floats(items if items.device == dev else items.to(dev)))
            continue
        if not items:
            continue
        if not isinstance(items, (list, tuple)):
            items = list(items)
        counts[s.name] = len(items)
        dev = items[0].device if dev is None else dev
        if s.width == 1 and not s.bits:
            scalars += on_device(dev, items)
            continue
        if scalars:
            parts.append(_floats(torch.stack(scalars)))
            scalars = []
        x = torch.stack(on_device(dev, items))  # one call per section: a call per item costs ~6x more
        if s.bits:  # same bytes, two float32 values each: exact through the float32 copy
            if x.dtype != torch.int64:
                raise TypeError(f"frame section {s.name} takes int64 items, got {x.dtype}")
            x = x.view(torch.float32)
        parts.append(_floats(x))
    if scalars:
        parts.append(_floats(torch.stack(scalars)))
    if not parts:
        return torch.empty(0), counts
    return (torch.cat(parts) if len(parts) > 1 else parts[0]), counts


def _floats(x: torch.Tensor) -> torch.Tensor:
    x = x if x.dtype == torch.float32 else x.float()
    return x if x.dim() == 1 else x.reshape(-1)


def to_host(flat: torch.Tensor) -> tuple[torch.Tensor, Optional[Callable[[], bool]]]:
    """Start copying a packed frame to the host without waiting for it.

    Returns:
        ``(host, ready)``: for a CUDA ``flat``, a pinned float32 CPU tensor being filled by a
        non-blocking copy and ``ready``, a CUDA event's ``query`` that turns true once the copy
        landed (poll it, never wait: a collective stuck on the device must not stop the caller);
        otherwise ``flat`` itself and None.
    """
    if not flat.is_cuda:
        return flat, None
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(flat.device))  # the stream the copy runs on
    return host, event.query


def size(counts: Counts) -> int:
    """float32 values in a frame of these ``counts``."""
    return _plan(tuple(counts.items()))[0]


@functools.lru_cache(maxsize=64)
def _plan(items: tuple[tuple[str, int], ...]) -> tuple[int, tuple[tuple[str, int, int, int, int, bool], ...]]:
    """``(size, ((name, start, stop, count, width, bits), ...))`` of a frame of ``counts.items()``. A
    rank's sentinel frames share one layout, so the sender thread works it out once, not every step."""
    counts = dict(items)
    out, off = [], 0
    for s in SECTIONS:
        n = counts.get(s.name, 0)
        out.append((s.name, off, off + n * s.width, n, s.width, s.bits))
        off += n * s.width
    return off, tuple(out)


def unpack(host: np.ndarray, counts: Counts) -> dict[str, np.ndarray]:
    """Split a frame copied to the host back into its sections; the mirror of :func:`pack`.

    Args:
        host: float32 [size(counts)], the flat tensor as numpy.
        counts: what :func:`pack` returned with it.

    Returns:
        Every name of :data:`SECTIONS`: float64 [count] for width 1, float64 [count, width]
        otherwise, uint64 [count] for bit sections (empty when the section was absent). The
        float64 sections are views of one float64 copy of the frame.

    Raises:
        ValueError: ``host`` is not float32 or its length does not match ``counts``.
    """
    raw = np.ascontiguousarray(host).reshape(-1)
    total, plan = _plan(tuple(counts.items()))
    if raw.dtype != _F32 or raw.size != total:
        raise ValueError(f"frame of {raw.size} {raw.dtype} values, counts say {total} float32")
    # one conversion for the frame: the sender builds a report every step, and a conversion (and
    # an errstate) per section cost more than the arithmetic on these few values
    with np.errstate(invalid="ignore"):  # a signalling NaN is still just NaN here
        values = raw.astype(np.float64)
    out: dict[str, np.ndarray] = {}
    for name, start, stop, n, width, bits in plan:
        if bits:  # from the raw float32 bytes: these may read as NaN floats
            out[name] = raw[start:stop].view(np.uint64).copy()
        else:
            v = values[start:stop]
            out[name] = v if width == 1 else v.reshape(n, width)
    return out
