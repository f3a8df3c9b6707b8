"""What the agent attaches to: the optimizer whose step runs and the DDP wrapper around the model,
found inside what training frameworks hand the user.

Frameworks wrap both. accelerate's ``AcceleratedOptimizer`` is a ``torch.optim.Optimizer``
subclass that never ran ``Optimizer.__init__`` (it has no step hooks) and steps the optimizer it
holds as ``.optimizer`` only when gradients are synchronised; Lightning's ``LightningOptimizer``
is no optimizer at all and holds the real one as ``._optimizer``; DeepSpeed's optimizers hold
theirs as ``.optimizer``. :func:`real_optimizer` follows those references to the first object that
is a torch optimizer with step hooks, whose step is then the step boundary.

The module a framework or a script hands over is often the one *inside*
``DistributedDataParallel`` (Hugging Face's Trainer passes callbacks ``trainer.model``, not
``trainer.model_wrapped``; a script may attach before wrapping). :class:`FollowDDP` finds the
wrapper when it first runs the module: DDP's ``forward`` calls the module from a frame whose
``self`` is the wrapper, a few frames above the module's forward pre-hook.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch

from .hooks import Hook

#: attributes a wrapper keeps the optimizer it wraps in, tried in this order
INNER_OPTIMIZER = ("optimizer", "_optimizer")
#: wrappers followed at most (a reference cycle must not loop)
MAX_WRAPPERS = 8
#: frames above the module's forward pre-hook searched for the DDP wrapper's ``self``: the hook,
#: ``Module._call_impl``, ``Module._wrapped_call_impl``, then DDP's ``_run_ddp_forward`` and ``forward``
MAX_FRAMES = 12


def has_step_hooks(optimizer) -> bool:
    """Whether ``optimizer`` is a torch optimizer that ran ``Optimizer.__init__`` (it keeps its
    step hooks in its instance dictionary, made there)."""
    return isinstance(optimizer, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in vars(optimizer)


def real_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer whose ``step`` applies the update: ``optimizer`` itself when it is one
    with step hooks, else the one a wrapper holds (:data:`INNER_OPTIMIZER`, followed up to
    :data:`MAX_WRAPPERS` deep).

    Raises:
        TypeError: neither ``optimizer`` nor anything it wraps is a torch optimizer with step
            hooks; the message names each type followed.
    """
    seen = []
    o = optimizer
    for _ in range(MAX_WRAPPERS + 1):
        seen.append(type(o).__name__)
        if has_step_hooks(o):
            return o
        inner = next((getattr(o, a) for a in INNER_OPTIMIZER if getattr(o, a, None) is not None), None)
        if inner is None or inner is o:
            break
        o = inner
    raise TypeError(
        f"optimizer: {' -> '.join(seen)} is no torch.optim.Optimizer with step hooks (one that ran "
        f"Optimizer.__init__), nor does it hold one as {' or '.join('.' + a for a in INNER_OPTIMIZER)}: "
        "pass the optimizer whose step() updates the parameters")


def wrapped_scaler(optimizer):
    """The loss scaler a framework's optimizer wrapper steps with (accelerate's
    ``AcceleratedOptimizer.scaler``: a ``torch.amp.GradScaler`` under fp16), found along the same
    chain as :func:`real_optimizer`; None when there is none."""
    o = optimizer
    for _ in range(MAX_WRAPPERS + 1):
        if has_step_hooks(o):
            return None
        scaler = getattr(o, "scaler", None)
        if scaler is not None and callable(getattr(scaler, "update", None)) and hasattr(scaler, "_scale"):
            return scaler
        o = next((getattr(o, a) for a in INNER_OPTIMIZER if getattr(o, a, None) is not None), None)
        if o is None:
            return None
    return None


def ddp_above(module: torch.nn.Module, frame=None, depth: int = MAX_FRAMES) -> Optional[torch.nn.Module]:
    """The ``DistributedDataParallel`` whose forward is running ``module`` (directly or through
    ``torch.compile``/Lightning-style wrappers it unwraps to), found as the ``self`` of one of
    the ``depth`` frames above ``frame`` (default: the caller's); None when there is none."""
    from .ddp import unwrap

    f = frame if frame is not None else sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return None
        s = f.f_locals.get("self")
        if isinstance(s, torch.nn.parallel.DistributedDataParallel) and _holds(s, module, unwrap):
            return s
        f = f.f_back
    return None


def _holds(ddp: torch.nn.Module, module: torch.nn.Module, unwrap: Callable) -> bool:
    inner = ddp.module
    for _ in range(MAX_WRAPPERS):
        if inner is module or unwrap(inner) is module:
            return True
        nxt = getattr(inner, "module", None)  # Lightning's wrapper of the LightningModule
        if not isinstance(nxt, torch.nn.Module):
            return False
        inner = nxt
    return False


class FollowDDP:
    """A one-time forward pre-hook on the module the agent was given that finds the DDP wrapper
    running it (:func:`ddp_above`) and hands it to ``found``; it then removes itself. Its first
    call without a wrapper above calls ``missing`` instead. Calls while torch.compile traces are
    skipped (and the hook stays, so the traced graph never changes: see :mod:`.hooks`).

    Args:
        module: the root module the agent instruments (not DDP).
        found: ``ddp -> None``, called once on the training thread.
        missing: ``() -> None``, called once when the first call has no DDP above it.
        on_error: ``(where, exc) -> None``; the hook never raises.
    """

    def __init__(self, module: torch.nn.Module, found: Callable, missing: Callable[[], None],
                 on_error: Callable[[str, BaseException], None]):
        self._module = module
        self._found, self._missing, self._on_error = found, missing, on_error
        self._traced = False
        self._handle = module.register_forward_pre_hook(Hook(self._pre))

    def _pre(self, module, args) -> None:
        if self._handle is None:  # done; left in place because torch.compile traced it
            return None
        if torch.compiler.is_compiling():
            self._traced = True
            return None
        found, missing = self._found, self._missing
        try:
            ddp = ddp_above(module, sys._getframe(1))
            self.remove(keep_traced=True)
            if ddp is not None:
                found(ddp)
            else:
                missing()
        except Exception as e:
            self.remove(keep_traced=True)
            self._on_error("follow-ddp", e)
        return None

    def remove(self, keep_traced: bool = False) -> None:
        """Remove the hook, unless ``keep_traced`` and torch.compile traced it (removing it would
        recompile the user's graphs); a traced hook that stays does nothing more."""
        h, self._handle = self._handle, None
        self._found = self._missing = _nothing
        if h is not None and not (keep_traced and self._traced):
            h.remove()


def _nothing(*_args) -> None:
    return None
