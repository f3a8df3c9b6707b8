"""accelerate: ``monitor = attach(accelerator, model, optimizer)`` after ``accelerator.prepare``.

Attaches to the prepared model (DistributedDataParallel under a multi-process launch) and the
torch optimizer inside accelerate's ``AcceleratedOptimizer``, stepping through its GradScaler
under fp16; an optimizer step that accelerate holds back for gradient accumulation is no step.

- **Loss**: what the script hands ``accelerator.backward(loss)``, before accelerate divides it by
  ``gradient_accumulation_steps``, averaged over the step's micro-batches.
- **Clipping**: the first ``accelerator.clip_grad_norm_(..., max_norm)`` is said once; the global
  norm is read after it, explosions are judged on the ranks' own norms, taken before it.
- **Steps** are optimizer steps counted from 0 (accelerate numbers none of its own).
- The agent closes at ``accelerator.end_training()``, at ``monitor.close()`` or at exit.
"""

from __future__ import annotations

from ._attach import attach as _attach, say_clipping

__all__ = ["attach"]

#: the Accelerator methods wrapped while the agent runs
WRAPPED = ("backward", "clip_grad_norm_", "end_training")


def attach(accelerator, model, optimizer, **settings):
    """Attach gradwatch to an accelerate training loop.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: the prepared model (or the module inside it).
        optimizer: the prepared optimizer (``AcceleratedOptimizer``) or the torch one inside.
        **settings: agent settings, as :func:`gradwatch.agent.attach` takes them.

    Returns:
        The monitor (a context manager; ``close()`` ends it and unwraps the accelerator).

    Raises:
        ConfigError: an invalid setting, naming it.
    """
    monitor = _attach(model, optimizer, framework="accelerate", scaler=getattr(accelerator, "scaler", None),
                      **settings)
    if not monitor.active:
        return monitor
    backward, clip, end = (getattr(accelerator, n) for n in WRAPPED)
    said = []

    def observed_backward(loss, *args, **kwargs):
        monitor.observe_loss(loss.detach() if hasattr(loss, "detach") else loss)
        return backward(loss, *args, **kwargs)

    def observed_clip(parameters, max_norm, *args, **kwargs):
        if not said:
            said.append(True)
            say_clipping(monitor, "accelerate", float(max_norm))
        return clip(parameters, max_norm, *args, **kwargs)

    def observed_end(*args, **kwargs):
        monitor.close("finished")
        return end(*args, **kwargs)

    accelerator.backward, accelerator.clip_grad_norm_, accelerator.end_training = observed_backward, observed_clip, observed_end

    def unwrap() -> None:
        for name in WRAPPED:
            if name in vars(accelerator):
                delattr(accelerator, name)

    monitor.at_close(unwrap)
    return monitor
