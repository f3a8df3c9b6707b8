"""The wire format between agents and the aggregator: the one module that builds or parses bytes.

Every message is one ZeroMQ frame holding one msgpack map (msgpack spec:
https://github.com/msgpack/msgpack/blob/master/spec.md) with these common keys:

    v      int    protocol version, :data:`PROTOCOL_VERSION`
    kind   str    "schema" | "report" | "heartbeat"
    job    str    training job id (torchrun's TORCHELASTIC_RUN_ID by default)
    rank   int    global rank, 0 <= rank < world
    world  int    world size
    boot   str    random id of this agent instance; a new one means the rank restarted
    seq    int    per-rank sequence number, +1 per message sent; gaps are messages lost
    time   float  sender's wall clock, seconds since the epoch
    key    str    optional, at most 64 chars: what the job's ranks share, hashed (see
                  ``agent.config.job_key``), so two jobs under one id stay two jobs ("" if absent)

``schema`` adds ``hash`` (16 hex chars), ``host``, ``local_rank``, ``every`` (fixed probe cadence,
steps; 0 when the agent's budget picks it, see the reports' ``probe_interval``), ``params`` (list of ``[name, shape, dtype]`` in ``model.named_parameters()`` order) and
``slots`` (list of ``[module, output, type, dtype]``: one per floating output tensor of a leaf
module, in forward order; ``output`` is a path suffix such as ``""``, ``[0]`` or ``.logits``).

``report`` adds ``schema`` (the hash it refers to), ``step`` (optimizer steps completed before
this one, from 0), ``step_time`` (seconds since the previous step ended), ``compute_time``
(seconds from the previous step's end until this rank's first gradient bucket was ready for
all-reduce: the rank's own work, without waiting for peers; NaN when unknown), ``grad_norm``
(global L2 norm of all gradients before the optimizer step, after all-reduce; may be NaN or Inf),
``loss`` (mean of the losses the training script handed to ``Monitor.observe_loss`` this step;
NaN when none), ``loss_scale`` (the AMP GradScaler's scale at this step; NaN without one),
``skipped`` (steps the loss scaler skipped since the previous report: their inf/NaN gradients
are normal, so they send no report of their own),
``local_grad_norm`` (the same before all-reduce, from the DDP communication hook; NaN when
unknown), ``grad_nonfinite`` (number of parameters whose gradient holds a NaN or Inf), ``micro``
(forward passes of the root module during this step, 0 when not counted), ``batch`` (samples the
rank processed this step, summed over micro-steps; 0 when unknown), ``drops`` (reports this agent
dropped so far), ``burst`` (probed out of cadence after an anomaly), ``agent_cost`` (the agent's
measured average cost as a fraction of the training step time, NaN until measured; optional),
``probe_interval`` (the probe interval in use, steps; optional, 0 when unknown), ``over_budget``
(even the longest probe interval costs over 3 budgets; optional), ``grad_norms`` (optional, sent
on every report, probed or not, by an agent with replicas to compare with: raw little-endian
float32 [n_params], each parameter's gradient L2 norm after all-reduce, as the optimizer's
pre-step hook measures it, of what this rank holds; NaN where the parameter had no gradient, a
non-finite norm as it is) and, when ``probe`` is true,
arrays of raw little-endian bytes, row-major (columns declared once in :mod:`gradwatch.statistics`):

    act        float32 [n_slots, 6]   activation mean, std, min, max, zero ratio, non-finite count
    act_grad   float32 [n_slots, 2]   output-gradient L2 norm, non-finite count
    param      float32 [n_params, 3]  gradient L2 norm (after all-reduce), weight L2 norm,
                                      gradient non-finite count
    act_count  float32 [n_slots, 2]   calls of the slot's module, output elements over the calls
                                      (optional: absent decodes as NaN, not observed)
    fp_grad    uint64  [n_params]     fingerprint of the gradient's bits after all-reduce
    fp_weight  uint64  [n_params]     fingerprint of the weight's bits after the optimizer step

A fingerprint is the sum, modulo 2**64, of a tensor's elements reinterpreted as signed integers
of their own width: exact, independent of reduction order, and equal on two ranks exactly when
(barring a collision) the bits agree. It travels as uint64 bytes, never as a msgpack int or a
float, so no bit is lost.

A count of NaN marks "not observed" (a slot whose module did not run, an output gradient that
never arrived, a parameter without a gradient); a real NaN statistic always comes with a finite
count >= 1.

Parallel layouts (FSDP, HSDP, tensor parallel; optional keys, absent under plain DDP where every
rank holds every parameter whole). A ``schema`` may add ``mesh``, a map ``{"names": [str],
"sizes": [int], "coord": [int]}``: the device mesh's dimension names and sizes and this rank's
coordinates on it; and ``shard``, one ``[dims, numel]`` per parameter in ``params`` order: the mesh
dimensions (indices into ``names``) the parameter is sharded along (``[]``: this rank holds all of
it) and the number of elements this rank holds. ``params`` then lists each parameter by its
original name and global shape, and a probe report's ``param`` rows, like ``grad_norm``, are about
what *this rank holds*: the L2 norm of its local shard (0 for an empty shard). The hash then
covers ``mesh`` and ``shard`` too. A ``report`` may add ``grad_sq``, a list of ``[dims, sumsq]``:
the sum of squared gradient elements of this rank's local shards, per set of sharded-along mesh
dimensions. The aggregator sums ``sumsq`` over the ranks that share every other mesh coordinate
(the shard group), adds the groups, and takes the square root: the exact global gradient norm,
the same quantity ``grad_norm`` is under DDP (never an average of norms). Ranks compare
fingerprints only with ranks holding the same bytes: equal coordinates on a parameter's ``dims``.

Pipeline parallelism: a mesh dimension named ``pp`` (or ``pipeline``, or starting ``pp_`` or
``pipeline_``; :func:`stage_dims`) numbers pipeline stages. Ranks that differ there hold different
parameters, so no parameter is ever sharded along it: shard groups and fingerprint comparisons stay
within one stage (equal coordinates on the stage dims too), and the global gradient norm adds the
stage totals of the ranks that share every other coordinate (one per stage).

``heartbeat`` adds ``step`` (latest step seen, -1 before the first), ``sent`` and ``drops``
(cumulative messages sent and dropped by this agent), ``errors`` (internal agent failures),
``closing`` (the agent is shutting down: the rank finished, it did not go silent), ``in_step_s``
(seconds since the rank's latest optimizer step ended) and ``waiting`` (the rank has handed its
first gradient bucket of the current step to all-reduce, i.e. it waits on its peers) and,
optionally, ``reason`` (why a closing agent stops, one of :data:`CLOSE_REASONS`; "" otherwise) and
``run_s`` (cumulative seconds the training thread has been running or waiting for a CPU, from
Linux's schedstat: a thread blocked in a sleep, a lock or I/O adds nothing; NaN when unknown).

Decoding is defensive: sizes are capped before msgpack allocates anything (case C30), every field
is type-checked, array byte lengths must match the schema's counts, and each failure raises
:class:`WireError` with a reason from :data:`REJECT_REASONS`, a bounded set suitable as a metric
label. This module imports neither torch nor prometheus.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Union

import msgpack
import numpy as np

from gradwatch import statistics
from gradwatch.errors import GradwatchError

PROTOCOL_VERSION = 1

#: column names of the probe arrays, declared in :data:`gradwatch.statistics.STATISTICS`
ACT_FIELDS = statistics.fields("act")
ACT_GRAD_FIELDS = statistics.fields("act_grad")
PARAM_FIELDS = statistics.fields("param")

#: Every reason :func:`decode` may give; the aggregator labels its rejection counter with them.
REJECT_REASONS = (
    "too_large",
    "malformed",
    "extra_data",
    "not_a_map",
    "version",
    "unknown_kind",
    "missing_field",
    "bad_field",
    "bad_array",
)

#: Why an agent says goodbye (``Heartbeat.reason``): training finished (the process exits after its
#: last step), ``Monitor.close()`` was called, the agent switched itself off after repeated
#: errors, or the interpreter is exiting. "" when the heartbeat is not a goodbye or says nothing;
#: a reason a later agent may add decodes as "other".
CLOSE_REASONS = ("", "finished", "closed", "disabled", "exit", "other")

_F32 = np.dtype("<f4")
_U64 = np.dtype("<u8")


class WireError(GradwatchError, ValueError):
    """A frame that is not a valid message. ``reason`` is one of :data:`REJECT_REASONS`."""

    def __init__(self, reason: str, detail: str):
        assert reason in REJECT_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Limits:
    """Caps applied before and during decoding (case C30).

    Attributes:
        max_message_bytes: largest frame accepted, bytes.
        max_names: most parameters, and most slots, one schema may list (each caps series and
            memory: a forged schema with 200,000 names once made a 453 MB scrape).
        max_str_bytes: longest string (a module path), bytes.
    """

    max_message_bytes: int = 16 * 1024 * 1024
    max_names: int = 10_000
    max_str_bytes: int = 4096


@dataclass(frozen=True)
class Header:
    job: str
    rank: int
    world: int
    boot: str
    seq: int
    time: float
    key: str = ""  # the job's identity digest beside its id (module docstring)


@dataclass(frozen=True)
class Mesh:
    """A device mesh as one rank sees it: dimension names and sizes, and its own coordinates."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    coord: tuple[int, ...]


