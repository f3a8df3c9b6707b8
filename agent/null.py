"""The monitor that does nothing, for a disabled agent or one that could not start.

Apart from :mod:`.monitor` so that a disabled agent (``GRADWATCH_ENABLED=0``) never loads the
monitor, its parts or their sockets.
"""

from __future__ import annotations


class NullMonitor:
    """What :func:`attach` returns when the agent is disabled or cannot run: does nothing."""

    active = False
    local_norms = False
    step = probes = errors = 0
    not_instrumented: list = []

    def observe_loss(self, loss) -> None:
        pass

    def wrap_comm_hook(self, hook):
        return hook

    def number_steps(self, source) -> None:
        pass

    def at_close(self, fn) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass
