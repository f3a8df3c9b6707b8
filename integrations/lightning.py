"""Lightning: ``L.Trainer(..., callbacks=[GradwatchCallback()])``.

The callback attaches when training starts, to what Lightning really trains: the strategy's model
(DistributedDataParallel around the LightningModule under ``strategy="ddp"``) and the torch
optimizer inside the ``LightningOptimizer`` (with the GradScaler of ``precision="16-mixed"``).
Lightning runs forward and backward inside ``optimizer.step(closure)``; the agent measures such a
step after its closure ran, so statistics are those of the step the optimizer applies.

- **Steps** are Lightning's: an optimizer step is reported as the ``trainer.global_step`` it is
  taken at (the step Lightning's loggers record its metrics under), resumed runs included. A step
  the GradScaler skips keeps its number, as Lightning counts it; with several optimizers (manual
  optimization), whose steps Lightning counts together, the first optimizer's steps are reported
  under the numbers Lightning gives them.
- **Loss** is what ``training_step`` returned, averaged over the step's micro-batches: Lightning
  divides it by ``accumulate_grad_batches`` (and, under AMP, multiplies it by the loss scale)
  before backward; the callback undoes both, without a host synchronisation. Under manual
  optimization it is what ``manual_backward`` was given.
- **Clipping** (``gradient_clip_val``) is said once; the global norm is read after it, and
  explosions are judged on the ranks' own norms, taken before it.
- Only the first optimizer is watched when there are several (manual optimization); this is said.
- The agent closes at ``on_train_end`` (goodbye ``finished``) or ``on_exception`` (``other``).

Lightning has no run identity shared by the ranks: the job id is the agent's default
(``GRADWATCH_JOB``, else torchrun's run id).
"""

from __future__ import annotations

import torch

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name
    from pytorch_lightning import Callback

from gradwatch.agent.null import NullMonitor
from gradwatch.errors import warn_user

from ._attach import attach, say_clipping

__all__ = ["GradwatchCallback"]


class GradwatchCallback(Callback):
    """Attach gradwatch to a Lightning ``Trainer``'s fit (see the module docstring).

    Args:
        **settings: agent settings (``endpoint``, ``every``, ``budget``, ...), as
            :func:`gradwatch.agent.attach` takes them; unset ones come from ``GRADWATCH_*``.

    Attributes:
        monitor: the agent while training runs (a ``NullMonitor`` before and after).

    Raises:
        ConfigError: from ``on_train_start``, for an invalid setting (naming it).
    """

    def __init__(self, **settings):
        self.settings = settings
        self.monitor = NullMonitor()
        self._scaler = None
        self._normalize = 1

    def on_train_start(self, trainer, pl_module) -> None:
        optimizers = trainer.optimizers
        if not optimizers:
            return
        if len(optimizers) > 1:
            warn_user(f"gradwatch: the Trainer has {len(optimizers)} optimizers; only the first "
                      f"({type(optimizers[0]).__name__}) marks steps and is watched")
        self._scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._normalize = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        self.monitor = attach(trainer.strategy.model, optimizers[0], framework="Lightning",
                              number=lambda: trainer.global_step, scaler=self._scaler, **self.settings)
        clip = trainer.gradient_clip_val
        if clip and clip > 0:
            say_clipping(self.monitor, "Lightning", float(clip))

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        if not self.monitor.active or not isinstance(loss, torch.Tensor):
            return
        t = loss.detach()
        scale = getattr(self._scaler, "_scale", None)
        if isinstance(scale, torch.Tensor):  # the scaled loss under AMP: divided on the device
            t = t.float() / scale
        if self._normalize != 1:
            t = t * self._normalize
        self.monitor.observe_loss(t)

    def on_train_end(self, trainer, pl_module) -> None:
        self._close("finished")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._close("other")

    def _close(self, reason: str) -> None:
        monitor, self.monitor = self.monitor, NullMonitor()
        if not isinstance(monitor, NullMonitor):
            monitor.close(reason)
