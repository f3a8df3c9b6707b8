"""The wire format between agents and the aggregator: the one module that builds or parses bytes.

Protocol version 4. Every message is one ZeroMQ frame holding one msgpack map (msgpack spec:
https://github.com/msgpack/msgpack/blob/master/spec.md). The message types below are msgspec
``Struct``\\ s (https://jcristharif.com/msgspec/): their annotations are the format, msgspec checks
every field's type and bounds while decoding, in C, and the frames are plain msgpack (frames made
with msgpack-python decode here and the reverse; tests/test_wire.py). Keys of every message:

    v       int   protocol version, :data:`PROTOCOL_VERSION`; any other is rejected ("version")
    kind    str   "schema" | "steps" | "report" | "heartbeat" | "stack" | "ack" (agent -> aggregator);
                  "command" (aggregator -> agent, :class:`Command`)
    header  map   the sender (:class:`Header`):
        job    str    training job id (torchrun's TORCHELASTIC_RUN_ID by default), 1-256 chars
        rank   int    global rank, 0 <= rank < world
        world  int    world size, 1 <= world <= 2**20
        boot   str    random id of this agent instance; a new one means the rank restarted
        seq    int    per-rank sequence number, +1 per message sent; gaps are messages lost
        time   float  sender's wall clock, seconds since the epoch (finite)
        key    str    at most 64 chars: what the job's ranks share, hashed (see
                      ``agent.config.job_key``), so two jobs under one id stay two jobs ("" if absent)
        coord  [int]  the rank's coordinates on its schema's device mesh (``mesh`` below), one per
                      mesh dimension; [] (or absent) without a mesh

``schema`` adds ``hash`` (16 hex chars), ``host``, ``local_rank``, ``every`` (fixed probe cadence,
steps; 0 when the agent's budget picks it), ``params`` (``[name, shape, dtype]`` in
``model.named_parameters()`` order) and ``slots`` (``[module, output, type, dtype]``: one per
floating output tensor of a leaf module, in forward order; ``output`` is a path suffix such as
``""``, ``[0]`` or ``.logits``). An agent sends it when it connects or reconnects, when it changes,
and again after 10 s, 20 s, 40 s ... (at most every ``32 x schema_every_s``); between them its
heartbeats carry the hash, which is all the aggregator needs once it holds a schema of that hash
(every rank of a DDP job, or of one pipeline stage, sends the same). ``halt_on`` (optional, not
hashed) lists the checks whose critical finding may halt the rank (the agent's ``on_critical="halt"``
and ``halt_on`` settings); empty (the default) when the aggregator may not halt it.

Per-step records. The values an agent measures at every optimizer step are the columns of
:data:`STEP_COLUMNS` (step, step time, compute time and the CPU wait within it, gradient norm
after and before all-reduce, non-finite parameter count, loss, loss scale, skipped steps). ``steps`` carries the records of
consecutive unprobed steps, coalesced by the agent's sender thread (a few messages per second,
whatever the step rate): ``records``, raw bytes of n packed records of :data:`RECORD` (the columns
in order, little-endian ``int64`` step, ``uint32`` counts, ``float64`` values; 1 <= n <=
:data:`MAX_STEPS`, steps strictly increasing), plus ``schema`` (the hash the steps refer to),
optionally ``grad_norms`` float32 ``[n, n_params]`` (see below) and ``grad_sq_dims`` with
``grad_sq`` float64 ``[n, len(grad_sq_dims)]`` (sharded layouts, below), and the sender's latest
``drops`` (reports this agent dropped so far), ``agent_cost`` (the agent's measured average cost as
a fraction of the training step time, NaN until measured), ``probe_interval`` (steps, 0 when
unknown) and ``over_budget`` (even the longest probe interval costs over 3 budgets).

``report`` is one step's record with the same columns as scalars (and ``drops``, ``agent_cost``,
``probe_interval``, ``over_budget``, ``micro``: forward passes of the root module during the step,
0 when not counted; ``batch``: samples the rank processed in the step, 0 when unknown; ``burst``:
probed out of cadence after an anomaly). The agent sends a report for each probed step; when
``probe`` is true it adds arrays of raw little-endian bytes, row-major (the float32 columns are
declared once in :mod:`gradwatch.columns`):

    act        float32 [n_slots, 6]   activation mean, std, min, max, zero ratio, non-finite count
    act_grad   float32 [n_slots, 2]   output-gradient L2 norm, non-finite count
    param      float32 [n_params, 3]  gradient L2 norm (after all-reduce), weight L2 norm,
                                      gradient non-finite count
    act_count  float32 [n_slots, 2]   calls of the slot's module, output elements over the calls
                                      (optional: absent decodes as NaN, not observed)
    fp_grad    uint64  [n_params]     fingerprint of the gradient's bits after all-reduce
    fp_weight  uint64  [n_params]     fingerprint of the weight's bits after the optimizer step

Column meanings: ``step`` optimizer steps completed before this one, from 0; ``step_time`` seconds
since the previous step ended; ``compute_time`` the rank's own work in the step, without waiting for
peers: seconds from the previous step's end until this rank's first gradient bucket was ready for
all-reduce, plus, where the agent timed it (DDP over gloo: CPU buckets), from the end of its backward pass
(after the all-reduce) to the step's end (NaN when unknown); ``compute_wait`` seconds of that time the rank's training thread
(and the thread that ran its DDP communication hook, when another: an autograd device thread)
spent waiting for a CPU, runnable but not running (Linux schedstat's run-queue wait): time the host
starved the rank of, not its own work (NaN when unknown: no hook, no ``/proc``); ``grad_norm`` global L2 norm of all gradients before the optimizer step,
after all-reduce (NaN or Inf as measured; NaN with no non-finite parameter: the step had no
gradients); ``local_grad_norm`` the same before all-reduce, from the DDP communication hook (NaN
when unknown); ``grad_nonfinite`` parameters whose gradient holds a NaN or Inf; ``loss`` mean of
the losses the script handed to ``Monitor.observe_loss`` in the step (NaN when none);
``loss_scale`` the AMP GradScaler's scale (NaN without one); ``skipped`` steps the loss scaler
skipped since the previous record (their inf/NaN gradients are normal; they send no record);
``nonfinite_skipped`` 1 when the agent's local breaker (``on_nonfinite="skip"``) took this step's
gradients away because they were not finite, so the optimizer step changed nothing, else 0.

``nonfinite_slot`` (sent with the records of unprobed steps by an agent whose NaN guard is on; a
report's int, a steps message's ``int32 [n]``): the first slot, in the order the step's forward
passes called them, whose output held a NaN or an Inf (its sum was not finite) while it held none
at the rank's previous guarded step, -1 when none did or nothing is known (absent: the guard was
off). A probed step's ``act`` says as much and more.

``grad_norms`` (sent with every record by an agent with replicas to compare with): each
parameter's gradient L2 norm after all-reduce, as the optimizer's pre-step hook measures it, of
what this rank holds; NaN where the parameter had no gradient, a non-finite norm as it is.

A fingerprint is the sum, modulo 2**64, of a tensor's elements reinterpreted as signed integers
of their own width: exact, independent of reduction order, and equal on two ranks exactly when
(barring a collision) the bits agree. It travels as uint64 bytes, never as a msgpack int or a
float, so no bit is lost.

A count of NaN marks "not observed" (a slot whose module did not run, an output gradient that
never arrived, a parameter without a gradient); a real NaN statistic always comes with a finite
count >= 1.

Parallel layouts (FSDP, HSDP, tensor parallel; optional keys, absent under plain DDP where every
rank holds every parameter whole). A ``schema`` may add ``mesh``, a map ``{"names": [str],
"sizes": [int]}``: the device mesh's dimension names and sizes; and ``shard``, one ``dims`` per
parameter in ``params`` order: the mesh dimensions (indices into ``names``) the parameter is
sharded along (``[]``: every rank holds all of it). The hash then covers ``mesh`` and ``shard``
too. What differs between the ranks of a mesh, their coordinates, travels in every header
(``coord``), never in the schema: the ranks of one pipeline stage send one schema, under one hash,
whatever their data- and tensor-parallel coordinates, as DDP ranks do (a 16,384-rank sharded job's
schemas, one per rank, were 245 MB at every resend). ``params`` lists each parameter by its
original name and global shape, and a probe report's ``param`` rows, like ``grad_norm``, are about
what *this rank holds*: the L2 norm of its local shard (0 for an empty shard). A record may add ``grad_sq``: the sum of squared gradient
elements of this rank's local shards per set of sharded-along mesh dimensions (a report: a list of
``[dims, sumsq]``; steps: the sets once in ``grad_sq_dims``, the sums per step). The aggregator sums
``sumsq`` over the ranks that share every other mesh coordinate (the shard group), adds the groups,
and takes the square root: the exact global gradient norm, the same quantity ``grad_norm`` is
under DDP (never an average of norms). Ranks compare fingerprints only with ranks holding the same
bytes: equal coordinates on a parameter's ``dims``.

Pipeline parallelism: a mesh dimension named ``pp`` (or ``pipeline``, or starting ``pp_`` or
``pipeline_``; :func:`stage_dims`) numbers pipeline stages. Ranks that differ there hold different
parameters, so no parameter is ever sharded along it: shard groups and fingerprint comparisons stay
within one stage (equal coordinates on the stage dims too), and the global gradient norm adds the
stage totals of the ranks that share every other coordinate (one per stage).

``heartbeat`` adds ``step`` (latest step seen, -1 before the first), ``sent`` and ``drops``
(cumulative messages sent and dropped by this agent), ``errors`` (internal agent failures),
``closing`` (the agent is shutting down: the rank finished, it did not go silent), ``in_step_s``
(seconds since the rank's latest optimizer step ended), ``waiting`` (the rank has handed a gradient bucket
of the current step to all-reduce and, where the agent times it (CPU buckets), the backward pass
that did has not ended: it waits on its peers), ``reason`` (why a
closing agent stops, one of :data:`CLOSE_REASONS`; "" otherwise), ``run_s`` (cumulative seconds the
training thread has been running or waiting for a CPU, from Linux's schedstat: a thread blocked in
a sleep, a lock or I/O adds nothing; NaN when unknown) and ``schema`` (the hash of the schema the
rank's records refer to, "" before its first probe).

The control channel. The agent's socket is a ZeroMQ DEALER connected to the aggregator's ROUTER:
the frames above go one way, and the aggregator answers on the same connection with ``command``
frames (:class:`Command`, at most :data:`MAX_COMMAND_BYTES`): ``id`` (random, 63 bits), ``job``,
``rank`` (-1: every rank of the job), ``boot`` ("" for any), ``issued`` and ``expires``
(aggregator wall clock, seconds; expires at most :data:`COMMAND_TTL_S` after issued), and
``args``, a map tagged by its own ``kind``: ``stacks`` (``source``: send source lines), ``probe``
(``start`` step, ``steps`` 1 to 1,000, ``layers`` up to 16 fnmatch patterns of module paths),
``budget`` (``budget`` 0.001 to 0.2 for ``for_s`` 1 to 3,600 seconds) or ``halt`` (``step``,
``check``, ``summary``). The agent answers a ``stacks`` command with a ``stack`` message:
``command`` (the id), ``frames`` (the training thread's Python frames, outermost first, innermost
last, at most :data:`MAX_FRAMES`: the innermost kept; each ``[file, line, function, source]``,
source "" unless the agent's ``stack_source`` setting is on), ``in_step_s``, ``waiting`` (as a
heartbeat's), ``flight`` (at most :data:`MAX_FLIGHT` ``[collective, state, sequence]`` of torch's
Flight Recorder, newest last, when it is enabled), ``flight_error`` and ``error`` (why there is no
stack or no flight record, "" when there is). Every other command is answered with an ``ack``:
``command``, ``accepted``, ``step`` (the step it takes effect at, -1 when refused) and ``why``
(one of :data:`ACK_REASONS`, "" when accepted). A command is never accepted from an agent, nor a
data kind by an agent (reason "direction").

Decoding is defensive (case C30): a frame over ``Limits.max_message_bytes`` is rejected unread;
msgspec allocates nothing a length prefix claims beyond the frame; every field is type-checked and
bounded (strings, lists, counts); array byte lengths must match their columns and, when the
receiver knows the schema, its row counts. Each failure raises :class:`WireError` with a reason from
:data:`REJECT_REASONS`, a bounded set suitable as a metric label. Unknown keys are ignored (a later
agent may add optional ones). This module imports neither torch nor prometheus.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Optional, Union

import msgpack
import msgspec
import numpy as np

from gradwatch import columns
from gradwatch.errors import GradwatchError

PROTOCOL_VERSION = 4

#: column names of the probe arrays, declared in :data:`gradwatch.columns.STATISTICS`
ACT_FIELDS = columns.fields("act")
ACT_GRAD_FIELDS = columns.fields("act_grad")
PARAM_FIELDS = columns.fields("param")

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
    "direction",
)

#: Why an agent says goodbye (``Heartbeat.reason``): training finished (the process exits after its
#: last step), ``Monitor.close()`` was called, the agent switched itself off after repeated
#: errors, the interpreter is exiting, or the agent raised ``gradwatch.Halt`` at the step the
#: aggregator named. "" when the heartbeat is not a goodbye or says nothing; a reason a later agent
#: may add decodes as "other".
CLOSE_REASONS = ("", "finished", "closed", "disabled", "exit", "other", "halted")

#: what a command asks of an agent (``Command.args``' kind)
COMMAND_KINDS = ("stacks", "probe", "budget", "halt")
#: largest command frame, bytes, either way (the encoder refuses a larger one, the agent rejects it)
MAX_COMMAND_BYTES = 4096
#: longest a command lives, seconds from ``issued`` to ``expires``
COMMAND_TTL_S = 600.0
#: most frames one stack carries (the innermost are kept), and most Flight Recorder entries
MAX_FRAMES = 64
MAX_FLIGHT = 32
#: why an agent refused a command (``Ack.why``; "" when accepted); a reason a later agent may add
#: decodes as "other"
ACK_REASONS = ("", "expired", "disabled", "out_of_bounds", "passed", "other")
#: the kinds an agent sends (a ``command`` among them is refused, reason "direction")
AGENT_KINDS = ("schema", "steps", "report", "heartbeat", "stack", "ack")

#: most parameters, and most slots, any schema may list (``Limits.max_names`` is the configurable cap)
MAX_NAMES = 200_000
#: most records one ``steps`` message carries
MAX_STEPS = 4096


class WireError(GradwatchError, ValueError):
    """A frame that is not a valid message. ``reason`` is one of :data:`REJECT_REASONS`."""

    def __init__(self, reason: str, detail: str):
        assert reason in REJECT_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Limits:
    """Caps applied before and after decoding (case C30); the fixed ones are in the types below.

    Attributes:
        max_message_bytes: largest frame accepted, bytes.
        max_names: most parameters, and most slots, one schema may list (each caps series and
            memory: a forged schema with 200,000 names once made a 453 MB scrape); at most
            :data:`MAX_NAMES`.
    """

    max_message_bytes: int = 16 * 1024 * 1024
    max_names: int = 10_000


# --- field types: msgspec checks these while decoding ------------------------------------------

_Nat = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_Str64 = Annotated[str, msgspec.Meta(max_length=64)]
_Name = Annotated[str, msgspec.Meta(max_length=4096)]  # a module path, a host name
_MeshDim = Annotated[int, msgspec.Meta(ge=0, lt=8)]
_Dims = Annotated[tuple[_MeshDim, ...], msgspec.Meta(max_length=8)]
_Coord = Annotated[tuple[Annotated[int, msgspec.Meta(ge=0, lt=1 << 20)], ...], msgspec.Meta(max_length=8)]
#: most dims a parameter's shape may list. PyTorch sets no limit (its CUDA kernels' indexing takes
#: 25); without one a 16 MiB frame of one-byte dims became ~130 MB of tuple held per schema
MAX_DIMS = 64
_Shape = Annotated[tuple[_Nat, ...], msgspec.Meta(max_length=MAX_DIMS)]


class _Message(msgspec.Struct, frozen=True, tag_field="kind"):
    """Base of the four message types: tagged by ``kind``."""


class Header(msgspec.Struct, frozen=True):
    """The sender of a message (module docstring: ``header``)."""

    job: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    rank: _Nat
    world: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    boot: _Str64
    seq: _Nat
    time: float
    key: _Str64 = ""  # the job's identity digest beside its id
    coord: _Coord = ()  # the rank's coordinates on its schema's mesh; () without one


class Mesh(msgspec.Struct, frozen=True):
    """A device mesh: dimension names and sizes; with ``coord``, one rank's coordinates on it.

    A schema's mesh has no coordinates (they travel in each message's :class:`Header`); the
    aggregator places each rank on its schema's mesh with the coordinates its header gives."""

    names: Annotated[tuple[_Str64, ...], msgspec.Meta(min_length=1, max_length=8)]
    sizes: tuple[Annotated[int, msgspec.Meta(ge=1, lt=1 << 20)], ...]
    coord: _Coord = ()

    def fits(self, coord: tuple) -> bool:
        """``coord`` is a point of this mesh: one coordinate per dimension, each below its size."""
        return len(coord) == len(self.sizes) and all(c < n for c, n in zip(coord, self.sizes))


