"""Module and tensor hooks of a probed step.

During a probed step every leaf module gets one forward hook. The hook walks the module's output
(tensors, tuples, lists, dicts, named tuples, dataclasses, None; case C04), records a moments
record per floating tensor, and puts a tensor hook on each tensor that requires grad to record the
norm of its gradient. No module full backward hooks (cases C01, C06, C15): tensor hooks fire for
any container, keep no ``grad_output`` alive, and do not change the identity of inputs or outputs.
Hooks return ``None`` and never rebuild the user's objects.

Everything recorded stays on the device as small tensors in :class:`ProbeRecorder`; nothing here
calls ``.item()``, ``.cpu()`` or any other host synchronisation (case C22).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Callable, Iterator

import torch

from .stats import Reducer

log = logging.getLogger("gradwatch.agent")

_MAX_DEPTH = 6


def iter_tensors(obj: Any, path: str = "", depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path suffix, tensor)`` for every floating tensor inside a module output.

    Paths: ``""`` for a bare tensor, ``[i]`` for sequence items, ``.key`` for dict keys, named
    tuple fields and dataclass fields (``.logits``, ``[1][0]``). Non-tensors are skipped.
    """
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield path, obj
        return
    if depth >= _MAX_DEPTH or obj is None:
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{path}.{k}", depth + 1)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple, e.g. PackedSequence
        for k in obj._fields:
            yield from iter_tensors(getattr(obj, k), f"{path}.{k}", depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{path}[{i}]", depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None), f"{path}.{f.name}", depth + 1)


class ProbeRecorder:
    """Collects the device-side records of one probed step.

    Slots are (module path, output path) pairs, numbered in the order first seen in a forward
    pass; ``slots`` grows when a new one appears (the monitor then resends the schema).
    ``act`` holds ``(slot, numel, record[6])`` per call and ``grad`` holds ``(slot, record[2])``
    per gradient; both lists only ever receive tensors that are already reduced. ``micro`` counts
    forward passes with gradients and ``batch`` the samples they saw (first dimension of the
    model's first input).

    :meth:`install` puts a forward hook on every leaf module of ``model`` (one that refuses is
    listed in ``not_instrumented``, case C17) and a pre-hook on the model counting micro-steps;
    :meth:`remove` takes them off. ``model`` is held weakly.
    """

    def __init__(self, reducer: Reducer, on_error: Callable[[str, BaseException], None],
                 model: torch.nn.Module | None = None):
        self.reducer = reducer
        self.on_error = on_error
        self.disabled: set[str] = set()  # parts the monitor switched off ("forward", "output-grad")
        self.slots: list[tuple[str, str, str, str]] = []
        self._slot_index: dict[tuple[str, str], int] = {}
        self.act: list[tuple[int, int, torch.Tensor]] = []
        self.grad: list[tuple[int, torch.Tensor]] = []
        self.micro = 0
        self.batch = 0
        self.probing = False
        self.not_instrumented: list[str] = []
        self._model = weakref.ref(model) if model is not None else lambda: None
        self._leaves = [(path, weakref.ref(m)) for path, m in leaf_modules(model)] if model is not None else []
        self._handles: list = []

    def reset(self) -> None:
        self.act = []
        self.grad = []
        self.micro = 0
        self.batch = 0

    def install(self) -> None:
        """Hooks on for a probed step (records reset)."""
        self.probing = True
        self.reset()
        for path, ref in self._leaves:
            m = ref()
            if m is None:
                continue
            try:
                self._handles.append(m.register_forward_hook(self.forward_hook(path)))
            except Exception:  # e.g. a TorchScript submodule (case C17)
                if path not in self.not_instrumented:
                    self.not_instrumented.append(path)
        root = self._model()
        if root is not None:
            try:
                self._handles.append(root.register_forward_pre_hook(self._count_micro_step))
            except Exception:
                pass

    def remove(self) -> None:
        """Hooks off; records are kept until :meth:`reset`."""
        self.probing = False
        for h in self._handles:
            h.remove()
        self._handles = []

    def _count_micro_step(self, module, args) -> None:
        if torch.is_grad_enabled():
            self.micro += 1
            if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
                self.batch += args[0].shape[0]

    def slot(self, module_path: str, out_path: str, module: torch.nn.Module, t: torch.Tensor) -> int:
        key = (module_path, out_path)
        i = self._slot_index.get(key)
        if i is None:
            i = self._slot_index[key] = len(self.slots)
            self.slots.append((module_path, out_path, type(module).__name__, str(t.dtype).replace("torch.", "")))
        return i

    def forward_hook(self, module_path: str) -> Callable:
        recorder_ref = weakref.ref(self)  # a hook must not keep the agent alive (case C16)

        def hook(module, args, output):
            rec = recorder_ref()
            if rec is None or not torch.is_grad_enabled() or "forward" in rec.disabled:
                return None  # evaluation under no_grad is not training data (case C16, C19)
            try:
                for out_path, t in iter_tensors(output):
                    i = rec.slot(module_path, out_path, module, t)
                    lt = _local(t)
                    rec.act.append((i, lt.numel(), rec.reducer.moments(lt)))
                    if t.requires_grad and "output-grad" not in rec.disabled:
                        t.register_hook(rec._grad_hook(i))
            except Exception as e:
                rec.on_error(f"forward:{module_path}", e)
            return None

        return hook

    def _grad_hook(self, i: int) -> Callable:
        recorder_ref = weakref.ref(self)

        def hook(grad):
            rec = recorder_ref()
            if rec is not None and grad is not None:
                try:
                    rec.grad.append((i, rec.reducer.sumsq_nonfinite(_local(grad))))
                except Exception as e:
                    rec.on_error("output-grad", e)
            return None

        return hook


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (tensor parallel outputs); any other tensor as it is."""
    lt = getattr(t, "_local_tensor", None)
    return lt if isinstance(lt, torch.Tensor) else t


def leaf_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(normalised path, module)`` of every module without children, in registration order."""
    out = []
    for name, m in model.named_modules():
        if next(m.children(), None) is None and name:
            out.append((normalise(name), m))
    return out


_WRAPPERS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def normalise(name: str) -> str:
    """Drop wrapper segments (torch.compile ``_orig_mod``, FSDP, checkpointing) from a module path,
    so a path names the same layer whatever wraps it (case C34)."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPERS)
