"""Hugging Face Trainer: ``Trainer(..., callbacks=[GradwatchCallback()])``.

The callback attaches when training begins, to what the Trainer really trains: the model it
wrapped (``trainer.model_wrapped``: DistributedDataParallel under torchrun) and the optimizer
inside accelerate's ``AcceleratedOptimizer`` (with its GradScaler under fp16). Callbacks are not
handed the trainer, so it is found as the ``self`` of the frame that calls ``on_train_begin``;
where it cannot be (another Trainer loop), the module and optimizer the callback is given serve,
and the DDP wrapper is found at the first forward (:class:`gradwatch.agent.targets.FollowDDP`).

- **Steps** are the Trainer's: the optimizer step that makes ``state.global_step`` g is reported
  as step g (the step its logs show), resumed runs included; a step the GradScaler skips keeps its
  number (the Trainer counts it too), so the reported steps have a gap there.
- **Loss** is the one the Trainer logs: per optimizer step, the sum of what ``training_step``
  returns over the step's micro-batches (``training_step`` divides by gradient accumulation; the
  sum undoes it). The Trainer's log is that value averaged over the ranks and logging steps;
  gradwatch reports each rank's own. A NaN loss is reported as NaN (the Trainer's log replaces it
  with a running mean, ``logging_nan_inf_filter``).
- **Job id**: ``TrainingArguments.run_name`` when set (``GRADWATCH_JOB`` and ``job=`` win).
- **Clipping** (``max_grad_norm``, 1.0 by default) is said once; the global norm is read after it,
  and explosions are judged on the ranks' own norms, taken before it.
- The agent closes at ``on_train_end`` (goodbye reason ``finished``).
"""

from __future__ import annotations

import sys
from typing import Optional

from transformers import Trainer, TrainerCallback

from gradwatch.agent.null import NullMonitor

from ._attach import attach, say_clipping

__all__ = ["GradwatchCallback"]

#: frames above ``on_train_begin`` searched for the Trainer (callback handler, then the loop)
MAX_FRAMES = 8


def trainer_above(frame=None, depth: int = MAX_FRAMES) -> Optional[Trainer]:
    """The ``Trainer`` whose loop is running, found as the ``self`` of one of the ``depth``
    frames above ``frame`` (default: the caller's); None when there is none."""
    f = frame if frame is not None else sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return None
        s = f.f_locals.get("self")
        if isinstance(s, Trainer):
            return s
        f = f.f_back
    return None


class GradwatchCallback(TrainerCallback):
    """Attach gradwatch to a Hugging Face ``Trainer``'s training (see the module docstring).

    Args:
        **settings: agent settings (``endpoint``, ``every``, ``budget``, ...), as
            :func:`gradwatch.agent.attach` takes them; unset ones come from ``GRADWATCH_*``.

    Attributes:
        monitor: the agent while training runs (a ``NullMonitor`` before and after).

    Raises:
        ConfigError: from ``on_train_begin``, for an invalid setting (naming it).
    """

    def __init__(self, **settings):
        self.settings = settings
        self.monitor = NullMonitor()
        self._trainer: Optional[Trainer] = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        trainer = trainer_above(sys._getframe(1))
        scaler = None
        if trainer is not None:
            model, optimizer = trainer.model_wrapped, trainer.optimizer
            scaler = getattr(trainer.accelerator, "scaler", None)
        self.monitor = attach(model, optimizer, framework="Hugging Face Trainer", job=args.run_name,
                              number=lambda: state.global_step + 1, scaler=scaler, **self.settings)
        if trainer is not None and self.monitor.active:
            self._trainer = trainer
            trainer.training_step = self._training_step(trainer.training_step, trainer)
        if args.max_grad_norm and args.max_grad_norm > 0:
            say_clipping(self.monitor, "the Trainer", args.max_grad_norm)

    def _training_step(self, original, trainer):
        monitor = self.monitor

        def training_step(*a, **kw):
            loss = original(*a, **kw)
            # the Trainer sums these over the step's micro-batches; the agent averages what it is given
            monitor.observe_loss(loss * getattr(trainer, "current_gradient_accumulation_steps", 1))
            return loss

        return training_step

    def on_train_end(self, args, state, control, **kwargs):
        trainer, self._trainer = self._trainer, None
        if trainer is not None and "training_step" in vars(trainer):
            del trainer.training_step  # the Trainer's own method again
        monitor, self.monitor = self.monitor, NullMonitor()
        if isinstance(monitor, NullMonitor):
            return
        monitor.close("finished")
