"""Module and tensor hooks of a probed step, and the NaN guard of the others.

During a probed step's training forward every leaf module gets one forward hook (see
:class:`ProbeRecorder` for when hooks come and go). The hook walks the module's output
(tensors, tuples, lists, dicts, named tuples, dataclasses, None; case C04), records a moments
record per floating or complex tensor, and puts a tensor hook on each tensor that requires grad to record the
norm of its gradient. No module full backward hooks (cases C01, C06, C15): tensor hooks fire for
any container, keep no ``grad_output`` alive, and do not change the identity of inputs or outputs.
Hooks return ``None`` and never rebuild the user's objects.

With the NaN guard on, the same hook stays in place at unprobed steps and records one value per
floating output of a known slot: its sum (float32 for half precision). A sum is NaN or Inf exactly
when the output held a NaN or an Inf (or, in float32, overflowed past 3.4e38), so the first slot
whose sum is not finite is the module a forward NaN came from, at any step; the sum costs one
read of the output right after the module wrote it (in cache) and one small kernel, and no host
synchronisation.

Everything recorded stays on the device as small tensors in :class:`ProbeRecorder`; nothing here
calls ``.item()``, ``.cpu()`` or any other host synchronisation (case C22).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import time
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

from .amp import Unscale
from .stats import Reducer

log = logging.getLogger("gradwatch.agent")

_MAX_DEPTH = 6


def inert(*args, **kwargs) -> None:
    """What a copy of a module gets in place of each of the agent's hooks. Called as a module
    hook, it takes every such stand-in off the module it was called for and off its submodules,
    so a copy's first call leaves it as if the agent had never been there (hooks on a module turn
    off fused fast paths such as ``nn.TransformerEncoderLayer``'s); it returns None."""
    m = args[0] if args else None
    if isinstance(m, torch.nn.Module):
        for sub in m.modules():
            for hooks in (sub._forward_pre_hooks, sub._forward_hooks):
                for k in [k for k, h in hooks.items() if h is inert]:
                    del hooks[k]
                    for extra in (sub._forward_pre_hooks_with_kwargs, sub._forward_hooks_with_kwargs,
                                  getattr(sub, "_forward_hooks_always_called", {})):
                        extra.pop(k, None)
    return None


def _inert():
    return inert