#: mesh dimension names that number pipeline stages (a prefix ``pp_`` or ``pipeline_`` counts too)
STAGE_DIM_NAMES = ("pp", "pipeline")


def stage_dims(mesh: Mesh | None) -> tuple[int, ...]:
    """Indices of ``mesh``'s pipeline-stage dimensions (see the module docstring); () without a mesh."""
    if mesh is None:
        return ()
    return tuple(k for k, n in enumerate(mesh.names)
                 if n in STAGE_DIM_NAMES or n.startswith(tuple(f"{x}_" for x in STAGE_DIM_NAMES)))


@dataclass(frozen=True)
class Schema:
    header: Header
    host: str
    local_rank: int
    every: int
    params: tuple[tuple[str, tuple[int, ...], str], ...]
    slots: tuple[tuple[str, str, str, str], ...]
    hash: str = ""
    mesh: Mesh | None = None
    #: per parameter ``(mesh dims sharded along, local element count)``; () when all are whole
    shard: tuple[tuple[tuple[int, ...], int], ...] = ()

    def __post_init__(self):
        if not self.hash:
            object.__setattr__(self, "hash", schema_hash(self.params, self.slots, self.mesh, self.shard))


@dataclass(frozen=True)
class Report:
    header: Header
    schema: str
    step: int
    step_time: float
    grad_norm: float
    grad_nonfinite: int
    micro: int = 0
    drops: int = 0
    probe: bool = False
    act: np.ndarray | None = field(default=None, compare=False)  # [n_slots, 6] float32
    act_grad: np.ndarray | None = field(default=None, compare=False)  # [n_slots, 2] float32
    param: np.ndarray | None = field(default=None, compare=False)  # [n_params, 3] float32
    act_count: np.ndarray | None = field(default=None, compare=False)  # [n_slots, 2] float32, optional
    fp_grad: np.ndarray | None = field(default=None, compare=False)  # [n_params] uint64
    fp_weight: np.ndarray | None = field(default=None, compare=False)  # [n_params] uint64
    local_grad_norm: float = math.nan
    compute_time: float = math.nan
    loss: float = math.nan
    loss_scale: float = math.nan
    skipped: int = 0
    batch: int = 0
    burst: bool = False
    agent_cost: float = math.nan
    probe_interval: int = 0
    over_budget: bool = False
    #: sharded layouts: ``((mesh dims, sum of squared local gradient elements), ...)``; None under DDP
    grad_sq: tuple[tuple[tuple[int, ...], float], ...] | None = None
    grad_norms: np.ndarray | None = field(default=None, compare=False)  # [n_params] float32, optional


