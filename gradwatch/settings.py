"""Settings errors, worded alike for the agent, the aggregator and the demo: the setting, where its
value came from, and what is wrong with it (``agent.every (GRADWATCH_EVERY): Input should be ...``)."""

from __future__ import annotations

import difflib
import os

from pydantic import BaseModel, ValidationError


#: settings whose values an error never shows (tokens, secret keys, passwords): a part of the name
_SECRETS = ("token", "secret", "password", "basic_auth", "server_key", "client_key")


def describe(e: ValidationError, prefix: str, env_prefix: str = "", given=(), skip: int = 0) -> str:
    """One line naming the first invalid setting of ``e`` (and its value, but for a secret's:
    :data:`_SECRETS`).

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
    got = "a value not shown" if any(w in name for w in _SECRETS) else repr(err.get("input"))
    # the value, unless the message says it already ("... got 'foo'"; "greater than 0" is no "got 0")
    msg = err["msg"] if f"got {got}" in err["msg"] or err["type"] == "missing" else f"{err['msg']} (got {got})"
    var = f"{env_prefix}{name.upper().replace('.', '__')}"  # a nested setting's variable: CHECKS__SKEW_STEPS
    source = f" ({var})" if env_prefix and name not in given and var in os.environ else ""
    return f"{prefix}.{name}{source}: {msg}"


def known_variables(env_prefix: str, model: type[BaseModel], nested: str = "") -> list[str]:
    """The environment variables that set ``model``'s settings, upper case: one per field, and
    with ``nested`` (the delimiter of a nested model's fields, ``GRADWATCH_AGGREGATOR_CHECKS__SKEW_STEPS``)
    one per field of each field that is a model itself."""
    out = []
    for name, field in model.model_fields.items():
        out.append(f"{env_prefix}{name.upper()}")
        inner = field.annotation
        if nested and isinstance(inner, type) and issubclass(inner, BaseModel):
            out += [f"{env_prefix}{name.upper()}{nested}{sub.upper()}" for sub in inner.model_fields]
    return out


def unknown_variables(env_prefix: str, model: type[BaseModel], nested: str = "", others: tuple[str, ...] = ()) -> list[str]:
    """The environment variables under ``env_prefix`` that name no setting of ``model``
    (:func:`known_variables`; a typo is otherwise ignored without a word), sorted; names under
    ``others`` (another component's prefixes) are not ``model``'s to judge."""
    known = set(known_variables(env_prefix, model, nested))
    return sorted(var for var in os.environ
                  if var.startswith(env_prefix) and not var.startswith(others) and var.upper() not in known)


def closest(var: str, known: list[str]) -> str:
    """`` (did you mean KNOWN?)``-style hint for a misspelled variable: the closest of ``known``
    (difflib), or ''."""
    near = difflib.get_close_matches(var, known, n=1)
    return f"did you mean {near[0]}? " if near else ""


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