class Hook:
    """One of the agent's module hooks as the module keeps it: calls ``fn``. A copy of the module
    (``copy.deepcopy``, an EMA or evaluation copy) or a pickle of it (``torch.save(model)``) gets
    :func:`inert` in its place, so copying or saving a watched model works, never copies the
    agent's state (its locks would refuse), and the copy is not watched; its first call removes
    the stand-ins. Loading such a pickle imports gradwatch (``state_dict()`` checkpoints hold no
    hooks)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo):
        return inert

    def __reduce__(self):
        return _inert, ()


def iter_tensors(obj: Any, path: str = "", depth: int = 0, *, every_dtype: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path suffix, tensor)`` for every floating tensor inside a module output.

    Paths: ``""`` for a bare tensor, ``[i]`` for sequence items, ``.key`` for dict keys, named
    tuple fields and dataclass fields (``.logits``, ``[1][0]``). Non-tensors are skipped; with
    ``every_dtype`` tensors of any dtype (complex, integer, bool) are yielded too.
    """
    if isinstance(obj, torch.Tensor):
        if every_dtype or obj.is_floating_point():
            yield path, obj
        return
    if depth >= _MAX_DEPTH or obj is None:
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{path}.{k}", depth + 1, every_dtype=every_dtype)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple, e.g. PackedSequence
        for k in obj._fields:
            yield from iter_tensors(getattr(obj, k), f"{path}.{k}", depth + 1, every_dtype=every_dtype)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{path}[{i}]", depth + 1, every_dtype=every_dtype)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None), f"{path}.{f.name}", depth + 1, every_dtype=every_dtype)


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread: a forward hook firing
    then is activation checkpointing recomputing a forward (``torch.utils.checkpoint``)."""
    return torch._C._current_graph_task_id() != -1


def first_batch(args: tuple, kwargs: dict) -> int:
    """Samples in a root call: the first dimension of its first tensor argument of at least one
    dimension, positional first, then keyword (``model(input_ids=..., labels=...)``); where no
    argument is such a tensor, the first one inside a tuple, list or dict argument (Lightning's
    ``training_step(batch, batch_idx)`` with ``batch = (x, y)``); 0 if none."""
    values = (*args, *kwargs.values())
    for a in values:
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            return a.shape[0]
    for a in values:
        items = a.values() if isinstance(a, dict) else a if isinstance(a, (tuple, list)) else ()
        for t in items:
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                return t.shape[0]
    return 0


class ProbeRecorder:
    """Collects the device-side records of one probed step.

    Slots are (module path, output path) pairs, numbered in the order first seen in a forward
    pass; ``slots`` grows when a new one appears (the monitor then resends the schema).
    ``act`` holds ``(slot, numel, record[6])`` per call and non-empty floating or complex output
    (complex by magnitude), ``grad`` holds ``(slot, record[2])`` per gradient; both lists only
    ever receive tensors that are already reduced. ``counts`` maps a slot to ``[calls, elements]``
    (host integers): every call counts on each of its module's slots, including an empty output
    (no ``act`` record: nothing to summarise) and a module whose output holds no floating tensor
    (one slot ``(module, "")`` typed by its first tensor's dtype, or ``"none"``). ``micro`` counts
    forward passes with gradients and ``batch`` the samples they saw (:func:`first_batch`).

    Hooks: :meth:`install` puts a forward pre-hook and an always-called forward hook
    on the model and a forward hook on every instrumented module (leaves, and atomic modules such
    as ``nn.MultiheadAttention`` whose children are not called as modules; one that refuses is
    listed in ``not_instrumented``, case C17). The root's pre-hook takes the module hooks off
    whenever the model runs outside a training forward (a root call with grad enabled), so
    evaluation inside a probe window keeps PyTorch's fused fast paths (they refuse modules with
    hooks), and puts them back for the next training forward. Inside a training forward every
    output is recorded, also under ``no_grad`` (``checkpoint(use_reentrant=True)`` runs the first
    forward so); a forward hook that fires while backward runs is a checkpoint recomputing that
    forward: it records nothing again and only puts gradient hooks on outputs of known slots
    (which fire in the reentrant variant, whose recomputed outputs carry the gradient, and
    never in the non-reentrant one). :meth:`remove` takes every hook off. ``model`` is held weakly.

    The NaN guard (:meth:`set_guard`): while it is on, the hooks stay in place at unprobed steps
    too (taken off for evaluation as above), and each training forward call appends to ``guarded``
    the slot and to ``sums`` the sum (0-d float32 or float64 device tensor) of each floating output
    of a slot a probed step has seen (a slot the schema does not list yet cannot be named);
    ``guard_s`` is the host time the guard took since the last reset.

    Under ``torch.compile`` every hook returns at its first line, a test of
    ``torch.compiler.is_compiling()`` that dynamo folds to a constant while tracing: the compiled
    graphs are those of the model without the agent, and adding or removing hooks recompiles
    nothing: the root's hooks record that they were traced (``compiled``), and from then on
    :meth:`install` and :meth:`remove` leave every hook in place (dynamo guards on the number of
    hooks a module has) until the monitor closes. Modules inside a compiled region therefore get
    no per-layer statistics; see docs/agent.md: torch.compile.
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
        self.counts: dict[int, list[int]] = {}
        self.micro = 0
        self.batch = 0
        self.host_s = 0.0  # seconds spent in this recorder's hooks since the last reset (the budget's)
        # output gradients are divided by a huge loss scale before their sums of squares (the
        # monitor's .amp.Unscale, shared with the DDP hook)
        self.unscale = Unscale()
        self.probing = False
        self.guard = False  # the NaN guard: hooks stay on at unprobed steps (set_guard)
        self.guarded: list[int] = []
        self.sums: list[torch.Tensor] = []
        self.guard_s = 0.0
        self.not_instrumented: list[str] = []
        self._model = weakref.ref(model) if model is not None else lambda: None
        self._leaves = [(path, weakref.ref(m)) for path, m in leaf_modules(model)] if model is not None else []
        self._handles: list = []  # the root's
        self._leaf_handles: list = []
        self._in_forward = False  # a training forward of the root is running
        self.compiled = False  # torch.compile traced the root: hooks stay as they are until close
        self.only_layers: Optional[tuple[str, ...]] = None  # fnmatch patterns of the leaves hooked (only())

    def reset(self) -> None:
        self.act = []
        self.grad = []
        self.counts = {}
        self.micro = 0
        self.batch = 0
        self._in_forward = False
        self.host_s = 0.0
        self.guarded = []
        self.sums = []
        self.guard_s = 0.0

    def install(self) -> None:
        """Hooks on for a probed step (records reset)."""
        self.probing = True
        self.reset()
        self._hooks_on()

    def set_guard(self, on: bool) -> None:
        """The NaN guard on or off (class doc); hooks follow unless a probe holds them."""
        self.guard = on
        if on:
            self._hooks_on()
        elif not self.probing:
            self.remove()

    def _hooks_on(self) -> None:
        self._leaves_on()
        root = self._model()
        if root is not None and not self._handles:  # kept in place for a compiled model
            try:
                self._handles.append(root.register_forward_pre_hook(Hook(self._root_pre), with_kwargs=True))
                self._handles.append(root.register_forward_hook(Hook(self._root_post), always_call=True))
            except Exception:
                pass

    def remove(self, final: bool = False) -> None:
        """Hooks off (with a compiled model only at ``final``, see the class doc; with the guard
        on, the end of the probe only); records are kept until :meth:`reset`."""
        self.probing = False
        self._in_forward = False
        if final:
            self.guard = False
        if (self.compiled or self.guard) and not final:
            return
        self.compiled = False
        self._leaves_off()
        for h in self._handles:
            h.remove()
        self._handles = []

    def only(self, patterns: Optional[tuple[str, ...]]) -> None:
        """Hook only the leaf modules whose path matches one of ``patterns`` (fnmatch; None: every
        leaf), from now on: hooks in place are put back on the leaves chosen (a compiled model's
        stay as they are, see the class doc)."""
        if patterns == self.only_layers:
            return
        self.only_layers = patterns
        if self._leaf_handles and not self.compiled:
            self._leaves_off()
            self._leaves_on()

    def _leaves_on(self) -> None:
        if self._leaf_handles or self.compiled:
            return
        only = self.only_layers
        for path, ref in self._leaves:
            if only is not None and not any(fnmatch.fnmatchcase(path, p) for p in only):
                continue
            m = ref()
            if m is None:
                continue
            try:
                self._leaf_handles.append(m.register_forward_hook(Hook(self.forward_hook(path))))
            except Exception:  # e.g. a TorchScript submodule (case C17)
                if path not in self.not_instrumented:
                    self.not_instrumented.append(path)

    def _leaves_off(self) -> None:
        if self.compiled:
            return
        for h in self._leaf_handles:
            h.remove()
        self._leaf_handles = []

    def _root_pre(self, module, args, kwargs) -> None:
        if torch.compiler.is_compiling():  # traced by torch.compile: step aside (see class doc)
            self.compiled = True  # an attribute store: dynamo replays it, no graph break
            return None
        t0 = time.perf_counter()
        try:
            # grad enabled, as the micro-step count always meant (case C16, C19); a fused fast path
            # needs grad off too (or every parameter frozen: then this hook does block it)
            training = torch.is_grad_enabled() and not _in_backward()
            self._in_forward = training
            if training:
                self._leaves_on()
                self.micro += 1
                self.batch += first_batch(args, kwargs)
            else:  # evaluation: no hook may change which kernels run (fused fast paths)
                self._leaves_off()
        except Exception as e:
            self.on_error("forward", e)
        if not self.probing:  # between probes the root's hooks are there for the guard: its cost
            self.guard_s += time.perf_counter() - t0
        return None

    def _root_post(self, module, args, output) -> None:
        if torch.compiler.is_compiling():
            self.compiled = True
            return None
        self._in_forward = False
        return None

    def slot(self, module_path: str, out_path: str, module: torch.nn.Module, t: Optional[torch.Tensor]) -> int:
        key = (module_path, out_path)
        i = self._slot_index.get(key)
        if i is None:
            i = self._slot_index[key] = len(self.slots)
            dtype = "none" if t is None else str(t.dtype).replace("torch.", "")
            self.slots.append((module_path, out_path, type(module).__name__, dtype))
        return i

    def _count(self, i: int, numel: int) -> None:
        c = self.counts.get(i)
        if c is None:
            self.counts[i] = [1, numel]
        else:
            c[0] += 1
            c[1] += numel

    def forward_hook(self, module_path: str) -> Callable:
        recorder_ref = weakref.ref(self)  # a hook must not keep the agent alive (case C16)

        def hook(module, args, output):
            if torch.compiler.is_compiling():
                return None
            rec = recorder_ref()
            if rec is None:
                return None
            if not rec.probing:  # hooks in place between probes: the NaN guard's
                if rec.guard:
                    rec._guard(module_path, output, time.perf_counter())
                return None
            if "forward" in rec.disabled:
                return None
            t0 = time.perf_counter()
            try:
                if _in_backward():  # checkpoint recomputation: recorded in forward already
                    rec._recomputed(module_path, output)
                    return None
                if not (rec._in_forward or torch.is_grad_enabled()):
                    return None  # evaluation under no_grad is not training data (case C16, C19)
                other = None
                found = False
                for out_path, t in iter_tensors(output, every_dtype=True):
                    if not (t.is_floating_point() or t.is_complex()):
                        other = t if other is None else other
                        continue
                    found = True
                    i = rec.slot(module_path, out_path, module, t)
                    lt = _local(t)  # tensor parallel: this rank's part
                    n = lt.numel()
                    rec._count(i, n)
                    if n:
                        rec.act.append((i, n, rec.reducer.moments(lt)))
                    if t.requires_grad and "output-grad" not in rec.disabled:
                        t.register_hook(rec._grad_hook(i))
                if not found:  # the module ran: its call counts even without a floating output
                    rec._count(rec.slot(module_path, "", module, other), 0)
            except Exception as e:
                rec.on_error(f"forward:{module_path}", e)
            rec.host_s += time.perf_counter() - t0
            return None

        return hook

    def _guard(self, module_path: str, output: Any, t0: float) -> None:
        """The NaN guard's record of one call (class doc): a sum per floating output of a known
        slot, at most :data:`MAX_GUARDED` a step (a forward loop that never steps the optimizer
        must not grow them); ``t0`` is when the hook was entered."""
        if "guard" in self.disabled or len(self.guarded) >= MAX_GUARDED:
            return
        try:
            if not _in_backward() and (self._in_forward or torch.is_grad_enabled()):
                index = self._slot_index
                for out_path, t in iter_tensors(output):
                    i = index.get((module_path, out_path))
                    if i is None or t.dtype not in _SUMMED:
                        continue
                    lt = _local(t).detach()
                    self.guarded.append(i)
                    self.sums.append(_finite_sum(lt))
        except Exception as e:
            self.on_error(f"guard:{module_path}", e)
        self.guard_s += time.perf_counter() - t0

    def _recomputed(self, module_path: str, output: Any) -> None:
        if "output-grad" in self.disabled:
            return
        for out_path, t in iter_tensors(output, every_dtype=True):
            i = self._slot_index.get((module_path, out_path))
            if i is not None and t.requires_grad:
                t.register_hook(self._grad_hook(i))

    def _grad_hook(self, i: int) -> Callable:
        recorder_ref = weakref.ref(self)

        def hook(grad):
            rec = recorder_ref()
            if rec is not None and grad is not None:
                t0 = time.perf_counter()
                try:
                    rec.grad.append((i, rec.reducer.sumsq_nonfinite(rec.unscale.apply(_local(grad)))))
                except Exception as e:
                    rec.on_error("output-grad", e)
                rec.host_s += time.perf_counter() - t0
            return None

        return hook


