"""Settings errors, worded alike for the agent, the aggregator and the demo: the setting, where its
value came from, and what is wrong with it (``agent.every (GRADWATCH_EVERY): Input should be ...``)."""

from __future__ import annotations

import os

from pydantic import ValidationError


def describe(e: ValidationError, prefix: str, env_prefix: str = "", given=(), skip: int = 0) -> str:
    """One line naming the first invalid setting of ``e``.

    Args:
        prefix: the component (``agent``, ``aggregator``, ``demo``).
        env_prefix: its environment variables' prefix; the variable is named when the value came
            from it.
        given: settings passed explicitly (keyword arguments), which environment values do not set.
        skip: leading parts of the error's location that are not the setting's name (the
            subcommands of ``gradwatch grafana push --url ...``), left out.
    """
    err = e.errors()[0]
    name = ".".join(str(p) for p in err["loc"][skip:]) or "?"
    got = repr(err.get("input"))
    msg = err["msg"] if got in err["msg"] or err["type"] == "missing" else f"{err['msg']} (got {got})"
    var = f"{env_prefix}{name.upper()}"
    source = f" ({var})" if env_prefix and name not in given and var in os.environ else ""
    return f"{prefix}.{name}{source}: {msg}"