@dataclass(frozen=True)
class Heartbeat:
    header: Header
    step: int
    sent: int
    drops: int
    errors: int
    closing: bool = False
    in_step_s: float = 0.0
    waiting: bool = False
    reason: str = ""  # why a closing agent stops, one of CLOSE_REASONS
    run_s: float = math.nan  # training thread's running + runnable time, seconds (NaN: unknown)


Message = Union[Schema, Report, Heartbeat]


def schema_hash(params, slots, mesh: Mesh | None = None, shard=()) -> str:
    """16 hex chars of BLAKE2b over the canonical msgpack of ``params`` and ``slots`` (and of
    ``mesh`` and ``shard`` when given: without them the hash is what it always was)."""
    body = [[list(map(_plain, p)) for p in params], [list(s) for s in slots]]
    if mesh is not None or shard:
        body += [_mesh_map(mesh), [[list(d), n] for d, n in shard]]
    canon = msgpack.packb(body)
    return hashlib.blake2b(canon, digest_size=8).hexdigest()


def _mesh_map(mesh: Mesh | None):
    return None if mesh is None else {"names": list(mesh.names), "sizes": list(mesh.sizes), "coord": list(mesh.coord)}


def _plain(x):
    return list(x) if isinstance(x, tuple) else x


def _header_map(kind: str, h: Header) -> dict:
    return {
        "v": PROTOCOL_VERSION,
        "kind": kind,
        "job": h.job,
        "rank": h.rank,
        "world": h.world,
        "boot": h.boot,
        "seq": h.seq,
        "time": h.time,
        "key": h.key,
    }


