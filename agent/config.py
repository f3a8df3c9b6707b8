"""Agent settings: one typed model, read from ``attach(**settings)`` and ``GRADWATCH_*`` variables.

Precedence: keyword arguments to :func:`gradwatch.agent.attach`, then environment variables
(``GRADWATCH_EVERY=5``, ``GRADWATCH_ENDPOINT=tcp://agg:5555``, ``GRADWATCH_ENABLED=0``), then
torchrun's variables for identity (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``TORCHELASTIC_RUN_ID``), then the defaults below. Invalid values raise :class:`ConfigError`
at attach time, naming the setting.
"""

from __future__ import annotations

import os
import socket
import re
from typing import Annotated, Literal, Optional

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gradwatch import auth
from gradwatch.errors import ConfigError, warn_user  # the one config error; gradwatch.agent.ConfigError names it too
from gradwatch.settings import describe, endpoint, known_variables, unknown_variables


class AgentConfig(BaseSettings):
    """Settings of the in-process agent. Every field can be set as ``GRADWATCH_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="GRADWATCH_", extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Attach at all; GRADWATCH_ENABLED=0 turns the agent into a no-op.")
    endpoint: str = Field("tcp://127.0.0.1:5555", description="Aggregator's ZeroMQ endpoint; the agent connects, never binds.")
    every: Optional[int] = Field(None, ge=1, description="Fixed probe cadence: per-layer statistics every N-th optimizer step. Unset (the default): the budget picks the cadence.")
    budget: float = Field(0.01, gt=0, le=1, description="Unless every is set: the agent's average cost as a fraction of the step time (0.01: 1%); it measures its own cost and probes every 2**k-th step, k chosen to stay within it.")
    max_probe_interval_s: float = Field(60.0, gt=0, le=86400, description="Longest time between probes under the budget, seconds of step time (bounds detection latency); when even that costs over 3 budgets, gradwatch_rank_agent_over_budget says so and one warning.")
    job: str = Field("", description="Job id; default TORCHELASTIC_RUN_ID, else 'default'.")
    job_key: str = Field("", max_length=64, description="What tells this job from another under the same id (e.g. a launch id, the same on every rank and across restarts); default derived from torchrun's run id, or MASTER_ADDR and MASTER_PORT (see job_key).")
    rank: int = Field(-1, ge=-1, description="Global rank; default RANK, else torch.distributed, else 0.")
    world_size: int = Field(-1, ge=-1, description="World size; default WORLD_SIZE, else torch.distributed, else 1.")
    local_rank: int = Field(-1, ge=-1, description="Local rank on the host; default LOCAL_RANK, else 0.")
    host: str = Field("", description="Host name reported in the schema; default socket.gethostname().")
    queue_size: int = Field(64, ge=1, le=100_000, description="Reports waiting to be sent; when full the oldest is dropped and counted.")
    send_hwm: int = Field(256, ge=1, description="ZeroMQ send high-water mark, messages.")
    heartbeat_s: float = Field(1.0, gt=0, le=3600, description="Seconds without any message after which the sender thread sends a heartbeat (steps and reports already say the rank is alive).")
    schema_every_s: float = Field(10.0, gt=0, le=86400, description="Seconds until the first schema resend after a (re)connect or a change, doubling after each resend up to 32 times this; heartbeats carry the schema's hash in between. Each resend comes up to its gap late at random; in a job of more than 1,024 ranks up to world/1,024 times its gap (at most 32 times this), so that the job's resends do not grow with its size.")
    coalesce_s: float = Field(0.25, ge=0, le=10, description="Seconds the records of unprobed steps gather before they go out as one message (sooner before a probe, at a non-finite or spiking gradient norm, or when full); 0 sends them at the sender's next turn.")
    burst: int = Field(5, ge=0, le=1000, description="Steps probed in depth, regardless of cadence, after the sentinel sees a non-finite or spiking gradient norm.")
    spike_factor: float = Field(10.0, gt=1, description="A gradient norm above this multiple of the recent median is a spike that starts a burst.")
    local_norms: bool = Field(True, description="Install a DDP communication hook for per-rank gradient norms before all-reduce (only when the model has no hook yet; see Monitor.wrap_comm_hook).")
    batch_size: int = Field(0, ge=0, description="Samples per rank per micro-step; 0 infers it from the model input's first dimension.")
    nan_guard: Literal["auto", "on", "off"] = Field(
        "auto",
        description="NaN guard: at every unprobed step, one sum of each leaf module's output (no host sync), so "
        "a NaN or Inf made in the forward pass is located at its module whatever the step (probed steps "
        "have it anyway). 'auto' keeps it while it costs at most a quarter of the budget (its host time, "
        "measured once over the first 32 unprobed steps, also under a fixed every; off on short CPU steps, "
        "where it costs a few percent), 'on' always, 'off' never.",
    )
    fused: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Fused torch.compile statistics kernel: 'on' compiles it in the background at attach "
        "(eager until ready), 'off' stays eager, 'auto' compiles only for CUDA models.",
    )

    stack_source: bool = Field(
        False,
        description="Send the source line of each frame with the training thread's stack when the aggregator asks "
        "for it (a hung rank, gradwatch stacks); off: file paths, line numbers and function names only.")
    on_critical: Literal["off", "halt"] = Field(
        "off",
        description="'halt': when the aggregator raises a critical finding of a check in halt_on, every rank raises "
        "gradwatch.Halt from optimizer.step() at the step the aggregator names, before the optimizer changes anything "
        "(docs/control.md). 'off': the aggregator can never stop this job.")
    halt_on: Annotated[tuple[str, ...], NoDecode] = Field(
        ("nonfinite", "replica_drift", "grad_agreement"),
        description="With on_critical='halt': the checks whose critical finding halts training (comma-separated in "
        "GRADWATCH_HALT_ON); at most 16 check names.")
    on_nonfinite: Literal["off", "skip"] = Field(
        "off",
        description="'skip': before each optimizer step, read whether the gradients it would apply are finite (one "
        "host sync a step) and, when not, take every gradient away so the step changes nothing (the same step on "
        "every DDP rank: the all-reduced gradient is the same); counted in gradwatch_rank_nonfinite_skipped_steps_total.")

    server_key: str = Field(
        "",
        description="Aggregator's CURVE public key: a path to its server.key file (gradwatch keys) or the "
        "40-character Z85 key. Turns CURVE authentication and encryption on; needs client_key. '' for plain TCP.",
    )
    client_key: SecretStr = Field(
        SecretStr(""),
        description="This agent's CURVE key pair: a path to its NAME.key_secret file (gradwatch keys) or the "
        "40-character Z85 secret key (never logged); the aggregator must list its public key.",
    )

    def curve_keys(self) -> Optional[auth.ClientKeys]:
        """The CURVE keys for the sender's socket, or None for plain TCP (neither key set).

        Raises:
            ConfigError: naming ``server_key`` or ``client_key`` (and the variable it came from):
                only one of them set, a missing or unreadable file, not a Z85 key.
        """
        secret = self.client_key.get_secret_value()
        if not self.server_key and not secret:
            return None
        if not self.server_key or not secret:
            missing, given = ("client_key", "server_key") if self.server_key else ("server_key", "client_key")
            raise ConfigError(f"agent.{missing}: needed with {given}{_env(given)} (CURVE takes both: "
                              f"set GRADWATCH_{missing.upper()} or pass {missing}=)")
        try:
            server = auth.load_public(self.server_key)
        except auth.KeyMaterialError as e:
            raise ConfigError(f"agent.server_key{_env('server_key')}: {e}") from None
        try:
            public, sec = auth.load_pair(secret)
        except auth.KeyMaterialError as e:
            raise ConfigError(f"agent.client_key{_env('client_key')}: {e}") from None
        return auth.ClientKeys(server, public, sec)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        return endpoint(v)

    @field_validator("halt_on", mode="before")
    @classmethod
    def _halt_on(cls, v):
        if isinstance(v, str):
            v = [x.strip() for x in v.split(",") if x.strip()]
        if isinstance(v, (list, tuple)):
            if len(v) > 16:
                raise ValueError(f"at most 16 checks, got {len(v)}")
            for x in v:
                if not isinstance(x, str) or not _CHECK_NAME.fullmatch(x):
                    raise ValueError(f"{x!r} is not a check name (lower case letters, digits and _, at most 64)")
        return v

    @field_validator("job")
    @classmethod
    def _job(cls, v: str) -> str:
        if len(v.encode()) > 256:
            raise ValueError("must be at most 256 bytes")
        return v


_CHECK_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


def load(**settings) -> AgentConfig:
    """Build the config from keyword arguments over ``GRADWATCH_*`` variables.

    Raises:
        ConfigError: naming the first invalid or unknown setting.
    """
    unknown = unknown_variables("GRADWATCH_", AgentConfig, others=_OTHER_PREFIXES)
    known = ", ".join(sorted(known_variables("GRADWATCH_", AgentConfig))) if unknown else ""
    for var in unknown:
        warn_user(f"gradwatch: unknown setting {var} is ignored (agent settings: {known})")
    try:
        cfg = AgentConfig(**settings)
    except ValidationError as e:
        raise ConfigError(describe(e, "agent", "GRADWATCH_", settings)) from None
    cfg.curve_keys()  # key files are read at attach, so a wrong one fails there
    return cfg


def _env(name: str) -> str:
    """`` (GRADWATCH_NAME)`` when the setting's value may have come from that variable."""
    var = f"GRADWATCH_{name.upper()}"
    return f" ({var})" if var in os.environ else ""


