"""The exception root: every error gradwatch raises on purpose is a :class:`GradwatchError`.

    GradwatchError
    ├── ConfigError (also ValueError)   an invalid setting, or a resource a setting names
    │                                   (a port in use); raised by the agent and the aggregator
    ├── WireError (also ValueError)     a frame that is not a valid message (gradwatch.wire)
    └── the commands' errors            StackError, PushError, ... (gradwatch.commands, grafana)

``except gradwatch.GradwatchError`` catches all of them; ``except ValueError`` keeps catching the
config and wire errors as it did before they had a common root.
"""

from __future__ import annotations

__all__ = ["GradwatchError", "ConfigError"]


class GradwatchError(Exception):
    """Root of gradwatch's own errors."""


class ConfigError(GradwatchError, ValueError):
    """An invalid setting, or a resource a setting names (a port in use); the message names the
    setting (``agent.every (GRADWATCH_EVERY): Input should be ...``)."""