def _array_bytes(a: np.ndarray, cols: int) -> bytes:
    a = np.ascontiguousarray(a, dtype=_F32)
    if a.ndim != 2 or a.shape[1] != cols:
        raise ValueError(f"array must have shape [n, {cols}], got {a.shape}")
    return a.tobytes()


def _u64_bytes(a: np.ndarray, n: int) -> bytes:
    a = np.ascontiguousarray(a, dtype=_U64)
    if a.shape != (n,):
        raise ValueError(f"fingerprints must have shape [{n}], got {a.shape}")
    return a.tobytes()


def encode(msg: Message) -> bytes:
    """Encode one message to a frame. Raises ``ValueError`` for arrays of the wrong shape."""
    if isinstance(msg, Schema):
        m = _header_map("schema", msg.header)
        m.update(
            hash=msg.hash,
            host=msg.host,
            local_rank=msg.local_rank,
            every=msg.every,
            params=[[n, list(s), d] for n, s, d in msg.params],
            slots=[list(s) for s in msg.slots],
        )
        if msg.mesh is not None:
            m["mesh"] = _mesh_map(msg.mesh)
        if msg.shard:
            m["shard"] = [[list(d), int(n)] for d, n in msg.shard]
    elif isinstance(msg, Report):
        m = _header_map("report", msg.header)
        m.update(
            schema=msg.schema,
            step=msg.step,
            step_time=float(msg.step_time),
            grad_norm=float(msg.grad_norm),
            grad_nonfinite=int(msg.grad_nonfinite),
            micro=int(msg.micro),
            drops=int(msg.drops),
            probe=bool(msg.probe),
            local_grad_norm=float(msg.local_grad_norm),
            compute_time=float(msg.compute_time),
            loss=float(msg.loss),
            loss_scale=float(msg.loss_scale),
            skipped=int(msg.skipped),
            batch=int(msg.batch),
            burst=bool(msg.burst),
            agent_cost=float(msg.agent_cost),
            probe_interval=int(msg.probe_interval),
            over_budget=bool(msg.over_budget),
        )
        if msg.grad_sq is not None:
            m["grad_sq"] = [[list(d), float(v)] for d, v in msg.grad_sq]
        if msg.grad_norms is not None:
            m["grad_norms"] = np.ascontiguousarray(msg.grad_norms, dtype=_F32).reshape(-1).tobytes()
        if msg.probe:
            for key, arr in statistics.ARRAYS.items():
                a, cols = getattr(msg, key), len(statistics.fields(key))
                if a is None and arr.optional:
                    a = np.full((np.shape(msg.act if arr.rows == "slots" else msg.param)[0], cols), np.nan)
                m[key] = _array_bytes(a, cols)
            n = np.shape(msg.param)[0]
            m.update(fp_grad=_u64_bytes(msg.fp_grad, n), fp_weight=_u64_bytes(msg.fp_weight, n))
    elif isinstance(msg, Heartbeat):
        m = _header_map("heartbeat", msg.header)
        m.update(
            step=msg.step, sent=msg.sent, drops=msg.drops, errors=msg.errors, closing=bool(msg.closing),
            in_step_s=float(msg.in_step_s), waiting=bool(msg.waiting), reason=msg.reason,
        )
        if not math.isnan(msg.run_s):
            m["run_s"] = float(msg.run_s)
    else:
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    return msgpack.packb(m, use_bin_type=True)


# --- decoding -------------------------------------------------------------------------------


