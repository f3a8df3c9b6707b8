"""The failure policy: the agent never raises into training; it counts, warns once, and switches off.

Every part of the agent reports a failure as ``on_error(where, exc)``, ``where`` being the part's
name, optionally followed by ``":detail"`` (``"forward:encoder.0"``). A failure is counted and
warned about once per part (``RuntimeWarning``). A part that fails :data:`PART_ERRORS` times is
switched off alone if it is one of :data:`PARTS` (the rest of the agent goes on); any other part
is the step itself, without which nothing works, and the agent stops. :data:`MAX_ERRORS` failures
of all parts together stop the agent too.
"""

from __future__ import annotations

from typing import Callable

from gradwatch.errors import warn_user

PART_ERRORS = 10  # a part of the agent failing this often is switched off, the rest goes on
MAX_ERRORS = 1000  # every part together: the agent switches itself off
PARTS = ("forward", "output-grad", "sentinel", "comm-hook", "guard")  # what can be switched off alone


class Failures:
    """The ``on_error`` callback every part of one monitor shares.

    Attributes:
        errors: failures counted so far.
        disabled: names of the parts switched off; parts read it (shared, never replaced).
        stopped: the agent stopped (set here when giving up, or by the monitor when it closes);
            failures are still counted but stop nothing more.

    Args:
        stop: called once when the agent gives up (the monitor's ``close``).
    """

    def __init__(self, stop: Callable[[], None]):
        self.stop = stop
        self.errors = 0
        self.disabled: set[str] = set()
        self.stopped = False
        self._per_part: dict[str, int] = {}
        self._warned: set[str] = set()

    def __call__(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        kind = where.split(":")[0]
        if kind not in self._warned:
            self._warned.add(kind)
            warn_user(f"gradwatch: {where} failed and is skipped: {exc!r}")
        self._per_part[kind] = n = self._per_part.get(kind, 0) + 1
        if n == PART_ERRORS and kind in PARTS:
            self.disabled.add(kind)
            warn_user(f"gradwatch: {kind} keeps failing and is switched off; the rest of the agent goes on")
        elif n == PART_ERRORS and not self.stopped:  # the step itself: nothing works without it
            self.errors = MAX_ERRORS
        if self.errors >= MAX_ERRORS and not self.stopped:
            warn_user("gradwatch: too many agent errors; monitoring is switched off")
            self.stopped = True
            self.stop()
