"""Aggregator settings: one typed model; the command line and ``GRADWATCH_AGGREGATOR_*`` variables.

Field descriptions double as ``--help``. Invalid values fail at start-up with
:class:`ConfigError`, whose message names the setting.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from functools import cached_property
from typing import Optional

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gradwatch import auth, wire
from gradwatch.errors import ConfigError  # the one config error; gradwatch.aggregator.ConfigError names it too
from gradwatch.settings import closest, describe, endpoint, known_variables, unknown_variables

from .checks import Thresholds, resolve
from .discovery import SUFFIXES

log = logging.getLogger("gradwatch.aggregator")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class AggregatorConfig(BaseSettings):
    """gradwatch aggregator: receives every rank's reports, reconciles ranks, serves /metrics."""

    model_config = SettingsConfigDict(
        env_prefix="GRADWATCH_AGGREGATOR_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        cli_kebab_case=True,
        cli_prog_name="gradwatch aggregator",
        cli_implicit_flags=True,
    )

    listen: str = Field("tcp://127.0.0.1:5555", description="ZeroMQ endpoint the ROUTER socket binds to; agents connect here (and take its commands on the same connection). Binding beyond loopback (tcp://0.0.0.0:5555) needs --server-key (CURVE), or --insecure-plaintext to accept anyone who reaches the port.")
    metrics_host: str = Field("127.0.0.1", description="Address the HTTP server (/metrics, /api/*, /healthz) binds to; 0.0.0.0 for every interface. It serves no secrets; its control endpoints (/api/stacks, /api/probe, /api/budget) answer only requests bearing --control-token.")
    metrics_port: int = Field(9400, ge=0, le=65535, description="TCP port of the HTTP server; 0 picks a free one.")
    round_grace_s: float = Field(10.0, gt=0, le=3600, description="Seconds a probed step waits for missing ranks before it is reconciled as incomplete.")
    round_slice_ranks: int = Field(2048, ge=0, description="Probed steps of at least this many reporting ranks are reconciled in slices between the writer's batches of frames (a 16,384-rank step takes ~0.6 s, during which no frame would be handled and /metrics would age); 0: each at once.")
    max_pending_rounds: int = Field(64, ge=1, le=10_000, description="Probed steps per job held while waiting for ranks; the oldest is closed incomplete beyond it.")
    max_jobs: int = Field(64, ge=1, description="Jobs holding a slot at once: a job takes one with its first report under a schema it sent, and is exported and judged once proven (--proof-steps); a job that needs a slot when none is free evicts the unproven job least recently heard, never a proven one, and is refused (not admitted: gradwatch_jobs_not_admitted_total) when every slot holds a proven job. A proven job keeps its slot until its ranks are silent for rank_ttl_s.")
    proof_steps: int = Field(3, ge=0, le=1000, description="Messages, each advancing its step (one coalesced batch of many steps counts once), that each of --proof-rank-share of a job's world must send, under one world size and with a schema, before the job is proven: exported and judged (its steps before that are judged then, a few steps late). Until proven it exports no series and raises no finding, so frames of invented jobs raise no alert. 0: every job is proven as it comes (frames of invented jobs are exported and judged).")
    proof_rank_share: float = Field(0.5, gt=0, le=1, description="Share of a job's world (at least one rank) whose ranks must each advance their step in --proof-steps messages for the job to be proven.")
    max_jobs_per_source: int = Field(16, ge=1, description="Slots (--max-jobs) one source (the CURVE key with CURVE on, else the peer's address) holds at once, its proven jobs and unproven ones together: past it a new job of the source's evicts the source's own unproven one, or is not admitted (too_many_jobs) while all of them are proven, so that one sender cannot take every slot. Raise it when many jobs share one address (a NAT) or one CURVE key.")
    max_unproven_per_source: int = Field(4, ge=1, description="Unproven jobs holding a slot that one source (the CURVE key with CURVE on, else the peer's address) holds at once; beyond it a new one of the source's evicts the source's own least recently heard (gradwatch_jobs_unproven_evicted_total), never another source's.")
    max_pending_per_source: int = Field(8, ge=1, description="Jobs without a slot that one source (the CURVE key with CURVE on, else the peer's address) holds at once (of max_pending_jobs in all); beyond it a new one of the source's evicts the source's own least recently heard, one without a schema first (gradwatch_jobs_evicted_total).")
    max_pending_jobs: int = Field(16, ge=1, description="Jobs held that have not yet sent a schema and a report (they take no max_jobs slot); beyond it the least recently heard is evicted (gradwatch_jobs_evicted_total), one without a schema before one with, so invented job ids cannot squat slots, nor push out a starting job without sending schemas faster than its ranks send frames.")
    max_schema_bytes: int = Field(1 << 30, ge=1 << 20, description="Bytes of schemas (approximate, as held: names, shapes, slots) all jobs together keep; a new schema past it is rejected (schema_limit), after a proven job's unused ones are dropped. Jobs not proven (--proof-steps) together keep at most a sixteenth of it (64 MiB as shipped), so invented jobs hold little and cannot crowd out running ones. A 100-layer model's schema is ~70 kB.")
    max_pending_ranks: int = Field(256, ge=1, description="Ranks a job holds before it sent a schema and a report; messages of further ranks are rejected (pending_ranks) until then (each is heard again within a heartbeat).")
    max_series_per_job: int = Field(10_000, ge=0, description="Per-layer series a job's latest probed step may export; the first layers in forward order are kept, the others dropped and counted in gradwatch_job_series_dropped.")
    max_series_total: int = Field(15_000, ge=100, description="Series one scrape of /metrics carries at most, every family together (per-rank, per-job, per-layer, findings' and the aggregator's own); keep it under the scrape's sample_limit (20,000 as shipped). Past it, the jobs of the most ranks (the newest first among equals) export job-level series (gradwatch_job_rank_step{agg}, ...) instead, keeping per-rank series for at most 64 ranks findings name, then the newest jobs' per-layer series go; what is left out is counted in gradwatch_series_left_out. Per-layer series are also given first come, first served within it, so a new job's schema cannot push running jobs off the scrape (drops counted in gradwatch_job_series_dropped).")
    max_pending_bytes: int = Field(512 << 20, ge=1 << 20, description="Bytes of probe arrays a job's open rounds, and its rounds being reconciled in slices, may hold; beyond it the oldest open round is closed incomplete, so memory is bounded per job.")
    max_names: int = Field(10_000, ge=1, le=1_000_000, description="Most parameters, and most slots (leaf module outputs), one schema may list; larger schemas are rejected (bad_field).")
    max_label_len: int = Field(200, ge=32, le=4096, description="Longest module path (or host name) exported as a label value, characters; longer ones are cut, keeping a digest of the whole so they stay distinct.")
    max_step_jump: int = Field(1000, ge=1, description="Steps a rank may advance at once beyond max_step_jump's floor of 10x what its observed step rate explains; larger jumps are rejected (step_jump).")
    boot_takeover_s: float = Field(3.0, gt=0, description="Seconds a rank's agent must have been silent (or have said goodbye) before a message under another boot id may take the rank over; earlier ones are rejected (boot_conflict).")
    restart_grace_s: float = Field(30.0, gt=0, description="Seconds a rank's vote to restart its job (a report from a new boot at an earlier step, or another world size) counts; a restart needs votes from half the world's ranks (ranks past the job's world have none), or the other ranks silent this long.")
    max_world: int = Field(65_536, ge=1, description="Largest world size accepted; larger claims are rejected (world_too_large), bounding per-rank state.")
    rank_ttl_s: float = Field(600.0, gt=0, description="Seconds after which a silent rank's series are no longer exported.")
    max_message_bytes: int = Field(16 * 1024 * 1024, ge=1024, le=1 << 30, description="Largest accepted message, bytes; larger ones are rejected as too_large.")
    server_key: SecretStr = Field(
        SecretStr(""),
        description="This aggregator's CURVE key pair: a path to server.key_secret (gradwatch keys) or the 40-character "
        "Z85 secret key (prefer GRADWATCH_AGGREGATOR_SERVER_KEY to the flag; never logged). Turns CURVE authentication "
        "and encryption on; needs --client-keys. '' for plain TCP.",
    )
    client_keys: str = Field(
        "",
        description="Agents' CURVE public keys admitted with --server-key: a directory of .key files (gradwatch keys' "
        "DIR/clients), one .key file, or one 40-character Z85 public key. Read at start-up.",
    )
    insecure_plaintext: bool = Field(False, description="Accept reports over plain TCP on a --listen address beyond loopback, from anyone who reaches the port (a trusted network only). Without it, such a --listen needs --server-key and --client-keys (gradwatch keys) and the aggregator refuses to start.")
    control_token: SecretStr = Field(
        SecretStr(""),
        description="Bearer token the HTTP control endpoints (/api/stacks, /api/probe, /api/budget; gradwatch stacks and "
        "probe) require, at least 16 characters (prefer GRADWATCH_AGGREGATOR_CONTROL_TOKEN to the flag; never logged). "
        "'' (the default): they answer 403. Stacks the aggregator asks for on its own findings need none.",
    )
    rcv_hwm: int = Field(1000, ge=1, description="ZeroMQ receive high-water mark, messages per connected agent. The intake thread keeps ZeroMQ's queues near empty; this bounds them should it fall behind.")
    max_intake_bytes: int = Field(64 * 1024 * 1024, ge=1024 * 1024, description="Bytes of received frames waiting for the writer thread, all agents together; beyond it frames are dropped and counted (rejected, reason overload), so the aggregator's memory does not grow with the number of agents under overload. At least max_message_bytes.")
    max_intake_frames: int = Field(50_000, ge=100, description="Frames waiting for the writer thread, all agents together; beyond it frames are dropped and counted (reason overload). Bounds how stale what the aggregator shows gets under overload: at most this many frames behind (~3 s at the writer's rate on a small core).")
    publish_interval_s: float = Field(0.25, gt=0, le=60, description="Most seconds between state snapshots that scrapes read; when building one takes longer than a tenth of that (jobs of thousands of ranks), 10x its build time instead, so the receive thread spends at most a tenth of its time on them.")
    events_path: str = Field("", description="JSON-lines file findings are appended to as they are raised, updated (a knock-on folded in) and resolved ('' for none).")
    file_sd_path: str = Field(
        "",
        description="Prometheus file_sd target file (.json, .yml or .yaml) written atomically once the HTTP port is bound "
        "and removed at shutdown, so a Prometheus reading its directory scrapes this aggregator while it runs (one per "
        "Slurm job; docs/operations.md: Beyond one job). '' for none.",
    )
    file_sd_host: str = Field("", description="Host written into the --file-sd-path target; default --metrics-host, or this host's name when that is 0.0.0.0.")
    file_sd_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Target labels written into it: job_id=J,cluster=C (or JSON). 'job' is refused: the rules need job=\"gradwatch\".",
    )
    grafana_url: str = Field("", description="Grafana base URL (http[s]://host[:port][/path]) to post each raised finding to as an annotation ('' for none).")
    grafana_token: str = Field("", description="Grafana service account token for --grafana-url (prefer the environment variable GRADWATCH_AGGREGATOR_GRAFANA_TOKEN).")
    grafana_basic_auth: str = Field("", description="USER:PASSWORD for --grafana-url with basic auth (GRADWATCH_AGGREGATOR_GRAFANA_BASIC_AUTH); ignored when a token is set.")
    enable_checks: list[str] = Field(default_factory=list, description="Checks to run that are off by default (every shipped check is on by default: see the catalog).")
    disable_checks: list[str] = Field(default_factory=list, description="Checks not to run.")
    layer_depth: int = Field(0, ge=0, le=64, description="Per-layer series merge layers into the first N dot-separated components of their module path (0: one series per layer); norms combine as L2 norms, counts add up (docs/operations.md: Cardinality budget).")
    rank_detail_max: int = Field(256, ge=1, description="In jobs with more ranks, only the essential per-rank series (steps, non-finite steps, last seen, drops, losses, flags) are exported for every rank, the others for the ranks a finding names.")
    rank_series_max: int = Field(1024, ge=1, description="In jobs with more ranks, per-rank series are exported only for the ranks an active finding names; job-level series stand in for the others (gradwatch_job_rank_step{agg}, gradwatch_job_steps_total, ...), so a 16,384-rank job fits the scrape's sample_limit (docs/operations.md: Scale).")
    checks: Thresholds = Field(default_factory=Thresholds, description="Thresholds of the cross-rank checks.")

    @field_validator("enable_checks", "disable_checks")
    @classmethod
    def _known_checks(cls, v: list[str]) -> list[str]:
        resolve(v, [])  # raises naming an unknown check
        return v

    @property
    def check_names(self) -> list[str]:
        return resolve(self.enable_checks, self.disable_checks)

    @field_validator("control_token")
    @classmethod
    def _control_token(cls, v: SecretStr) -> SecretStr:
        token = v.get_secret_value()
        if token and (len(token) < 16 or not token.isprintable() or " " in token):
            raise ValueError("must be at least 16 printable characters without spaces (e.g. python -c "
                             "'import secrets; print(secrets.token_urlsafe(24))')")
        return v

    @field_validator("grafana_url")
    @classmethod
    def _grafana_url(cls, v: str) -> str:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError(f"must look like http[s]://host[:port], got {v!r}")
        return v

    @field_validator("max_intake_bytes")
    @classmethod
    def _intake_holds_a_message(cls, v: int, info) -> int:
        most = info.data.get("max_message_bytes")
        if most is not None and v < most:
            raise ValueError(f"must be at least max_message_bytes ({most}), got {v}: the largest message would never fit")
        return v

    @field_validator("file_sd_path")
    @classmethod
    def _file_sd_path(cls, v: str) -> str:
        if v and not v.endswith(SUFFIXES):  # Prometheus picks the format by suffix, and refuses others
            raise ValueError(f"must end in {', '.join(SUFFIXES)} (Prometheus reads the format from it), got {v!r}")
        return v

    @field_validator("file_sd_labels")
    @classmethod
    def _file_sd_labels(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not _LABEL.fullmatch(name) or name.startswith("__"):
                raise ValueError(f"{name!r} is not a Prometheus label name (letters, digits, _; no leading __)")
            if name == "job":  # would rename the scrape job: up{job="gradwatch"} in the rules would miss it
                raise ValueError("'job' is the scrape job's label (the rules need job=\"gradwatch\"); use another name")
        return v

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return endpoint(v, bind=True)

    def curve_keys(self) -> Optional[auth.ServerKeys]:
        """The CURVE keys for the ROUTER socket, or None for plain TCP (neither key set).

        Raises:
            ConfigError: naming ``server_key`` or ``client_keys`` (and the variable it came from):
                only one of them set, a missing or unreadable file, not a Z85 key; naming
                ``listen``: an address beyond loopback without keys and without
                ``insecure_plaintext``.
        """
        secret = self.server_key.get_secret_value()
        if not secret and not self.client_keys:
            if not self.listen_is_local and not self.insecure_plaintext:
                raise ConfigError(
                    f"aggregator.listen{_env('listen')}: {self.listen} is reachable beyond this host, and without CURVE "
                    "keys anyone who reaches it can write to the aggregator's state; run `gradwatch keys DIR` and pass "
                    "--server-key DIR/server.key_secret --client-keys DIR/clients (docs/security.md), or pass "
                    "--insecure-plaintext (GRADWATCH_AGGREGATOR_INSECURE_PLAINTEXT=1) on a network you trust")
            return None
        if not secret or not self.client_keys:
            missing, given = ("client_keys", "server_key") if secret else ("server_key", "client_keys")
            raise ConfigError(f"aggregator.{missing}: needed with {given}{_env(given)} (CURVE takes both: "
                              f"--{missing.replace('_', '-')} or GRADWATCH_AGGREGATOR_{missing.upper()})")
        try:
            public, sec = auth.load_pair(secret)
        except auth.KeyMaterialError as e:
            raise ConfigError(f"aggregator.server_key{_env('server_key')}: {e}") from None
        try:
            clients = auth.load_allowed(self.client_keys)
        except auth.KeyMaterialError as e:
            raise ConfigError(f"aggregator.client_keys{_env('client_keys')}: {e}") from None
        return auth.ServerKeys(public, sec, clients)

    @property
    def listen_is_local(self) -> bool:
        """Whether ``listen`` is reachable from this host only: a loopback address, ipc or inproc."""
        if not self.listen.startswith("tcp://"):
            return True
        host = self.listen[len("tcp://"):].rpartition(":")[0].strip("[]")
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:  # *, an interface name or a host name: not known to be loopback
            return False

    @cached_property  # read for every frame
    def limits(self) -> wire.Limits:
        return wire.Limits(max_message_bytes=self.max_message_bytes, max_names=self.max_names)


def _env(name: str) -> str:
    var = f"GRADWATCH_AGGREGATOR_{name.upper()}"
    return f" ({var})" if var in os.environ else ""


def format_error(e: ValidationError, prefix: str = "aggregator", given=()) -> str:
    return describe(e, prefix, "GRADWATCH_AGGREGATOR_", given)


def warn_unknown_variables() -> list[str]:
    """Log a warning for each ``GRADWATCH_AGGREGATOR_*`` variable that names no setting (a typo
    would be ignored without a word); returns them."""
    unknown = unknown_variables("GRADWATCH_AGGREGATOR_", AggregatorConfig, nested="__")
    known = known_variables("GRADWATCH_AGGREGATOR_", AggregatorConfig, nested="__")
    for var in unknown:
        log.warning("gradwatch: unknown setting %s is ignored (%ssee gradwatch aggregator --help)", var, closest(var, known))
    return unknown


def load(**settings) -> AggregatorConfig:
    """Build the config from keyword arguments over environment variables (unknown
    ``GRADWATCH_AGGREGATOR_*`` variables are warned about).

    Raises:
        ConfigError: naming the first invalid or unknown setting.
    """
    warn_unknown_variables()
    try:
        return AggregatorConfig(**settings)
    except ValidationError as e:
        raise ConfigError(format_error(e, given=settings)) from None