#: outputs the NaN guard sums (float8 types cannot be summed; complex outputs are not guarded)
_SUMMED = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
#: the NaN guard's sums a step holds at most
MAX_GUARDED = 4096


def _finite_sum(t: torch.Tensor) -> torch.Tensor:
    """A 0-d device tensor that is finite exactly when ``t`` (float16/32/64, bfloat16) holds no
    NaN or Inf (barring a float32 sum past 3.4e38): its sum, accumulated in float32 for half
    precision (a float16 sum overflows at 65,504); a float64 sum times 0, which keeps NaN and Inf
    (as NaN) and makes every finite sum 0, so the frame's float32 cannot overflow it."""
    if t.dtype == torch.float32:
        return t.sum()
    if t.dtype == torch.float64:
        return t.sum() * 0.0
    return t.sum(dtype=torch.float32)

#: modules recorded as one unit although they have children: their children are not called as
#: modules (``nn.MultiheadAttention`` uses ``out_proj``'s weights through a functional call)
ATOMIC = (torch.nn.MultiheadAttention,)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (tensor parallel outputs); any other tensor as it is."""
    lt = getattr(t, "_local_tensor", None)
    return lt if isinstance(lt, torch.Tensor) else t


def leaf_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(normalised path, module)`` of every module without children and every :data:`ATOMIC`
    module (not its descendants), in registration order."""
    out = []
    atomic: list[str] = []
    for name, m in model.named_modules():
        if not name or any(name.startswith(a + ".") for a in atomic):
            continue
        if isinstance(m, ATOMIC):
            atomic.append(name)
            out.append((normalise(name), m))
        elif next(m.children(), None) is None:
            out.append((normalise(name), m))
    return out


_WRAPPERS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def normalise(name: str) -> str:
    """Drop wrapper segments (torch.compile ``_orig_mod``, FSDP, checkpointing) from a module path,
    so a path names the same layer whatever wraps it (case C34)."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPERS)