# GRADWATCH_* variables that belong to the other components, not the agent
_OTHER_PREFIXES = ("GRADWATCH_AGGREGATOR_", "GRADWATCH_DEMO_", "GRADWATCH_KEYS_", "GRADWATCH_PROMETHEUS_URL", "GRADWATCH_REQUIRE_",
                   "GRADWATCH_CLI_", "GRADWATCH_CATALOG_", "GRADWATCH_CONTROL_TOKEN", "GRADWATCH_STACKS_", "GRADWATCH_PROBE_")


def job_key(cfg: AgentConfig, job: str, world: int) -> str:
    """The job's identity digest sent beside its id (``wire.Header.key``): 16 hex chars.

    Every rank of one job computes the same value from what its ranks share, and the value
    survives the job's restarts, so two jobs under one id stay two jobs at the aggregator while a
    restarted job stays itself:

    1. ``cfg.job_key`` (``GRADWATCH_JOB_KEY``) when set;
    2. the job id alone when it is torchrun's ``TORCHELASTIC_RUN_ID`` other than the default
       ``none``: a run id names one job, and an elastic restart may move ``MASTER_PORT`` (each
       rendezvous round picks one) and change the world size;
    3. with ``MASTER_ADDR`` set (torchrun's static rendezvous under ``none``, or a launcher of
       one's own): the job id, ``MASTER_ADDR`` and ``MASTER_PORT``, fixed for the job's life;
    4. a single process without any of these: the job id, host name and process id;
    5. else the job id alone.

    A digest, not a secret: it separates honest jobs; authenticating peers is CURVE's job.
    ``world`` only selects rule 4.
    """
    import hashlib

    env = os.environ
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if cfg.job_key:
        parts = ["key", cfg.job_key]
    elif run_id and run_id != "none" and job == run_id:
        parts = ["run", job]
    elif "MASTER_ADDR" in env:
        parts = ["master", job, env["MASTER_ADDR"], env.get("MASTER_PORT", "")]
    elif world == 1:
        parts = ["process", job, socket.gethostname(), str(os.getpid())]
    else:
        parts = ["job", job]
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=8).hexdigest()


def resolve_identity(cfg: AgentConfig) -> tuple[str, int, int, int, str]:
    """Return ``(job, rank, world_size, local_rank, host)`` from settings, torchrun and torch.distributed."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    env = os.environ

    def pick(own: int, var: str, from_dist, default: int) -> int:
        if own >= 0:
            return own
        if var in env:
            try:
                return int(env[var])
            except ValueError:
                raise ConfigError(f"agent: environment {var}={env[var]!r} is not an integer") from None
        return from_dist() if initialized else default

    rank = pick(cfg.rank, "RANK", dist.get_rank, 0)
    world = pick(cfg.world_size, "WORLD_SIZE", dist.get_world_size, 1)
    local = pick(cfg.local_rank, "LOCAL_RANK", lambda: 0, 0)
    if not 0 <= rank < world:
        raise ConfigError(f"agent.rank must be in [0, world_size={world}), got {rank}")
    job = cfg.job or env.get("TORCHELASTIC_RUN_ID") or "default"
    return job, rank, world, local, cfg.host or socket.gethostname()