def _get(m: dict, key: str, types, *, nonneg: bool = False):
    if key not in m:
        raise WireError("missing_field", key)
    v = m[key]
    # bool is an int subclass; a bool where a number belongs is a malformed field.
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in _tuple(types)):
        raise WireError("bad_field", f"{key}: {type(v).__name__}")
    if nonneg and v < 0:
        raise WireError("bad_field", f"{key} < 0")
    return v


def _tuple(t):
    return t if isinstance(t, tuple) else (t,)


_NUM = (int, float)


def _header_fast(m: dict) -> Header | None:
    """The header when every field is present and valid (nearly every frame), else None: then
    :func:`_header` finds the first fault and names it. msgpack yields exact types, so ``type(x) is
    int`` is ``_get``'s "an int, not a bool"."""
    try:
        job, world, rank, boot, t, seq = m["job"], m["world"], m["rank"], m["boot"], m["time"], m["seq"]
    except KeyError:
        return None
    key = m.get("key", "")
    if (type(job) is str and type(world) is int and type(rank) is int and type(boot) is str
            and type(seq) is int and type(key) is str and (type(t) is float or type(t) is int)
            and 0 <= rank < world <= 1 << 20 and seq >= 0 and len(boot) <= 64 and len(key) <= 64
            and job and len(job.encode()) <= 256 and math.isfinite(t)):
        return Header(job, rank, world, boot, seq, float(t), key)
    return None


def _header(m: dict, limits: Limits) -> Header:
    h = _header_fast(m)
    if h is not None:
        return h
    job = _get(m, "job", str)
    if not job or len(job.encode()) > 256:
        raise WireError("bad_field", "job: empty or longer than 256 bytes")
    world = _get(m, "world", int)
    rank = _get(m, "rank", int, nonneg=True)
    if not 1 <= world <= 1 << 20 or rank >= world:
        raise WireError("bad_field", f"rank {rank} / world {world}")
    boot = _get(m, "boot", str)
    if len(boot) > 64:
        raise WireError("bad_field", "boot: longer than 64")
    t = float(_get(m, "time", _NUM))
    if not math.isfinite(t):
        raise WireError("bad_field", "time: not finite")
    key = _get(m, "key", str) if "key" in m else ""
    if len(key) > 64:
        raise WireError("bad_field", "key: longer than 64")
    return Header(job=job, rank=rank, world=world, boot=boot, seq=_get(m, "seq", int, nonneg=True), time=t, key=key)


def _array(m: dict, key: str, rows: int | None, cols: int) -> np.ndarray:
    raw = _get(m, key, bytes)
    if len(raw) % (4 * cols):
        raise WireError("bad_array", f"{key}: {len(raw)} bytes is not a multiple of {4 * cols}")
    a = np.frombuffer(raw, dtype=_F32).reshape(-1, cols)
    if rows is not None and a.shape[0] != rows:
        raise WireError("bad_array", f"{key}: {a.shape[0]} rows, schema has {rows}")
    return a


def _fingerprints(m: dict, key: str, rows: int) -> np.ndarray:
    raw = _get(m, key, bytes)
    if len(raw) != 8 * rows:
        raise WireError("bad_array", f"{key}: {len(raw)} bytes for {rows} parameters")
    return np.frombuffer(raw, dtype=_U64)


def _schema(m: dict, h: Header, limits: Limits, known_schema=None) -> Schema:
    digest = _get(m, "hash", str)
    known = known_schema(h, digest) if known_schema is not None else None
    if known is not None:
        # a periodic resend of a schema the receiver already holds: its lists are not parsed
        # again (thousands of entries, resent by every rank every few seconds)
        return Schema(
            header=h, host=_get(m, "host", str), local_rank=_get(m, "local_rank", int, nonneg=True),
            every=_get(m, "every", int, nonneg=True), params=known.params, slots=known.slots, hash=known.hash,
            mesh=known.mesh, shard=known.shard,
        )
    params_raw = _get(m, "params", list)
    slots_raw = _get(m, "slots", list)
    if len(params_raw) > limits.max_names or len(slots_raw) > limits.max_names:
        raise WireError("bad_field", "too many params or slots")
    params = []
    for p in params_raw:
        if (
            not isinstance(p, list)
            or len(p) != 3
            or not isinstance(p[0], str)
            or not isinstance(p[1], list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in p[1])
            or not isinstance(p[2], str)
        ):
            raise WireError("bad_field", "params entry")
        params.append((p[0], tuple(p[1]), p[2]))
    slots = []
    for s in slots_raw:
        if not isinstance(s, list) or len(s) != 4 or not all(isinstance(x, str) for x in s):
            raise WireError("bad_field", "slots entry")
        slots.append(tuple(s))
    sch = Schema(
        header=h,
        host=_get(m, "host", str),
        local_rank=_get(m, "local_rank", int, nonneg=True),
        every=_get(m, "every", int, nonneg=True),
        params=tuple(params),
        slots=tuple(slots),
        mesh=_mesh(m),
        shard=_shard(m, len(params)),
    )
    if sch.hash != digest:
        raise WireError("bad_field", "hash does not match params and slots")
    return sch


