"""What every integration does around :func:`gradwatch.agent.attach`."""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import gradwatch.agent as gw
from gradwatch.errors import warn_user

log = logging.getLogger("gradwatch.agent")


def attach(model, optimizer, *, framework: str, job: Optional[str] = None,
           number: Optional[Callable[[], int]] = None, scaler=None, **settings):
    """:func:`gradwatch.agent.attach` for a framework's objects.

    Args:
        model, optimizer, scaler, settings: as :func:`gradwatch.agent.attach` takes them.
        framework: the framework's name, for messages.
        job: the framework's run name, the job id unless ``job`` is among ``settings`` or
            ``GRADWATCH_JOB`` is set (which then win); None for the agent's own default
            (torchrun's run id).
        number: the framework's number of the step being taken, read in the optimizer's step hooks
            (:meth:`Monitor.number_steps`); None: the agent counts optimizer steps from 0.

    Returns:
        The monitor (a ``NullMonitor`` when switched off or unable to start).

    Raises:
        ConfigError: an invalid setting, as :func:`gradwatch.agent.attach`.
    """
    if job and "job" not in settings and not os.environ.get("GRADWATCH_JOB"):
        settings["job"] = job
    monitor = gw.attach(model, optimizer, scaler=scaler, **settings)
    if number is not None:
        monitor.number_steps(number)
    return monitor


def say_clipping(monitor, framework: str, max_norm: float) -> None:
    """Say once that the framework clips gradients, and what the agent's norms mean then."""
    if not monitor.active:
        return
    local = monitor.local_norms
    text = (f"gradwatch: {framework} clips gradients at a norm of {max_norm:g}: the global gradient norm gradwatch "
            f"reports is read after clipping (at most {max_norm:g})")
    if local:
        log.info("%s; explosions are judged on the ranks' own norms, taken before clipping", text)
    else:
        warn_user(f"{text}, and without DDP the ranks' own norms (before clipping) are not measured: a blow-up is "
                  "seen only in probed steps' per-layer output-gradient norms")