#: mesh dimension names that number pipeline stages (a prefix ``pp_`` or ``pipeline_`` counts too)
STAGE_DIM_NAMES = ("pp", "pipeline")


def stage_dims(mesh: Mesh | None) -> tuple[int, ...]:
    """Indices of ``mesh``'s pipeline-stage dimensions (see the module docstring); () without a mesh."""
    return () if mesh is None else _stage_dims(mesh.names)


@functools.lru_cache(maxsize=256)  # asked per rank per step at scale; names are few (peers': bounded)
def _stage_dims(names: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(k for k, n in enumerate(names)
                 if n in STAGE_DIM_NAMES or n.startswith(tuple(f"{x}_" for x in STAGE_DIM_NAMES)))


class Schema(_Message, tag="schema"):
    """A rank's model layout (module docstring: ``schema``); ``hash`` is computed when not given."""

    header: Header
    host: _Name
    local_rank: _Nat
    every: _Nat
    params: Annotated[tuple[tuple[_Name, _Shape, _Str64], ...], msgspec.Meta(max_length=MAX_NAMES)]
    slots: Annotated[tuple[tuple[_Name, _Name, _Name, _Str64], ...], msgspec.Meta(max_length=MAX_NAMES)]
    hash: _Str64 = ""
    mesh: Optional[Mesh] = None
    #: per parameter, the mesh dims it is sharded along; () when all are whole
    shard: Annotated[tuple[_Dims, ...], msgspec.Meta(max_length=MAX_NAMES)] = ()
    #: the checks whose critical finding may halt this rank (not hashed: a setting, not the layout)
    halt_on: Annotated[tuple[_Str64, ...], msgspec.Meta(max_length=16)] = ()
    v: int = PROTOCOL_VERSION

    def __post_init__(self):
        if not self.hash:
            msgspec.structs.force_setattr(self, "hash", schema_hash(self.params, self.slots, self.mesh, self.shard))


# --- the per-step record, declared once ----------------------------------------------------------


class _Required:
    def __repr__(self):
        return "REQUIRED"


#: :attr:`Column.default` of a value every record must carry
REQUIRED: Any = _Required()


@dataclass(frozen=True)
class Column:
    """One value an agent measures at every step: a scalar of a :class:`Report`, an array of a
    :class:`Steps` (``dtype``, little-endian), a column of the aggregator's step table.

    Attributes:
        name: the key, the attribute of both messages.
        dtype: numpy dtype of its ``steps`` array: ``<i8`` (the step), ``<u4`` (counts), ``<f8``.
        default: a report's value when not given (:data:`REQUIRED`: none); a ``steps`` message may leave
            out a column whose every value is its default (never a required one).
    """

    name: str
    dtype: str
    default: Any = REQUIRED

    @property
    def count(self) -> bool:
        return self.dtype != "<f8"


#: The per-step record (module docstring: "Column meanings"), in a report's positional order.
STEP_COLUMNS: tuple[Column, ...] = (
    Column("step", "<i8"),
    Column("step_time", "<f8"),
    Column("grad_norm", "<f8"),
    Column("grad_nonfinite", "<u4"),
    Column("local_grad_norm", "<f8", math.nan),
    Column("compute_time", "<f8", math.nan),
    Column("compute_wait", "<f8", math.nan),
    Column("loss", "<f8", math.nan),
    Column("loss_scale", "<f8", math.nan),
    Column("skipped", "<u4", 0),
    Column("nonfinite_skipped", "<u4", 0),
)
COLUMNS: dict[str, Column] = {c.name: c for c in STEP_COLUMNS}

_GradSq = tuple[tuple[_Dims, float], ...]
_Slot = Annotated[int, msgspec.Meta(ge=-1, lt=MAX_NAMES)]  # a slot index, -1: none

#: the sender's state, sent with each report and each steps message (its latest values)
_SENDER_FIELDS = (
    ("drops", _Nat, 0),
    ("agent_cost", float, math.nan),
    ("probe_interval", _Nat, 0),
    ("over_budget", bool, False),
)


def _scalar(c: Column):
    return _Nat if c.count else float


#: The probed step's arrays beside :data:`gradwatch.columns.ARRAYS`: ``key -> (dtype, columns,
#: rows)``, columns 0 for one value per row; rows ``"slots"`` or ``"params"``.
PROBE_ARRAYS: dict[str, tuple[str, int, str]] = {
    **{k: ("<f4", len(columns.fields(k)), a.rows) for k, a in columns.ARRAYS.items()},
    "fp_grad": ("<u8", 0, "params"),
    "fp_weight": ("<u8", 0, "params"),
}

# PROBE_ARRAYS as the encoder and decoder read them: (key, dtype, columns, row kind, bytes a row, optional)
_PROBE_PLAN = tuple(
    (key, np.dtype(dtype), cols, kind, np.dtype(dtype).itemsize * max(cols, 1),
     key in columns.ARRAYS and columns.ARRAYS[key].optional)
    for key, (dtype, cols, kind) in PROBE_ARRAYS.items()
)


_Array = Optional[np.ndarray]  # raw bytes on the wire (module docstring), an ndarray decoded

Report = msgspec.defstruct(
    "Report",
    [
        ("header", Header),
        ("schema", _Str64),
        *((c.name, _scalar(c)) for c in STEP_COLUMNS if c.default is REQUIRED),
        ("micro", _Nat, 0),
        ("probe", bool, False),
        *((c.name, _scalar(c), c.default) for c in STEP_COLUMNS if c.default is not REQUIRED),
        *_SENDER_FIELDS,
        ("batch", _Nat, 0),
        ("burst", bool, False),
        *((k, _Array, None) for k in PROBE_ARRAYS),
        #: sharded layouts: ``((mesh dims, sum of squared local gradient elements), ...)``; None under DDP
        ("grad_sq", Optional[Annotated[_GradSq, msgspec.Meta(max_length=64)]], None),
        ("grad_norms", _Array, None),  # [n_params] float32, optional
        ("nonfinite_slot", Optional[_Slot], None),  # the NaN guard's, optional
        ("v", int, PROTOCOL_VERSION),
    ],
    bases=(_Message,), tag="report", frozen=True, eq=False, module=__name__,
)
Report.__doc__ = """One step's record, with a probed step's arrays (module docstring: ``report``).

Positional: ``Report(header, schema, step, step_time, grad_norm, grad_nonfinite, ...)``; the rest
by keyword. Arrays may be given in any dtype and are encoded in the wire's; decoded, they are
read-only numpy views of the frame: float32 [rows, columns] (uint64 [n_params] fingerprints)."""

#: one record of a ``steps`` message: the columns of :data:`STEP_COLUMNS` packed, little-endian
RECORD = np.dtype([(c.name, c.dtype) for c in STEP_COLUMNS])


class Steps(_Message, tag="steps", eq=False):
    """Coalesced records of consecutive unprobed steps (module docstring: ``steps``).

    ``records`` is a structured array [n] of :data:`RECORD` (a read-only view of the frame when
    decoded); each column of :data:`STEP_COLUMNS` reads as an attribute, an array [n]
    (``m.step``, ``m.grad_norm``). Build one with :meth:`of` from reports or with :meth:`columns`
    from arrays."""

    header: Header
    schema: _Str64
    records: np.ndarray  # RECORD [n], raw bytes on the wire
    drops: _Nat = 0
    agent_cost: float = math.nan
    probe_interval: _Nat = 0
    over_budget: bool = False
    grad_norms: _Array = None  # float32 [n, n_params]
    grad_sq_dims: Annotated[tuple[_Dims, ...], msgspec.Meta(max_length=64)] = ()
    grad_sq: _Array = None  # float64 [n, len(grad_sq_dims)]
    nonfinite_slot: _Array = None  # int32 [n], the NaN guard's
    v: int = PROTOCOL_VERSION

    def __len__(self) -> int:
        return len(self.records)

    @classmethod
    def columns(cls, header: Header, schema: str, **kw) -> "Steps":
        """A steps message from one array [n] (or sequence) per column of :data:`STEP_COLUMNS`;
        a column left out holds its default (a required one raises ``ValueError``). Other keywords
        are the message's own fields."""
        n = len(kw["step"])
        rec = np.zeros(n, RECORD)
        for c in STEP_COLUMNS:
            if c.name in kw:
                rec[c.name] = kw.pop(c.name)
            elif c.default is REQUIRED:
                raise ValueError(f"a steps message needs {c.name}")
            else:
                rec[c.name] = c.default
        return cls(header, schema, rec, **kw)

    @classmethod
    def of(cls, reports, header: Optional[Header] = None) -> "Steps":
        """The steps message of ``reports`` (unprobed :class:`Report`\\ s of one rank, ascending
        steps, one schema; the sender fields and ``header`` from the last one unless given).
        Raises ``ValueError`` on an empty list."""
        if not reports:
            raise ValueError("no records")
        last = reports[-1]
        rec = np.array([tuple(getattr(r, c.name) for c in STEP_COLUMNS) for r in reports], RECORD)
        extra = {}
        if last.grad_norms is not None:
            extra["grad_norms"] = np.stack([np.asarray(r.grad_norms, np.float32) for r in reports])
        if last.grad_sq is not None:
            extra["grad_sq_dims"] = tuple(d for d, _ in last.grad_sq)
            extra["grad_sq"] = np.array([[v for _, v in r.grad_sq] for r in reports], np.float64)
        slots = [r.nonfinite_slot for r in reports]
        if any(x is not None for x in slots):  # a record the guard did not watch knows nothing: -1
            extra["nonfinite_slot"] = np.array([-1 if x is None else x for x in slots], np.int32)
        return cls(header if header is not None else last.header, last.schema, rec, **extra,
                   **{name: getattr(last, name) for name, _, _ in _SENDER_FIELDS})


for _c in STEP_COLUMNS:  # m.step, m.grad_norm, ...: the records' columns
    setattr(Steps, _c.name, property(lambda self, _n=_c.name: self.records[_n], doc=f"{_c.dtype} [n]: the records' {_c.name}"))

Heartbeat = msgspec.defstruct(
    "Heartbeat",
    [
        ("header", Header),
        ("step", Annotated[int, msgspec.Meta(ge=-1, le=(1 << 63) - 1)]),
        ("sent", _Nat),
        ("drops", _Nat),
        ("errors", _Nat),
        ("closing", bool, False),
        ("in_step_s", float, 0.0),
        ("waiting", bool, False),
        ("reason", _Str64, ""),  # why a closing agent stops, one of CLOSE_REASONS
        ("run_s", float, math.nan),  # training thread's running + runnable time, seconds (NaN: unknown)
        ("schema", _Str64, ""),  # the hash the rank's records refer to
        ("v", int, PROTOCOL_VERSION),
    ],
    bases=(_Message,), tag="heartbeat", frozen=True, module=__name__,
)
Heartbeat.__doc__ = "An agent's sign of life and counters (module docstring: ``heartbeat``)."


# --- the control channel (module docstring: "The control channel") --------------------------------

_Id = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # a command's id: random, 63 bits (msgspec bounds an int64)
_Pattern = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]


