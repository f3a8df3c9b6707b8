"""Errors of the commands, mapped to exit statuses by :func:`gradwatch.commands.cli.main`."""

from __future__ import annotations

from gradwatch.errors import GradwatchError


class CommandError(GradwatchError):
    """A command failed; ``gradwatch`` prints the message (when there is one) as one line and
    exits with ``status`` (1 unless given)."""

    def __init__(self, message: str = "", status: int = 1):
        super().__init__(message)
        self.status = status


class UsageError(CommandError, ValueError):
    """Settings that do not go together, or one that is missing; exit status 2, like an invalid
    setting."""

    def __init__(self, message: str):
        super().__init__(message, status=2)
