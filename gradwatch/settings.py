"""Settings errors, worded alike for the agent, the aggregator and the demo: the setting, where its
value came from, and what is wrong with it (``agent.every (GRADWATCH_EVERY): Input should be ...``)."""

from __future__ import annotations

import os

from pydantic import BaseModel, ValidationError


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
    # the value, unless the message says it already ("... got 'foo'"; "greater than 0" is no "got 0")
    msg = err["msg"] if f"got {got}" in err["msg"] or err["type"] == "missing" else f"{err['msg']} (got {got})"
    var = f"{env_prefix}{name.upper().replace('.', '__')}"  # a nested setting's variable: CHECKS__SKEW_STEPS
    source = f" ({var})" if env_prefix and name not in given and var in os.environ else ""
    return f"{prefix}.{name}{source}: {msg}"


def unknown_variables(env_prefix: str, model: type[BaseModel], nested: str = "", others: tuple[str, ...] = ()) -> list[str]:
    """The environment variables under ``env_prefix`` that name no setting of ``model`` (a typo is
    otherwise ignored without a word), sorted; names under ``others`` (another component's
    prefixes) are not ``model``'s to judge.

    Args:
        nested: the delimiter of a nested model's fields (``GRADWATCH_AGGREGATOR_CHECKS__SKEW_STEPS``),
            '' for a flat model.
    """
    out = []
    for var in os.environ:
        if not var.startswith(env_prefix) or var.startswith(others):
            continue
        rest = var[len(env_prefix):].lower()
        name, _, sub = rest.partition(nested) if nested else (rest, "", "")
        field = model.model_fields.get(name)
        inner = getattr(field, "annotation", None) if field is not None else None
        if field is None or (sub and not (isinstance(inner, type) and issubclass(inner, BaseModel) and sub in inner.model_fields)):
            out.append(var)
    return sorted(out)


def endpoint(v: str, bind: bool = False) -> str:
    """``v`` if it is a ZeroMQ endpoint an agent can connect to (``tcp://host:port`` with a port
    in 1-65535, ``ipc://path``, ``inproc://name``), or with ``bind`` one the aggregator can bind
    (port 0 or ``*``: a free one).

    Raises:
        ValueError: saying what it should look like.
    """
    if not v.startswith(("tcp://", "ipc://", "inproc://")) or "://" == v[-3:]:
        raise ValueError(f"must look like tcp://host:port or ipc://path, got {v!r}")
    if v.startswith("tcp://"):
        port = v.rpartition(":")[2]
        free = bind and port in ("0", "*")
        if not free and not port.isdigit():
            raise ValueError(f"a tcp endpoint needs a port, tcp://host:port, got {v!r}")
        if not free and not 0 < int(port) < 65536:
            raise ValueError(f"port {port} is out of range (1-65535{', or 0 for any free one' if bind else ''}), got {v!r}")
    return v