class StacksArgs(msgspec.Struct, frozen=True, tag_field="kind", tag="stacks"):
    """Send the training thread's Python stack (a :class:`Stack`); ``source``: with source lines,
    if the agent's ``stack_source`` setting allows them."""

    source: bool = False


class ProbeArgs(msgspec.Struct, frozen=True, tag_field="kind", tag="probe"):
    """Probe steps ``[start, start + steps)`` whatever the budget says; ``layers``: only the leaf
    modules whose path matches one of these fnmatch patterns (none: every layer)."""

    start: _Nat
    steps: Annotated[int, msgspec.Meta(ge=1, le=1000)]
    layers: Annotated[tuple[_Pattern, ...], msgspec.Meta(max_length=16)] = ()


class BudgetArgs(msgspec.Struct, frozen=True, tag_field="kind", tag="budget"):
    """Use ``budget`` (a fraction of the step time) in place of the agent's own for ``for_s`` seconds."""

    budget: Annotated[float, msgspec.Meta(ge=0.001, le=0.2)]
    for_s: Annotated[float, msgspec.Meta(ge=1.0, le=3600.0)]


class HaltArgs(msgspec.Struct, frozen=True, tag_field="kind", tag="halt"):
    """Raise ``gradwatch.Halt`` before the optimizer step of the first step >= ``step`` (only in
    an agent attached with ``on_critical="halt"`` and ``check`` among its ``halt_on``)."""

    step: _Nat
    check: _Str64
    summary: Annotated[str, msgspec.Meta(max_length=512)] = ""


