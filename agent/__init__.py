"""gradwatch agent: runs inside every rank's training process.

    import gradwatch.agent as gw
    monitor = gw.attach(model, optimizer)          # or: with gw.attach(...) as monitor:
    ...train...
    monitor.close()                                # removes every hook and thread

Errors: :func:`attach` raises :class:`ConfigError` for an invalid setting (at start-up, naming
it), unless the agent is switched off (``enabled`` false, or ``GRADWATCH_ENABLED=0``): the off
switch works whatever else is set, so an operator can get a job past a bad variable. Nothing else
the agent does raises into the training loop: failures are counted and warned about once
(``RuntimeWarning``), and the failing part is switched off.
"""

from __future__ import annotations

import logging
import os
import warnings

from pydantic import TypeAdapter, ValidationError

from gradwatch.errors import Halt

from .config import AgentConfig, ConfigError, load

__all__ = ["attach", "AgentConfig", "ConfigError", "Halt", "Monitor", "NullMonitor"]

log = logging.getLogger("gradwatch.agent")


def attach(model, optimizer, *, scaler=None, mesh=None, **settings):
    """Attach the agent to ``model`` (plain or DistributedDataParallel) and its ``optimizer``.

    Args:
        model: the ``torch.nn.Module`` being trained, optionally wrapped in DDP or torch.compile;
            the module inside DDP works too (a framework's callback gets that one): the wrapper is
            found when it first runs the module (:class:`.targets.FollowDDP`).
        optimizer: its ``torch.optim.Optimizer``, or a framework's wrapper of one (accelerate's
            ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``, DeepSpeed's): the step of
            the optimizer inside (:func:`.targets.real_optimizer`) marks the step boundary. A
            ``step(closure)`` (Lightning, LBFGS) is measured after its closure ran.
        scaler: the ``torch.amp.GradScaler``, if the script uses one (found by itself inside
            accelerate's optimizer wrapper): steps it skips (inf/NaN gradients) are then counted
            and labelled instead of reported, and reports carry the loss scale.
        mesh: the job's whole ``torch.distributed.DeviceMesh``, when the model alone does not show
            it: pipeline parallelism with plain (DDP or unsharded) stages, whose stage dimension
            must be named ``pp``. Under FSDP2, HSDP and tensor parallelism it is found from the
            parameters (the root of their DTensors' mesh); give it anyway to be explicit.
        **settings: any field of :class:`AgentConfig` (``endpoint``, ``every``, ``job``, ...);
            unset fields come from ``GRADWATCH_*`` variables, then torchrun's environment.

    Returns:
        A :class:`Monitor` (a context manager), or a :class:`NullMonitor` when
        ``enabled`` is false or the agent could not start (warned, never raised).

    Raises:
        ConfigError: a setting is invalid or unknown; the message names it (not when the agent is
            switched off: :func:`switched_off`).
    """
    if switched_off(settings):
        from .null import NullMonitor

        return NullMonitor()
    cfg = load(**settings)
    if mesh is not None and not (hasattr(mesh, "get_coordinate") and hasattr(mesh, "shape")):
        raise ConfigError(f"agent.mesh: must be a torch.distributed.DeviceMesh, got {type(mesh).__name__}")
    from .null import NullMonitor

    if not cfg.enabled:
        return NullMonitor()
    from .monitor import Monitor

    try:
        return Monitor(model, optimizer, cfg, scaler=scaler, mesh=mesh)
    except ConfigError:
        raise
    except Exception as e:  # the agent must never stop a training job from starting
        warnings.warn(f"gradwatch: agent disabled, could not attach: {e!r}", RuntimeWarning, stacklevel=2)
        return NullMonitor()


def switched_off(settings: dict) -> bool:
    """Whether ``enabled`` (the keyword, else ``GRADWATCH_ENABLED``) reads as false, read before and
    apart from every other setting; an unreadable value is left to :func:`load` to name."""
    raw = settings.get("enabled", os.environ.get("GRADWATCH_ENABLED"))
    if raw is None:
        return False
    try:
        return not TypeAdapter(bool).validate_python(raw)
    except ValidationError:
        return False


def __getattr__(name):
    if name == "Monitor":
        from .monitor import Monitor

        return Monitor
    if name == "NullMonitor":
        from .null import NullMonitor

        return NullMonitor
    raise AttributeError(name)
