"""``gradwatch stacks`` and ``gradwatch probe``: the aggregator's control endpoints from a shell.

Both speak to the aggregator's HTTP server (``/api/stacks``, ``/api/probe``) with the bearer token
it was started with (``--token``, or ``GRADWATCH_CONTROL_TOKEN``). ``stacks`` prints every rank's
training-thread stack grouped by identical frames, the way one compares py-spy dumps of the ranks
by hand: each group's ranks, then its frames outermost first and innermost last, then the ranks
that did not answer. Importing this module imports neither torch nor the aggregator's daemon.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import CommandError, UsageError
from .top import DEFAULT_URL
from .top.model import base_url

#: the variable the token is read from when --token is not given
TOKEN_VARIABLE = "GRADWATCH_CONTROL_TOKEN"


def _settings(prog: str, prefix: str) -> SettingsConfigDict:
    return SettingsConfigDict(env_prefix=prefix, extra="forbid", frozen=True, cli_kebab_case=True,
                              cli_prog_name=prog, cli_implicit_flags=True)


class _Control(BaseSettings):
    url: str = Field(DEFAULT_URL, description="The aggregator's HTTP address, http://HOST:PORT (its --metrics-host and --metrics-port).")
    job: str = Field(..., description="The job id (its job_id label, as /api/findings and /metrics name it).")
    token: SecretStr = Field(SecretStr(""), description=f"The aggregator's --control-token (default: the {TOKEN_VARIABLE} variable; never printed).")
    wait_s: float = Field(3.0, ge=0, le=10, description="Seconds the aggregator waits for the ranks' answers.")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return base_url(v)

    def _call(self, path: str, query: dict | None = None, body: dict | None = None) -> dict:
        """The aggregator's JSON answer.

        Raises:
            UsageError: no token given.
            CommandError: the aggregator refused (its error message), or cannot be reached.
        """
        token = self.token.get_secret_value() or os.environ.get(TOKEN_VARIABLE, "")
        if not token:
            raise UsageError(f"needs the aggregator's control token: --token TOKEN or {TOKEN_VARIABLE}")
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.wait_s + 10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                why = json.loads(e.read()).get("error", "")
            except ValueError:
                why = ""
            raise CommandError(f"{self.url}{path} answered {e.code}: {why or e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            raise CommandError(f"cannot reach the aggregator at {self.url}: {getattr(e, 'reason', e)}") from None


def format_stacks(got: dict) -> str:
    """The text ``gradwatch stacks`` prints for ``/api/stacks``' answer ``got``."""
    lines = []
    for g in got.get("groups", []):
        ranks = g["ranks"]
        waiting = [k for k in ranks if g.get("waiting", {}).get(str(k))]
        head = f"ranks {_ranges(ranks)}" if len(ranks) > 1 else f"rank {ranks[0]}"
        longest = max((g.get("in_step_s", {}).get(str(k), 0.0) for k in ranks), default=0.0)
        lines.append(f"{head} ({len(ranks)}): in the step for {_seconds(longest)}"
                     + (f", waiting in all-reduce: {_ranges(waiting)}" if waiting else ""))
        if not g["frames"]:
            lines.append("    (no frames: " + "; ".join(f"rank {k}: {e}" for k, e in g.get("error", {}).items()) + ")")
        for f in g["frames"]:
            lines.append(f"    {f['function']} ({f['file']}:{f['line']})")
            if f.get("source"):
                lines.append(f"        {f['source']}")
        for k, entries in g.get("flight", {}).items():
            lines.append(f"    flight recorder of rank {k}: " + ", ".join(f"{c} #{s} {st}" for c, st, s in entries[-5:]))
        lines.append("")
    if got.get("refused"):
        lines.append("refused: " + ", ".join(f"rank {k} ({why})" for k, why in got["refused"].items()))
    if got.get("no_answer"):
        lines.append(f"no answer from ranks {_ranges(got['no_answer'])} (the training thread holds the GIL, "
                     "the process is stopped, or the rank is not connected)")
    if not got.get("groups") and not got.get("no_answer"):
        lines.append("no rank answered")
    return "\n".join(lines).rstrip() + "\n"


def _seconds(s) -> str:
    try:
        return f"{float(s):.1f} s"
    except (TypeError, ValueError):
        return "? s"


def _ranges(ranks: list[int]) -> str:
    """``0-3,7``: sorted ranks as ranges."""
    out, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


class StacksCommand(_Control):
    """gradwatch stacks: every rank's training-thread Python stack now, grouped by identical stacks (innermost frame last)."""

    model_config = _settings("gradwatch stacks", "GRADWATCH_STACKS_")

    rank: int = Field(-1, ge=-1, description="Only this rank (-1: every rank of the job).")
    source: bool = Field(False, description="Ask for source lines too (sent only by agents with stack_source on).")
    json_out: bool = Field(False, alias="json", description="Print the aggregator's JSON answer instead.")

    def cli_cmd(self) -> None:
        q = {"job_id": self.job, "wait_s": self.wait_s}
        if self.rank >= 0:
            q["rank"] = self.rank
        if self.source:
            q["source"] = 1
        got = self._call("/api/stacks", query=q)
        print(json.dumps(got, indent=1) if self.json_out else format_stacks(got), end="" if not self.json_out else "\n")


class ProbeCommand(_Control):
    """gradwatch probe: make every rank of a job probe its next N steps (the same steps on every rank), whatever its budget says."""

    model_config = _settings("gradwatch probe", "GRADWATCH_PROBE_")

    steps: int = Field(..., ge=1, le=1000, description="Steps to probe, from a step the aggregator picks a second or so ahead of the job.")
    layers: list[str] = Field(default_factory=list, description="Only the layers whose module path matches one of these fnmatch patterns (blocks.3.*); none: every layer.")

    def cli_cmd(self) -> None:
        got = self._call("/api/probe", body={"job_id": self.job, "steps": self.steps, "layers": self.layers,
                                             "wait_s": self.wait_s})
        acks = got.get("acks", {})
        print(f"job {got['job_id']}: steps {got['start']}-{got['start'] + got['steps'] - 1} probed"
              + (f" (layers {', '.join(got['layers'])})" if got.get("layers") else "")
              + f"; {len(acks)} ranks acknowledged" + (f" from step {min(acks.values())}" if acks else ""))
        for k, why in got.get("refused", {}).items():
            print(f"rank {k} refused: {why}")
        if got.get("no_answer"):
            print(f"no answer from ranks {_ranges(got['no_answer'])}")
        if not acks:
            raise CommandError("no rank took the probe")