CommandArgs = Union[StacksArgs, ProbeArgs, BudgetArgs, HaltArgs]


class Command(_Message, tag="command"):
    """What the aggregator asks of one rank, or of every rank of a job (module docstring: "The
    control channel"). ``issued`` and ``expires`` are the aggregator's wall clock, seconds."""

    id: _Id
    job: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    rank: Annotated[int, msgspec.Meta(ge=-1, lt=1 << 20)]
    boot: _Str64
    issued: float
    expires: float
    args: CommandArgs
    v: int = PROTOCOL_VERSION

    @property
    def action(self) -> str:
        """The kind of ``args``: one of :data:`COMMAND_KINDS`."""
        return self.args.__struct_config__.tag


class Frame(msgspec.Struct, frozen=True, array_like=True):
    """One Python frame of a stack: ``[file, line, function, source]`` on the wire."""

    file: Annotated[str, msgspec.Meta(max_length=512)]
    line: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
    function: Annotated[str, msgspec.Meta(max_length=256)]
    source: Annotated[str, msgspec.Meta(max_length=256)] = ""

    def where(self) -> str:
        """``file:line function``, as stack listings print a frame."""
        return f"{self.file}:{self.line} {self.function}"


class FlightEntry(msgspec.Struct, frozen=True, array_like=True):
    """One collective of torch's Flight Recorder: ``[collective, state, sequence]`` on the wire."""

    collective: Annotated[str, msgspec.Meta(max_length=128)]
    state: Annotated[str, msgspec.Meta(max_length=32)]
    sequence: Annotated[str, msgspec.Meta(max_length=32)]


