"""The exception root: every error gradwatch raises on purpose is a :class:`GradwatchError`.

    GradwatchError
    ├── ConfigError (also ValueError)   an invalid setting, or a resource a setting names
    │                                   (a port in use); raised by the agent and the aggregator
    ├── WireError (also ValueError)     a frame that is not a valid message (gradwatch.wire)
    ├── Halt                            the agent stops training at the step the aggregator named
    │                                   (only when attached with ``on_critical="halt"``)
    └── the commands' errors            StackError, PushError, ... (gradwatch.commands, grafana)

``except gradwatch.GradwatchError`` catches all of them; ``except ValueError`` also catches the
config and wire errors.
"""

from __future__ import annotations

import sys
import warnings

__all__ = ["GradwatchError", "ConfigError", "Halt", "warn_user"]


class GradwatchError(Exception):
    """Root of gradwatch's own errors."""


class ConfigError(GradwatchError, ValueError):
    """An invalid setting, or a resource a setting names (a port in use); the message names the
    setting (``agent.every (GRADWATCH_EVERY): Input should be ...``)."""


class Halt(GradwatchError):
    """Raised by ``optimizer.step()`` of an agent attached with ``on_critical="halt"``, before the
    optimizer changes anything, at the step the aggregator named after a critical finding of one
    of the checks in ``halt_on``: every rank of the job raises it at the same step, so none goes on
    to save a checkpoint of corrupted weights. Raised once; the agent is closed by then.

    Attributes:
        step: the step that was not taken (as the agent numbers steps).
        check: the check whose finding asked for the halt.
        summary: that finding's summary.
    """

    def __init__(self, step: int, check: str, summary: str = ""):
        super().__init__(f"gradwatch: halted before step {step}: {check}" + (f": {summary}" if summary else ""))
        self.step, self.check, self.summary = step, check, summary


#: modules whose frames a warning is not attributed to: gradwatch's own, torch's (whose hooks and
#: optimizer call the agent), and the training frameworks' that call it (their callbacks, loops and
#: optimizer wrappers), so a warning points at the user's line that led there
_INTERNAL = ("gradwatch", "torch", "transformers", "accelerate", "lightning", "pytorch_lightning", "lightning_fabric")


def warn_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` attributed to the caller's first frame outside gradwatch and torch: the
    user's line (``with attach(...)``, ``opt.step()``), not gradwatch's own code that noticed (on
    the sender thread that frame is threading's; with none at all, gradwatch's caller)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _INTERNAL:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