def _ints(x, n: int | None = None, bound: int = 1 << 20) -> tuple[int, ...]:
    if (not isinstance(x, list) or (n is not None and len(x) != n)
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < bound for d in x)):
        raise WireError("bad_field", "expected a list of small non-negative ints")
    return tuple(x)


def _grad_norms(m: dict, rows: int | None) -> np.ndarray | None:
    """float32 [n_params] from the optional ``grad_norms`` bytes; ``rows``: the schema's count, or
    None when unknown (then any whole number of floats)."""
    if "grad_norms" not in m:
        return None
    raw = _get(m, "grad_norms", bytes)
    if len(raw) % 4 or (rows is not None and len(raw) != 4 * rows):
        raise WireError("bad_array", f"grad_norms: {len(raw)} bytes for {rows} parameters")
    return np.frombuffer(raw, dtype=_F32)


def _mesh(m: dict) -> Mesh | None:
    if "mesh" not in m:
        return None
    raw = _get(m, "mesh", dict)
    names = raw.get("names")
    if not isinstance(names, list) or not 1 <= len(names) <= 8 or not all(isinstance(x, str) for x in names):
        raise WireError("bad_field", "mesh names")
    sizes = _ints(raw.get("sizes"), len(names))
    coord = _ints(raw.get("coord"), len(names))
    if any(c >= n for c, n in zip(coord, sizes)):
        raise WireError("bad_field", "mesh coord outside the mesh")
    return Mesh(tuple(names), sizes, coord)


def _dims(d) -> tuple[int, ...]:
    dims = _ints(d, bound=8)
    if len(dims) > 8:
        raise WireError("bad_field", "too many mesh dims")
    return dims


def _shard(m: dict, n_params: int) -> tuple:
    if "shard" not in m:
        return ()
    raw = _get(m, "shard", list)
    if len(raw) != n_params:
        raise WireError("bad_field", f"shard: {len(raw)} entries for {n_params} parameters")
    out = []
    for e in raw:
        if not isinstance(e, list) or len(e) != 2:
            raise WireError("bad_field", "shard entry")
        out.append((_dims(e[0]), _ints([e[1]], bound=1 << 62)[0]))
    return tuple(out)


def _grad_sq(m: dict):
    if "grad_sq" not in m:
        return None
    raw = _get(m, "grad_sq", list)
    if len(raw) > 64:
        raise WireError("bad_field", "grad_sq: too many groups")
    out = []
    for e in raw:
        if not isinstance(e, list) or len(e) != 2 or not isinstance(e[1], _NUM) or isinstance(e[1], bool):
            raise WireError("bad_field", "grad_sq entry")
        out.append((_dims(e[0]), float(e[1])))
    return tuple(out)


def _defaults(cls) -> dict:
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def _build(cls, defaults: dict, values: dict):
    """``cls(**values)`` for a frozen dataclass without ``__post_init__``, without its ``__init__``:
    that sets each of a report's 30 fields through ``object.__setattr__`` (4 µs, a third of
    decoding a sentinel report). Same object: every field set, equal and hashed alike."""
    obj = object.__new__(cls)
    obj.__dict__.update(defaults)
    obj.__dict__.update(values)
    return obj


_REPORT_DEFAULTS = _defaults(Report)
_REPORT_FLOATS = ("step_time", "grad_norm", "local_grad_norm", "compute_time", "loss", "loss_scale")
_REPORT_COUNTS = ("step", "grad_nonfinite", "micro", "drops", "skipped", "batch")