class Stack(_Message, tag="stack"):
    """The training thread's Python stack, the answer to a ``stacks`` command (module docstring)."""

    header: Header
    command: _Id
    frames: Annotated[tuple[Frame, ...], msgspec.Meta(max_length=MAX_FRAMES)] = ()
    in_step_s: float = math.nan
    waiting: bool = False
    flight: Annotated[tuple[FlightEntry, ...], msgspec.Meta(max_length=MAX_FLIGHT)] = ()
    flight_error: Annotated[str, msgspec.Meta(max_length=256)] = ""
    error: Annotated[str, msgspec.Meta(max_length=256)] = ""
    v: int = PROTOCOL_VERSION


class Ack(_Message, tag="ack"):
    """An agent's answer to a ``probe``, ``budget`` or ``halt`` command (module docstring)."""

    header: Header
    command: _Id
    accepted: bool
    step: Annotated[int, msgspec.Meta(ge=-1, le=(1 << 63) - 1)] = -1
    why: _Str64 = ""
    v: int = PROTOCOL_VERSION


Message = Union[Schema, Steps, Report, Heartbeat, Stack, Ack]


def schema_hash(params, slots, mesh: Mesh | None = None, shard=()) -> str:
    """16 hex chars of BLAKE2b over the canonical msgpack of ``params`` and ``slots`` (and of
    ``mesh``'s names and sizes and ``shard`` when given: without them the hash is what it always
    was). Never a rank's coordinates: the ranks of one stage share the hash."""
    body = [[[p[0], list(p[1]), p[2]] for p in params], [list(s) for s in slots]]
    if mesh is not None or shard:
        mesh_map = None if mesh is None else {"names": list(mesh.names), "sizes": list(mesh.sizes)}
        body += [mesh_map, [list(d) for d in shard]]
    canon = msgpack.packb(body)
    return hashlib.blake2b(canon, digest_size=8).hexdigest()