def _report_scalars(m: dict) -> dict | None:
    """A report's scalar fields, as :func:`_report` reads them, when every one is present and well
    typed (nearly every report), else None: the careful path then names the first fault. The
    checks are ``_get``'s, with msgpack's exact types (``type(x) is int``: an int, not a bool)."""
    try:
        floats = [m[k] for k in _REPORT_FLOATS]
        counts = [m[k] for k in _REPORT_COUNTS]
        probe, burst, schema = m["probe"], m["burst"], m["schema"]
    except KeyError:
        return None
    cost, interval, over = m.get("agent_cost", math.nan), m.get("probe_interval", 0), m.get("over_budget", False)
    if (type(probe) is not bool or type(burst) is not bool or type(schema) is not str or type(over) is not bool
            or type(interval) is not int or interval < 0 or (type(cost) is not float and type(cost) is not int)):
        return None
    for v in counts:
        if type(v) is not int or v < 0:
            return None
    for v in floats:
        if type(v) is not float and type(v) is not int:
            return None
    out = dict(zip(_REPORT_FLOATS, map(float, floats)))
    out.update(zip(_REPORT_COUNTS, counts))
    out.update(probe=probe, burst=burst, schema=schema, agent_cost=float(cost), probe_interval=interval,
               over_budget=over)
    return out


def _report(m: dict, h: Header, schema_sizes) -> Report:
    fast = _report_scalars(m)
    if fast is not None and not fast["probe"]:
        # a sentinel (every step of every rank): no arrays; grad_sq checked last, as below
        fast.update(header=h, grad_sq=_grad_sq(m))
        if "grad_norms" in m:
            n = schema_sizes(h, fast["schema"])[0] if schema_sizes else None
            fast["grad_norms"] = _grad_norms(m, n)
        return _build(Report, _REPORT_DEFAULTS, fast)
    probe = _get(m, "probe", bool)
    step = _get(m, "step", int, nonneg=True)
    schema = _get(m, "schema", str)
    arrays: dict = dict.fromkeys(statistics.ARRAYS)
    fp_grad = fp_weight = None
    if probe:
        n_params, n_slots = schema_sizes(h, schema) if schema_sizes else (None, None)
        # without a schema, the first array of each kind sets the row count the others must match
        rows = {"params": n_params, "slots": n_slots}
        for key, a in statistics.ARRAYS.items():
            cols = len(statistics.fields(key))
            if a.optional and key not in m:  # an agent from before the array: not observed
                arrays[key] = np.full((rows[a.rows] or 0, cols), np.nan, _F32)
                continue
            arrays[key] = _array(m, key, rows[a.rows], cols)
            rows[a.rows] = arrays[key].shape[0]
        fp_grad = _fingerprints(m, "fp_grad", rows["params"])
        fp_weight = _fingerprints(m, "fp_weight", rows["params"])
        grad_norms = _grad_norms(m, rows["params"])
    else:
        grad_norms = _grad_norms(m, schema_sizes(h, schema)[0] if schema_sizes and "grad_norms" in m else None)
    if fast is not None:  # the scalars were checked above; only the arrays were left to check
        fast.update(arrays, header=h, fp_grad=fp_grad, fp_weight=fp_weight, grad_sq=_grad_sq(m),
                    grad_norms=grad_norms)
        return _build(Report, _REPORT_DEFAULTS, fast)
    return Report(
        header=h,
        schema=schema,
        step=step,
        step_time=float(_get(m, "step_time", _NUM)),
        grad_norm=float(_get(m, "grad_norm", _NUM)),
        grad_nonfinite=_get(m, "grad_nonfinite", int, nonneg=True),
        micro=_get(m, "micro", int, nonneg=True),
        drops=_get(m, "drops", int, nonneg=True),
        probe=probe,
        **arrays,
        fp_grad=fp_grad,
        fp_weight=fp_weight,
        local_grad_norm=float(_get(m, "local_grad_norm", _NUM)),
        compute_time=float(_get(m, "compute_time", _NUM)),
        loss=float(_get(m, "loss", _NUM)),
        loss_scale=float(_get(m, "loss_scale", _NUM)),
        skipped=_get(m, "skipped", int, nonneg=True),
        batch=_get(m, "batch", int, nonneg=True),
        burst=_get(m, "burst", bool),
        # optional: agents before the budget did not send them
        agent_cost=float(_get(m, "agent_cost", _NUM)) if "agent_cost" in m else math.nan,
        probe_interval=_get(m, "probe_interval", int, nonneg=True) if "probe_interval" in m else 0,
        over_budget=_get(m, "over_budget", bool) if "over_budget" in m else False,
        grad_sq=_grad_sq(m),
        grad_norms=grad_norms,
    )