# --- encoding ------------------------------------------------------------------------------------

def _plain(obj):
    """msgspec's hook for values it does not know: numpy scalars (case C32) as Python numbers."""
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_plain)


def _bytes(a, dtype: str, shape: tuple) -> bytes:
    """``a`` in ``dtype``, checked against ``shape`` (None: any length there), as raw bytes."""
    a = np.ascontiguousarray(a, dtype=dtype)
    if a.ndim != len(shape) or any(n is not None and n != m for n, m in zip(shape, a.shape)):
        want = ", ".join("n" if n is None else str(n) for n in shape)
        raise ValueError(f"array must have shape [{want}], got {list(a.shape)}")
    return a.tobytes()


def _probe_bytes(msg) -> dict:
    rows = {"slots": None, "params": None}
    out = {}
    for key, dtype, cols, kind, size, optional in _PROBE_PLAN:  # the decoder's plan, mirrored
        a = getattr(msg, key)
        if a is None:
            if optional:
                continue  # decodes as all NaN: not observed
            raise ValueError(f"a probe report needs {key}")
        out[key] = _bytes(a, dtype, (rows[kind], cols) if cols else (rows[kind],))
        rows[kind] = len(out[key]) // size
    return out


def probe_bytes(n_params: int, n_slots: int) -> int:
    """Bytes of a probe report's arrays (:data:`PROBE_ARRAYS`) under a schema of ``n_params``
    parameters and ``n_slots`` slots; the frame adds its header and scalars (~200 bytes)."""
    n = {"params": n_params, "slots": n_slots}
    return sum(size * n[kind] for _, _, _, kind, size, _ in _PROBE_PLAN)


def encode(msg: Message) -> bytes:
    """Encode one message to a frame. Raises ``ValueError`` for arrays of the wrong shape (or a
    probe report without its arrays), ``TypeError`` for anything but a message."""
    if isinstance(msg, Report):
        arrays = _probe_bytes(msg) if msg.probe else dict.fromkeys(PROBE_ARRAYS)
        if msg.grad_norms is not None:
            arrays["grad_norms"] = _bytes(np.reshape(msg.grad_norms, -1), "<f4", (None,))
        msg = msgspec.structs.replace(msg, **arrays)
    elif isinstance(msg, Steps):
        rec = msg.records
        if rec.dtype != RECORD or rec.ndim != 1:
            raise ValueError(f"records must be wire.RECORD [n], got {rec.dtype} {list(rec.shape)}")
        n = len(rec)
        arrays = {"records": np.ascontiguousarray(rec).tobytes()}
        if msg.grad_norms is not None:
            arrays["grad_norms"] = _bytes(msg.grad_norms, "<f4", (n, None))
        if msg.grad_sq is not None:
            arrays["grad_sq"] = _bytes(msg.grad_sq, "<f8", (n, len(msg.grad_sq_dims)))
        if msg.nonfinite_slot is not None:
            arrays["nonfinite_slot"] = _bytes(msg.nonfinite_slot, "<i4", (n,))
        msg = msgspec.structs.replace(msg, **arrays)
    elif isinstance(msg, Command):
        frame = _ENCODER.encode(msg)
        if len(frame) > MAX_COMMAND_BYTES:
            raise ValueError(f"a command is at most {MAX_COMMAND_BYTES} bytes, this one {len(frame)}")
        return frame
    elif not isinstance(msg, (Schema, Heartbeat, Stack, Ack)):
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    return _ENCODER.encode(msg)


# --- decoding ------------------------------------------------------------------------------------


def _raw(tp, obj):
    """msgspec's hook for the ``np.ndarray`` fields: the bytes as uint8, typed by :func:`_typed`."""
    if tp is np.ndarray and type(obj) is bytes:
        return np.frombuffer(obj, np.uint8)
    raise TypeError("expected bytes")


_DECODER = msgspec.msgpack.Decoder(Message, dec_hook=_raw)


class _Envelope(msgspec.Struct):
    v: Any = None
    kind: Any = None


_PEEK = msgspec.msgpack.Decoder(_Envelope)


def _typed(raw: np.ndarray, key: str, dtype, cols: int, rows: Optional[int], size: int = 0) -> np.ndarray:
    """``raw`` (uint8) as ``dtype`` [rows, cols] (cols 0: [rows]); ``rows`` None: any. ``size``:
    the bytes of one row when the caller knows them (:data:`_PROBE_PLAN`)."""
    size = size or np.dtype(dtype).itemsize * max(cols, 1)
    if len(raw) % size:
        raise WireError("bad_array", f"{key}: {len(raw)} bytes is not a multiple of {size}")
    a = raw.view(dtype)
    if cols:
        a = a.reshape(-1, cols)
    if rows is not None and a.shape[0] != rows:
        raise WireError("bad_array", f"{key}: {a.shape[0]} rows, schema has {rows}")
    return a


def _check_header(h: Header) -> None:
    if h.rank >= h.world:
        raise WireError("bad_field", f"rank {h.rank} / world {h.world}")
    if not math.isfinite(h.time):
        raise WireError("bad_field", "time: not finite")


def _finish_schema(m: Schema, limits: Limits, sizes) -> Schema:
    if len(m.params) > limits.max_names or len(m.slots) > limits.max_names:
        raise WireError("bad_field", "too many params or slots")
    if m.mesh is not None:
        if len(m.mesh.names) != len(m.mesh.sizes):
            raise WireError("bad_field", "mesh: names and sizes differ in length")
        if m.mesh.coord:
            raise WireError("bad_field", "mesh: a rank's coordinates travel in its header")
        if not m.mesh.fits(m.header.coord):
            raise WireError("bad_field", "header coord: not a point of the schema's mesh")
    elif m.header.coord:
        raise WireError("bad_field", "header coord without a mesh")
    if m.shard and len(m.shard) != len(m.params):
        raise WireError("bad_field", f"shard: {len(m.shard)} entries for {len(m.params)} parameters")
    if m.hash != schema_hash(m.params, m.slots, m.mesh, m.shard):
        raise WireError("bad_field", "hash does not match params and slots")
    return m


def _grad_norms(raw, rows: Optional[int]) -> Optional[np.ndarray]:
    return None if raw is None else _typed(raw, "grad_norms", "<f4", 0, rows)


def _finish_report(m, limits: Limits, sizes):
    n_params, n_slots = sizes(m.header, m.schema) if sizes is not None else (None, None)
    out = {}
    if m.probe:
        # without a known schema, the first array of each kind sets the row count the others must match
        rows = {"params": n_params, "slots": n_slots}
        for key, dtype, cols, kind, size, optional in _PROBE_PLAN:
            raw = getattr(m, key)
            if raw is None:
                if optional:
                    out[key] = np.full((rows[kind] or 0, cols), np.nan, np.float32)  # not observed
                    continue
                raise WireError("missing_field", key)
            a = out[key] = _typed(raw, key, dtype, cols, rows[kind], size)
            rows[kind] = a.shape[0]
        n_params = rows["params"]
    else:
        out = dict.fromkeys(PROBE_ARRAYS)
    out["grad_norms"] = _grad_norms(m.grad_norms, n_params)
    if m.nonfinite_slot is not None and n_slots is not None and m.nonfinite_slot >= n_slots:
        raise WireError("bad_field", "nonfinite_slot: not a slot of the schema")
    return msgspec.structs.replace(m, **out)


def _finish_steps(m, limits: Limits, sizes):
    raw = m.records
    if len(raw) % RECORD.itemsize:
        raise WireError("bad_array", f"records: {len(raw)} bytes is not a multiple of {RECORD.itemsize}")
    rec = raw.view(RECORD)
    n = len(rec)
    if not 1 <= n <= MAX_STEPS:
        raise WireError("bad_array", f"records: {n} (1 to {MAX_STEPS})")
    step = rec["step"]
    if step[0] < 0 or (n > 1 and not (step[1:] > step[:-1]).all()):
        raise WireError("bad_array", "step: not strictly increasing non-negative steps")
    out = {"records": rec}
    if m.grad_norms is not None:
        n_params = sizes(m.header, m.schema)[0] if sizes is not None else None
        g = _typed(m.grad_norms, "grad_norms", "<f4", 0, None)
        cols = n_params if n_params is not None else len(g) // n
        if cols * n != len(g):
            raise WireError("bad_array", f"grad_norms: {len(g)} values for {n} steps of {n_params} parameters")
        out["grad_norms"] = g.reshape(n, cols)
    if m.grad_sq is not None:
        out["grad_sq"] = _typed(m.grad_sq, "grad_sq", "<f8", 0, n * len(m.grad_sq_dims)).reshape(n, len(m.grad_sq_dims))
    elif m.grad_sq_dims:
        raise WireError("missing_field", "grad_sq")
    if m.nonfinite_slot is not None:
        s = out["nonfinite_slot"] = _typed(m.nonfinite_slot, "nonfinite_slot", "<i4", 0, n)
        n_slots = sizes(m.header, m.schema)[1] if sizes is not None else None
        if not ((s >= -1) & (s < (MAX_NAMES if n_slots is None else n_slots))).all():
            raise WireError("bad_array", "nonfinite_slot: not a slot of the schema")
    return msgspec.structs.replace(m, **out)


def _finish_heartbeat(m, limits: Limits, sizes):
    if m.reason not in CLOSE_REASONS:
        return msgspec.structs.replace(m, reason="other")  # bounded: it ends up in findings
    return m


def _finish_ack(m, limits: Limits, sizes):
    if m.why not in ACK_REASONS:
        return msgspec.structs.replace(m, why="other")  # bounded: the aggregator counts by it
    return m


_FINISH: dict[type, Callable] = {Schema: _finish_schema, Report: _finish_report, Steps: _finish_steps,
                                 Heartbeat: _finish_heartbeat, Stack: lambda m, limits, sizes: m, Ack: _finish_ack}


_WELL_FORMED = msgspec.msgpack.Decoder(msgspec.Raw)
_MAP_TYPES = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))  # fixmap, map16, map32


def _malformed(e: msgspec.DecodeError) -> WireError:
    text = str(e)
    return WireError("extra_data" if "trailing" in text else "malformed", text[:80])


def _rejection(frame: bytes, e: msgspec.ValidationError) -> WireError:
    """The reason a frame of this protocol version failed validation."""
    text = str(e)
    try:
        _WELL_FORMED.decode(frame)  # walks the frame without building it: a truncated one is malformed
    except msgspec.DecodeError as d:
        return _malformed(d)
    except RecursionError:
        return WireError("malformed", "nested too deeply")
    try:
        env = _PEEK.decode(frame)
    except msgspec.ValidationError:  # a map whose keys are not strings, or no map at all
        is_map = frame[0] in _MAP_TYPES
        return WireError("malformed" if is_map else "not_a_map", text[:80])
    except msgspec.DecodeError as d:  # a string that is not UTF-8 inside ``kind`` (Raw walks past strings)
        return _malformed(d)
    if "`$.kind`" in text or "field `kind`" in text:
        return WireError("unknown_kind", repr(env.kind)[:40])
    if text.startswith("Object missing required field"):
        return WireError("missing_field", text[:80])
    return WireError("bad_field", text[:80])


class _SchemaHead(msgspec.Struct, frozen=True):
    """A schema message without its lists (they are skipped, not built): for a resend of a schema
    the receiver holds already."""

    header: Header
    host: _Name
    local_rank: _Nat
    every: _Nat
    hash: _Str64 = ""
    halt_on: Annotated[tuple[_Str64, ...], msgspec.Meta(max_length=16)] = ()


_SCHEMA_HEAD = msgspec.msgpack.Decoder(_SchemaHead)