def _heartbeat_fast(m: dict, h: Header) -> Heartbeat | None:
    """The heartbeat when every field is present and valid, else None (see :func:`_header_fast`)."""
    try:
        step, sent, drops, errors = m["step"], m["sent"], m["drops"], m["errors"]
        closing, in_step, waiting = m["closing"], m["in_step_s"], m["waiting"]
    except KeyError:
        return None
    reason = m.get("reason", "")
    run = m.get("run_s", math.nan)
    if (type(run) is float or type(run) is int) and (type(step) is int and type(sent) is int and type(drops) is int and type(errors) is int
            and sent >= 0 and drops >= 0 and errors >= 0 and type(closing) is bool and type(waiting) is bool
            and (type(in_step) is float or type(in_step) is int) and type(reason) is str):
        return Heartbeat(h, step, sent, drops, errors, closing, float(in_step), waiting,
                         reason if reason in CLOSE_REASONS else "other", float(run))
    return None


def decode(frame: bytes, limits: Limits = Limits(), schema_sizes=None, known_schema=None) -> Message:
    """Decode one frame into a :class:`Schema`, :class:`Report` or :class:`Heartbeat`.

    Args:
        frame: the bytes of one ZeroMQ frame.
        limits: size caps; a frame over ``limits.max_message_bytes`` is rejected unread.
        schema_sizes: optional ``(header, schema_hash) -> (n_params, n_slots)`` callable; when
            given, a probe report's arrays, and any report's ``grad_norms``, must have exactly
            those row counts (it may return
            ``(None, None)`` for an unknown schema).
        known_schema: optional ``(header, schema_hash) -> Schema | None``; a schema message whose
            hash it knows reuses that schema's lists instead of parsing its own.

    Raises:
        WireError: with ``reason`` in :data:`REJECT_REASONS`; never anything else.
    """
    if len(frame) > limits.max_message_bytes:
        raise WireError("too_large", f"{len(frame)} bytes")
    n = limits.max_names
    try:
        m = msgpack.unpackb(
            frame,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_bin_len=limits.max_message_bytes,
            max_str_len=limits.max_str_bytes,
            max_array_len=n,
            max_map_len=64,
            max_ext_len=0,
        )
    except msgpack.ExtraData as e:
        raise WireError("extra_data", str(e)[:80]) from None
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise WireError("malformed", f"{type(e).__name__}: {str(e)[:80]}") from None
    if not isinstance(m, dict):
        raise WireError("not_a_map", type(m).__name__)
    v = m.get("v")
    if v != PROTOCOL_VERSION:
        raise WireError("version", f"got {v!r}, speak {PROTOCOL_VERSION}")
    kind = m.get("kind")
    if kind not in ("schema", "report", "heartbeat"):
        raise WireError("unknown_kind", repr(kind)[:40])
    h = _header(m, limits)
    if kind == "schema":
        return _schema(m, h, limits, known_schema)
    if kind == "report":
        return _report(m, h, schema_sizes)
    hb = _heartbeat_fast(m, h)
    if hb is not None:
        return hb
    reason = _get(m, "reason", str) if "reason" in m else ""
    if reason not in CLOSE_REASONS:
        reason = "other"  # bounded: it ends up in findings
    return Heartbeat(
        header=h,
        step=_get(m, "step", int),
        sent=_get(m, "sent", int, nonneg=True),
        drops=_get(m, "drops", int, nonneg=True),
        errors=_get(m, "errors", int, nonneg=True),
        closing=_get(m, "closing", bool),
        in_step_s=float(_get(m, "in_step_s", _NUM)),
        waiting=_get(m, "waiting", bool),
        reason=reason,
        run_s=float(_get(m, "run_s", _NUM)) if "run_s" in m else math.nan,
    )