def decode(frame: bytes, limits: Limits = Limits(), schema_sizes=None, known_schema=None) -> Message:
    """Decode one frame an agent sent into a :class:`Schema`, :class:`Steps`, :class:`Report`,
    :class:`Heartbeat`, :class:`Stack` or :class:`Ack` (a :class:`Command` is refused: "direction";
    agents decode theirs with :func:`decode_command`).

    Args:
        frame: the bytes of one ZeroMQ frame.
        limits: size caps; a frame over ``limits.max_message_bytes`` is rejected unread.
        schema_sizes: optional ``(header, schema_hash) -> (n_params, n_slots)`` callable; when
            given, a probe report's arrays and any record's ``grad_norms`` must have exactly
            those row counts (it may return ``(None, None)`` for an unknown schema).
        known_schema: optional ``(header, schema_hash) -> Schema | None``; a schema message whose
            hash it knows is that schema under the message's own header, host, local rank and
            cadence, its lists neither built nor hashed again (every rank of a large job resends
            the same ones).

    Returns:
        The message; its arrays are read-only views of ``frame`` in the wire's dtypes.

    Raises:
        WireError: with ``reason`` in :data:`REJECT_REASONS`; never anything else.
    """
    if len(frame) > limits.max_message_bytes:
        raise WireError("too_large", f"{len(frame)} bytes")
    try:  # the version first: a frame of another protocol is "version", whatever else it holds
        env = _PEEK.decode(frame)
        v, kind = env.v, env.kind
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        v, kind = PROTOCOL_VERSION, None  # not a message at all: the full decode below says why
    if v != PROTOCOL_VERSION:
        raise WireError("version", f"got {v!r:.20}, speak {PROTOCOL_VERSION}")
    if kind == "command":
        raise WireError("direction", "a command comes from the aggregator, never to it")
    if kind == "schema" and known_schema is not None:
        known = _known(frame, known_schema)
        if known is not None:
            return known
    try:
        m = _DECODER.decode(frame)
    except msgspec.ValidationError as e:
        raise _rejection(frame, e) from None
    except msgspec.DecodeError as e:
        raise _malformed(e) from None
    except RecursionError:
        raise WireError("malformed", "nested too deeply") from None
    _check_header(m.header)
    return _FINISH[type(m)](m, limits, schema_sizes)


_COMMAND_DECODER = msgspec.msgpack.Decoder(Command)


def decode_command(frame: bytes) -> Command:
    """Decode one frame an agent received from the aggregator: a :class:`Command`.

    Raises:
        WireError: ``too_large`` over :data:`MAX_COMMAND_BYTES`; ``version``; ``direction`` for a
            kind agents send (:data:`AGENT_KINDS`); ``unknown_kind``, ``missing_field``,
            ``bad_field`` (a wrong type, a bound, ``expires`` not within :data:`COMMAND_TTL_S`
            after ``issued``), ``malformed``...; never anything else.
    """
    if len(frame) > MAX_COMMAND_BYTES:
        raise WireError("too_large", f"{len(frame)} bytes, a command is at most {MAX_COMMAND_BYTES}")
    try:
        env = _PEEK.decode(frame)
        v, kind = env.v, env.kind
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        v, kind = PROTOCOL_VERSION, None
    if v != PROTOCOL_VERSION:
        raise WireError("version", f"got {v!r:.20}, speak {PROTOCOL_VERSION}")
    if kind in AGENT_KINDS:
        raise WireError("direction", f"{kind!r:.20} comes from an agent, never to one")
    try:
        m = _COMMAND_DECODER.decode(frame)
    except msgspec.ValidationError as e:
        if "`$.args.kind`" in str(e):
            raise WireError("unknown_kind", str(e)[:80]) from None
        raise _rejection(frame, e) from None
    except msgspec.DecodeError as e:
        raise _malformed(e) from None
    except RecursionError:
        raise WireError("malformed", "nested too deeply") from None
    if not (math.isfinite(m.issued) and math.isfinite(m.expires)) or not 0 < m.expires - m.issued <= COMMAND_TTL_S:
        raise WireError("bad_field", f"expires: not within {COMMAND_TTL_S:g} s after issued")
    return m


def _known(frame: bytes, known_schema) -> Optional[Schema]:
    """The schema a resend names by its hash, if ``known_schema`` holds it (see :func:`decode`)."""
    try:
        head = _SCHEMA_HEAD.decode(frame)
        _check_header(head.header)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError, WireError):
        return None  # the full decode names the fault
    s = known_schema(head.header, head.hash) if head.hash else None
    if s is None:
        return None
    return msgspec.structs.replace(s, header=head.header, host=head.host, local_rank=head.local_rank, every=head.every,
                                   halt_on=head.halt_on)


def peek(frame: bytes) -> Optional[tuple[str, str]]:
    """``(job, key)`` of a frame's header without decoding the rest (the aggregator's intake
    thread shares its room among jobs by it), or None when the frame has no readable header."""
    try:
        return _HEADER_PEEK.decode(frame).header.identity
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError, AttributeError):
        return None


class _PeekHeader(msgspec.Struct):
    job: str = ""
    key: str = ""

    @property
    def identity(self) -> tuple[str, str]:
        return (self.job, self.key)


class _PeekMessage(msgspec.Struct):
    header: _PeekHeader


_HEADER_PEEK = msgspec.msgpack.Decoder(_PeekMessage)


_RAW_MAP = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_REPORT, _SCHEMA, _TRUE, _FALSE = (msgspec.Raw(_ENCODER.encode(x)) for x in ("report", "schema", True, False))


def shed(frame: bytes) -> bytes:
    """What a receiver without room for a frame's bulk keeps of it:

    * a probe report: the frame without its probe arrays (:data:`PROBE_ARRAYS`) and with ``probe``
      false, its step's record alone, as an unprobed report of that step carries it (header,
      scalars, ``grad_norms``, ``grad_sq``, ``nonfinite_slot`` kept byte for byte);
    * a schema: nothing (``b""``): every rank resends its own, the ranks of a pipeline stage send
      the same one, and heartbeats name its hash;
    * any other frame, or one that is not a msgpack map: ``frame`` itself (the same object).

    The aggregator's intake sheds frames past their share of its room (:data:`~gradwatch.aggregator.daemon.BULK_SHARE`):
    the ranks' steps still show, the round lacks their arrays. Nothing is validated beyond the map:
    the result is decoded with :func:`decode` like any frame, and rejected by reason there."""
    try:
        m = _RAW_MAP.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return frame
    kind = m.get("kind")
    if kind == _SCHEMA:
        return b""
    if kind != _REPORT or m.get("probe") != _TRUE:
        return frame
    for key in PROBE_ARRAYS:
        m.pop(key, None)
    m["probe"] = _FALSE
    return _ENCODER.encode(m)
