"""The aggregator daemon: a PULL socket drained by an intake thread, one writer thread that owns
the state, an HTTP server.

The intake thread only receives: it moves frames from ZeroMQ into :class:`Intake`, a queue bounded
in bytes over all agents together (``max_intake_bytes``; beyond it frames are dropped and counted,
reason ``overload``), so that under overload memory does not grow with the number of connected
agents times ZeroMQ's per-connection high-water mark. Once the queue is half full, each job (the
identity its frames' headers claim, :func:`gradwatch.wire.peek`, and with CURVE the sender's key)
may hold only its fair share of it: a job flooding the aggregator loses its own frames, not
another job's. The writer thread decodes frames
(:mod:`gradwatch.wire`, with explicit limits), applies them to :class:`~.state.State`, closes
rounds whose grace period ran out, and publishes an immutable snapshot at most every
``publish_interval_s``. The HTTP server's threads only read the published snapshot. A peer's bytes
can fail one frame, never the loop: every failure is counted in
``gradwatch_messages_rejected_total{reason}``.
"""

from __future__ import annotations

import collections
import errno
import gc
import json
import logging
import signal
import sys
import threading
import time
from socketserver import ThreadingMixIn
from typing import Callable, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import msgspec.inspect
import zmq
from prometheus_client import CollectorRegistry, make_wsgi_app

from gradwatch import auth, wire

from .checks import Runner
from .config import AggregatorConfig, ConfigError
from .discovery import TargetFile, target_host
from .exporter import SnapshotCollector
from .reconcile import Snapshot, snapshot
from .state import State

log = logging.getLogger("gradwatch.aggregator")

#: most job identities :attr:`Intake.dropped_jobs` tracks between two :meth:`Intake.take_dropped`
#: calls (each pass of the writer's loop, 0.1 s or so): a peer's flood of forged job ids cannot grow it
#: past this. Far more than the jobs :class:`~.state.State` holds at the defaults (``max_jobs`` 64 and
#: ``max_pending_jobs`` 16); a drop past it goes untracked: its job's silence checks are not muted.
MAX_DROPPED_JOBS = 1024
#: the :class:`Intake` queue of every frame whose identity holds no slot (:meth:`Intake.admit`)
PENDING = "pending"
#: most share of the writer thread's time that ticks, and separately snapshots, may take: both walk
#: every rank (25 ms and 50-100 ms at 16,384 ranks), so a huge job's come more rarely than every
#: 0.1 s and every publish_interval_s. At 1/4 each, half the writer went to them at 16,384 ranks.
PERIODIC_SHARE = 0.1
#: most share of the writer thread's time a large round's reconciliation slices take while frames
#: wait in the intake (:class:`SliceGate`): the steps after a probed step are handled first, so
#: that a 16,384-rank job's metrics do not wait for its round (0.5-1 s of the writer)
ROUND_SHARE = 0.25
#: most share of a job's room in the :class:`Intake` the bulk of its frames may take: past it a
#: probe report is kept as its step's record alone (~1/40 of its bytes at 100 layers) and a schema
#: (~15 kB at 100 layers, resent by every rank) is dropped (:func:`gradwatch.wire.shed`); the rest
#: of the room holds the records of the steps that follow. A 16,384-rank job's probed step is ~160
#: MB of reports at 100 layers, and its schema resends 245 MB: dropping whatever found no room hid
#: those ranks' step until their next message (~1 s at a step a second), and dropped the next
#: steps' records that found the room full of arrays.
BULK_SHARE = 0.75
#: seconds after which a round's slices run back to back whatever waits: the round's checks wait
#: for it (:attr:`.state.JobState.deferred`, its job's ticks included: ``rank_silent``,
#: ``training_stalled``), so its findings come at most about this much later than without the share
ROUND_WAIT_S = 1.0
#: the cyclic garbage collector's thresholds in the daemon (:meth:`Aggregator.serve_forever`, a
#: process of its own): a large job's state holds millions of tracked objects (ranks, open rounds'
#: reports) and the default (700, 10, 10) collected every few hundred frames; at 16,384 ranks
#: collections took ~6 % of the writer and doubled every other snapshot's build (25 -> 75 ms).
#: The state makes few reference cycles, so collecting rarely holds little garbage.
GC_THRESHOLDS = (100_000, 20, 10)
#: the interpreter's thread switch interval in the daemon, seconds (CPython's default is 5 ms). The
#: intake thread gives up the interpreter lock for each frame it receives (pyzmq's recv) and, when
#: the writer is busy, may wait a whole interval to get it back (the convoy effect): at 5 ms a busy
#: writer starved the intake, ZeroMQ's queues filled and the senders blocked, and 16,384-rank runs
#: stalled for 4-10 s about one run in four. At 0.5 ms: no stall in the runs, and ~1/5 the drops.
SWITCH_INTERVAL_S = 0.0005
#: glibc malloc options in the daemon (:func:`keep_freed_memory`; ``mallopt(3)`` parameter ->
#: value): one arena for every thread, no allocation served by its own mmap, the heap never
#: trimmed. A 16,384-rank round allocates ~0.5 GB of arrays (stacked reports, merges, medians);
#: glibc maps each one over 32 MB afresh and unmaps it when freed, so every round faulted all of it
#: in again (~30,000 page faults, ~1/6 of a round's time; on a VM that reports free pages to its
#: host, each fault costs a host round trip: a round's faults took most of it). Freed memory is
#: kept for the next round: RSS stays at the peak the largest round so far needed, instead of
#: breathing.
MALLOC_OPTIONS = (
    (-8, 1),  # M_ARENA_MAX: one arena, else a thread's own arena maps its large blocks anyway
    (-4, 0),  # M_MMAP_MAX: no allocation gets its own mapping (returned to the kernel when freed)
    (-1, 2**31 - 1),  # M_TRIM_THRESHOLD (an int): the heap's free top is kept, up to 2 GiB
)
#: longest job id and key a :class:`gradwatch.wire.Header` may carry: a drop claiming a longer one
#: is nobody's (decoding would reject the frame) and is not tracked, so each identity stays small
_MAX_JOB_ID, _MAX_JOB_KEY = (
    next(f.type.max_length for f in msgspec.inspect.type_info(wire.Header).fields if f.name == n) for n in ("job", "key")
)


def keep_freed_memory() -> bool:
    """Apply :data:`MALLOC_OPTIONS` to this process's C allocator (glibc's ``mallopt``); call it
    before the process starts threads (a thread that has allocated keeps its arena). Process-wide,
    so the daemon's alone (:meth:`Aggregator.serve_forever`). Returns False where the C library
    has no ``mallopt`` (musl, macOS) or refused an option: the daemon works as before there. (An
    allocator preloaded in glibc's place, jemalloc or tcmalloc, ignores the options it took.)"""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or None).mallopt
    except (OSError, AttributeError, TypeError):  # no C library to load, or one without mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all([mallopt(param, value) == 1 for param, value in MALLOC_OPTIONS])  # a list: every option is tried


class _HTTPServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # scrapes every few seconds would flood the log
        log.debug("http: " + format, *args)


class Intake:
    """Received frames waiting for the writer: the intake thread puts, the writer takes.

    Frames wait in one queue per admitted job (the identity a frame's header claims,
    :func:`gradwatch.wire.peek`, with the sender's CURVE key: :meth:`admit`), each in arrival
    order; frames of every other identity (jobs without a slot yet, invented ids, frames without a
    readable header) share one more queue, :data:`PENDING`, as one job: a flood of invented job
    ids holds one share of the intake however many ids it claims, not one per id. The writer takes
    from the queues in turn.

    Args:
        max_bytes: most bytes of frames held (memory).
        max_frames: most frames held (how far behind the writer may fall).
        Past half of either, a job holds at most its share: the limit over one more than the
        jobs holding frames. A probe report that would take its job past :data:`BULK_SHARE` of
        its share of bytes, and the intake past that share of its half, is shed: kept as its
        step's record alone (:func:`gradwatch.wire.shed`; the rank's step shows, the round lacks
        its arrays); a schema is dropped there (its ranks resend it, and a stage's ranks share
        one). The job's records thus keep room beside its bulk. A frame past its job's share is
        dropped; a frame that finds no room while its job is below its share makes room by
        dropping the oldest frame of the job holding the most. Under overload a job flooding the
        aggregator thus loses its own frames, never another job's share, whichever came first.
        Every drop and every shed report is counted.

    Attributes:
        bytes: bytes of frames held now.
        dropped: frames dropped for lack of room (the writer counts them as ``overload``).
        shed: probe reports held as their step's record alone (:func:`gradwatch.wire.shed`); the
            writer counts them as received reports, and in ``probes_shed``.
        shed_jobs: the jobs whose probe reports were shed since the writer last asked
            (:meth:`take_shed`), bounded as ``dropped_jobs`` is; not marked overloaded (their
            records came).
        dropped_jobs: the jobs whose frames were dropped since the writer last asked
            (:meth:`take_dropped`), as ``((job id, key), CURVE user id or None)``: the identity
            their headers claim and the key their sender authenticated with. At most
            :data:`MAX_DROPPED_JOBS`; past it, and for frames without a readable header or
            claiming an identity longer than a header allows, a drop is counted in ``dropped``
            only (its job is not marked overloaded).
        ready: set when frames are waiting.
    """

    def __init__(self, max_bytes: int, max_frames: int):
        self.max_bytes, self.max_frames = max_bytes, max_frames
        self.bytes = 0
        self.frames = 0
        self.dropped = 0
        self.shed = 0
        self.dropped_jobs: set = set()
        self.shed_jobs: set = set()
        self.ready = threading.Event()
        self._queues: dict = {}  # job -> deque of (frame, user id), oldest first (PENDING: and its job)
        self._bytes: collections.Counter = collections.Counter()  # job -> bytes held
        self._admitted: frozenset = frozenset()  # the identities with a queue of their own
        self._lock = threading.Lock()

    @staticmethod
    def share_for(world: int, report_bytes: int) -> tuple[int, int]:
        """``(frames, bytes)`` one job of ``world`` ranks with ``report_bytes`` probe reports holds
        in the intake at a probed step: its reports and the messages of the steps that come while
        they are handled and their round closes (at 16,384 ranks and a step a second, 42,000
        frames waited: 4 x world)."""
        return 4 * world, world * (report_bytes + 512)

    def short_for(self, world: int, report_bytes: int) -> Optional[tuple[int, int]]:
        """``(frames, bytes)`` settings that would hold :meth:`share_for` within the half of the
        intake one job keeps once it is over half full, or None when these do."""
        frames, nbytes = (2 * n for n in self.share_for(world, report_bytes))
        return None if frames <= self.max_frames and nbytes <= self.max_bytes else (
            max(frames, self.max_frames), max(nbytes, self.max_bytes))

    @property
    def held(self) -> dict:
        """``{job: frames held}`` (a copy); :data:`PENDING` for the frames of jobs not admitted."""
        with self._lock:
            return {job: len(q) for job, q in self._queues.items()}

    @property
    def admitted(self) -> frozenset:
        """The identities given a queue of their own by the latest :meth:`admit`."""
        return self._admitted

    def admit(self, jobs: frozenset) -> None:
        """Writer thread: ``jobs``, the ``(CURVE user id or None, (job id, key))`` identities of
        the jobs holding a slot (:attr:`.state.State.admitted`), get a queue of their own from
        now on; a newly admitted job's frames waiting in :data:`PENDING` move to it, in order
        (one pass over the pending frames, once per admission)."""
        with self._lock:
            new = jobs - self._admitted
            self._admitted = jobs
            pending = self._queues.get(PENDING)
            if not new or not pending:
                return
            rest: collections.deque = collections.deque()
            for item in pending:
                job = item[2]
                if job in new:
                    self._queues.setdefault(job, collections.deque()).append(item[:2])
                    self._bytes[job] += len(item[0])
                    self._bytes[PENDING] -= len(item[0])
                else:
                    rest.append(item)
            if rest:
                self._queues[PENDING] = rest
            else:
                del self._queues[PENDING], self._bytes[PENDING]

    def put(self, batch: list) -> None:
        """Intake thread: hold ``(frame bytes, CURVE user id or None)`` items while room lasts."""
        jobs = [(key, wire.peek(frame)) for frame, key in batch]  # read outside the lock
        with self._lock:
            for item, job in zip(batch, jobs):
                self._put(item, job)
        self.ready.set()

    def _put(self, item, job) -> None:
        n = len(item[0])
        queue = job if job in self._admitted else PENDING
        q = self._queues.get(queue)
        held, held_bytes = (len(q), self._bytes[queue]) if q is not None else (0, 0)
        if n > self.max_bytes:
            self._drop(job)
            return
        shares = len(self._queues) + (q is None) + 1  # and one for a newcomer
        # bulk (probe arrays, schemas) past BULK_SHARE of the job's share, or of the intake's half (where shares start)
        shed = (2 * (self.bytes + n) > BULK_SHARE * self.max_bytes
                and held_bytes + n > BULK_SHARE * self.max_bytes / shares)
        if shed:
            kept = wire.shed(item[0])
            if not kept:  # a schema
                self._drop(job)
                return
            shed = kept is not item[0]  # a probe report's record (anything else is kept whole)
            item, n = (kept, item[1]), len(kept)
        full = self.frames + 1 > self.max_frames or self.bytes + n > self.max_bytes
        if full or 2 * (self.frames + 1) > self.max_frames or 2 * (self.bytes + n) > self.max_bytes:
            if held + 1 > self.max_frames / shares or held_bytes + n > self.max_bytes / shares:
                self._drop(job)  # past its share: its own frame goes
                return
            while full:  # below its share and no room: the largest holder's oldest frame makes room
                self._evict(max(self._queues, key=lambda j: (len(self._queues[j]), self._bytes[j])))
                full = self.frames + 1 > self.max_frames or self.bytes + n > self.max_bytes
        if q is None:
            q = self._queues[queue] = collections.deque()
        if shed:
            self.shed += 1
            self._note(self.shed_jobs, job)
        q.append(item if queue is not PENDING else (*item, job))  # a pending frame keeps its job's name
        self.frames += 1
        self.bytes += n
        self._bytes[queue] += n

    def _evict(self, queue) -> None:
        item = self._queues[queue].popleft()
        self._forget(queue, len(item[0]))
        self._drop(item[2] if queue is PENDING else queue)

    def _drop(self, job) -> None:
        self.dropped += 1
        self._note(self.dropped_jobs, job)

    @staticmethod
    def _note(jobs: set, job) -> None:
        user, ident = job
        # peers choose the identities frames claim: bounded in entries and in the size of each
        if (ident is not None and len(jobs) < MAX_DROPPED_JOBS
                and len(ident[0]) <= _MAX_JOB_ID and len(ident[1]) <= _MAX_JOB_KEY):
            jobs.add((ident, user))

    def take_dropped(self) -> set:
        """Writer thread: the ``((job id, key), CURVE user id or None)`` of the frames dropped since
        the last call (:attr:`dropped_jobs`)."""
        with self._lock:
            out, self.dropped_jobs = self.dropped_jobs, set()
        return out

    def take_shed(self) -> set:
        """Writer thread: :meth:`take_dropped` for the jobs whose probe reports were shed
        (:attr:`shed_jobs`)."""
        with self._lock:
            out, self.shed_jobs = self.shed_jobs, set()
        return out

    def _forget(self, job, n: int) -> None:
        self.frames -= 1
        self.bytes -= n
        self._bytes[job] -= n
        if not self._queues[job]:
            del self._queues[job], self._bytes[job]

    def take(self, most: int) -> list:
        """Writer thread: up to ``most`` ``(frame, user id)`` items, the jobs in turn, each job's
        oldest first; ``ready`` stays set while more wait."""
        out: list = []
        with self._lock:
            while self._queues and len(out) < most:
                each = max(1, (most - len(out)) // len(self._queues))
                for job in list(self._queues):
                    q = self._queues[job]
                    for _ in range(min(each, len(q), most - len(out))):
                        item = q.popleft()
                        out.append(item if job is not PENDING else item[:2])
                        self._forget(job, len(item[0]))
                        if job not in self._queues:
                            break
            if not self._queues:
                self.ready.clear()
        return out


class SliceGate:
    """When the writer runs the next slice of a large round's reconciliation (the writer thread's
    own; :data:`ROUND_SHARE`, :data:`ROUND_WAIT_S`): at once when no frame waits, or once the round
    has been in slices for ``ROUND_WAIT_S``; else when the slices so far have taken at most
    ``ROUND_SHARE`` of the writer's time since the last one began."""

    def __init__(self):
        self._round = None  # the round in slices (its Closing), and since when (perf_counter s)
        self._since = self._due = 0.0

    def ready(self, head, frames_waiting: bool, now: float) -> bool:
        """Whether to run a slice of ``head`` (the oldest round in slices) now."""
        if head is not self._round:
            self._round, self._since, self._due = head, now, now
        return not frames_waiting or now >= self._due or now - self._since >= ROUND_WAIT_S

    def ran(self, t0: float, t1: float) -> None:
        """A slice ran from ``t0`` to ``t1``: the next waits until it is ROUND_SHARE of the time."""
        self._due = t0 + (t1 - t0) / ROUND_SHARE


class Aggregator:
    """Receives reports from every rank and serves ``/metrics`` and ``/healthz``.

    Args:
        cfg: settings.
        registry: Prometheus registry to expose (a fresh one by default).
        clock: monotonic clock, seconds.

    Raises (from :meth:`start`):
        ConfigError: the ZeroMQ endpoint cannot be bound, the HTTP port is in use, or the
            ``file_sd_path`` target file cannot be written.
    """

    def __init__(
        self, cfg: AggregatorConfig, *, registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic, sinks=(),
    ):
        self.cfg = cfg
        self.clock = clock
        self.annotations = None
        if cfg.grafana_url:  # findings as Grafana annotations, posted off the writer thread
            from .annotations import GrafanaAnnotations

            self.annotations = GrafanaAnnotations.from_config(cfg)
            sinks = (*sinks, self.annotations)
        try:
            self.runner = Runner(cfg.check_names, cfg.checks, cfg.events_path, sinks=sinks)
        except OSError as e:
            raise ConfigError(f"aggregator.events_path: cannot open {cfg.events_path!r}: {e}") from None
        self.state = State(
            cfg.round_grace_s, cfg.max_pending_rounds, cfg.rank_ttl_s, clock, runner=self.runner,
            max_jobs=cfg.max_jobs, max_world=cfg.max_world, max_pending_jobs=cfg.max_pending_jobs,
            max_pending_ranks=cfg.max_pending_ranks, max_schema_bytes=cfg.max_schema_bytes,
            max_series_per_job=cfg.max_series_per_job, max_series_total=cfg.max_series_total,
            max_pending_bytes=cfg.max_pending_bytes, max_label_len=cfg.max_label_len,
            max_step_jump=cfg.max_step_jump, restart_grace_s=cfg.restart_grace_s,
            boot_takeover_s=cfg.boot_takeover_s, round_slice_ranks=cfg.round_slice_ranks,
            group_depth=cfg.layer_depth, rank_view_max=cfg.rank_series_max,
        )
        self._snapshot = Snapshot()
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(lambda: self._snapshot, cfg.layer_depth, cfg.rank_detail_max,
                                                 cfg.rank_series_max))
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._intake_thread: Optional[threading.Thread] = None
        self.intake = Intake(cfg.max_intake_bytes, cfg.max_intake_frames)
        self._overload_counted = 0
        self._slots = 0  # State.slots when the intake last learnt which jobs hold a slot
        self._ctx: Optional[zmq.Context] = None
        self._sock = None
        self._auth = None  # zmq.auth.thread.ThreadAuthenticator with CURVE
        self._refused = None  # monitor socket of refused CURVE handshakes
        self._http: Optional[_HTTPServer] = None
        self._target_file: Optional[TargetFile] = None  # --file-sd-path, while written
        self.endpoint = ""
        self.metrics_port = 0
        self._internal_warned = False
        self._intake_warned: set[str] = set()  # jobs told their probed steps overflow the intake
        self._refused_warned = False
        self._announced: set[str] = set()  # admitted jobs whose arrival was logged (at most max_jobs)
        self._signal = ""  # the signal that stopped serve_forever

    @property
    def snapshot(self) -> Snapshot:
        """The latest published snapshot (immutable)."""
        return self._snapshot

    @property
    def metrics_url(self) -> str:
        host = "127.0.0.1" if self.cfg.metrics_host in ("0.0.0.0", "") else self.cfg.metrics_host
        return f"http://{host}:{self.metrics_port}/metrics"

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> "Aggregator":
        keys = self.cfg.curve_keys()  # ConfigError naming the setting before anything is bound
        if keys is None and not self.cfg.listen_is_local:
            log.warning(
                "gradwatch aggregator: %s accepts reports from anyone who reaches it (no CURVE); "
                "run `gradwatch keys` and pass --server-key and --client-keys (README: Security)", self.cfg.listen,
            )
        self._ctx = zmq.Context()
        self._auth = keys.authenticator(self._ctx) if keys else None  # ZAP handler before bind
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.cfg.rcv_hwm)
        # libzmq drops (and disconnects) frames far beyond our own limit before buffering them
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.cfg.max_message_bytes)
        if keys:
            keys.apply(sock)
            # refused handshakes are counted: gradwatch_messages_rejected_total{reason="unauthenticated"}
            self._refused = sock.get_monitor_socket(auth.REFUSED_EVENTS)
        try:
            if self.cfg.listen.startswith("tcp://") and self.cfg.listen.endswith(":0"):
                port = sock.bind_to_random_port(self.cfg.listen[: -len(":0")])
                self.endpoint = self.cfg.listen[: -len(":0")] + f":{port}"
            else:
                sock.bind(self.cfg.listen)
                self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets(sock)
            raise ConfigError(f"aggregator.listen: cannot bind {self.cfg.listen}: {e}") from None
        self._sock = sock
        try:
            self._http = make_server(
                self.cfg.metrics_host, self.cfg.metrics_port, self._wsgi, _HTTPServer, handler_class=_QuietHandler
            )
        except OSError as e:
            self._close_sockets(sock)
            if e.errno in (errno.EADDRINUSE, errno.EACCES):  # the port is taken, or privileged
                setting, hint = "metrics_port", "pick another with --metrics-port"
            else:  # no such address here, or no address at all
                setting, hint = "metrics_host", "give an address of this host with --metrics-host"
            raise ConfigError(
                f"aggregator.{setting}: cannot serve HTTP on {self.cfg.metrics_host}:{self.cfg.metrics_port}: {e} ({hint})"
            ) from None
        self.metrics_port = self._http.server_port
        if self.cfg.file_sd_path:  # announced once the port is bound: Prometheus may scrape at once
            target = f"{target_host(self.cfg.metrics_host, self.cfg.file_sd_host)}:{self.metrics_port}"
            sd = TargetFile(self.cfg.file_sd_path, target, self.cfg.file_sd_labels)
            try:
                sd.write()
            except OSError as e:
                self._http.server_close()
                self._close_sockets(sock)
                raise ConfigError(f"aggregator.file_sd_path: cannot write {self.cfg.file_sd_path!r}: {e}") from None
            self._target_file = sd
        threading.Thread(target=self._http.serve_forever, name="gradwatch-http", daemon=True).start()
        self._intake_thread = threading.Thread(target=self._receive, name="gradwatch-intake", daemon=True)
        self._thread = threading.Thread(target=self._loop, name="gradwatch-writer", daemon=True)
        self._intake_thread.start()
        self._thread.start()
        log.info("gradwatch aggregator: listening on %s%s, metrics at %s%s", self.endpoint,
                 " (CURVE)" if keys else "", self.metrics_url,
                 f" (file_sd target in {self.cfg.file_sd_path})" if self._target_file else "")
        return self

    def _close_sockets(self, sock) -> None:
        """Close the PULL socket, its monitor and the ZAP handler, then the context."""
        if self._refused is not None:
            sock.disable_monitor()
            self._refused.close(linger=0)
        sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.term()
        self._ctx = None

    def stop(self) -> None:
        if self._target_file is not None:  # first: Prometheus stops scraping before the port closes
            self._target_file.remove()
            self._target_file = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
        self.runner.close()
        if self.annotations is not None:
            self.annotations.close()

    def __enter__(self) -> "Aggregator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Start and block until SIGINT or SIGTERM (the process's signal handlers, garbage
        collector thresholds, :data:`GC_THRESHOLDS`, thread switch interval,
        :data:`SWITCH_INTERVAL_S`, and C allocator options, :data:`MALLOC_OPTIONS`, become the
        daemon's)."""
        if not keep_freed_memory():
            log.info("gradwatch aggregator: the C library took not every mallopt option; freed memory may go back to the kernel")
        gc.set_threshold(*GC_THRESHOLDS)
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        for sig in (signal.SIGINT, signal.SIGTERM):  # before start: /healthz answers from there on
            signal.signal(sig, self._on_signal)
        self.start()
        try:
            while not self._stop.wait(0.5):
                pass
        finally:
            log.info("gradwatch aggregator: stopping%s", f" on {self._signal}" if self._signal else "")
            self.stop()

    # --- the single writer ----------------------------------------------------------------------

    def handle(self, frame: bytes, peer_key: Optional[str] = None) -> None:
        """Decode and apply one frame; count it as rejected by reason if it is not valid.

        ``peer_key``: the sender's CURVE public key (Z85) with CURVE on; a job is bound to the key
        that created it."""
        st = self.state
        t0 = time.perf_counter()
        try:
            msg = wire.decode(frame, self.cfg.limits, st.schema_sizes, st.known_schema)
        except wire.WireError as e:
            st.reject(e.reason)
        else:
            try:
                st.apply(msg, peer_key=peer_key)
            except Exception as e:  # a bug of ours must not let one peer stop the aggregator
                st.reject("internal")
                if not self._internal_warned:
                    self._internal_warned = True
                    log.exception("gradwatch aggregator: failed to apply a message: %r", e)
        st.decode_seconds += time.perf_counter() - t0
        st.decode_count += 1

    def _on_signal(self, signum, _frame) -> None:
        self._signal = signal.Signals(signum).name
        self._stop.set()

    def publish(self) -> None:
        self._snapshot = snapshot(self.state, time.time())
        self._announce()

    def _announce(self) -> None:
        """Log a job once when it is admitted (a schema and a step using it: not a pending id a
        stray or forged frame made) and once when it is gone (every rank silent past rank_ttl_s).
        At most ``max_jobs`` are admitted at once, and a job's slot frees only after rank_ttl_s
        of silence: at most 2 x max_jobs lines per rank_ttl_s, whatever peers send."""
        jobs = self.state.jobs
        admitted = {label: job.world for label, job in jobs.items() if job.admitted}
        for label in sorted(admitted.keys() - self._announced):
            name = jobs[label].name or label
            if name != label:  # a second identity under a live job's id: say why it is not that id
                log.warning("gradwatch aggregator: job %r reporting, world %d, as %r: job %r is live under another "
                            "key (another job with the same id, or a relaunch of it after a crash: set "
                            "GRADWATCH_JOB_KEY alike on every launch of one job)", name, admitted[label], label, name)
            else:
                log.info("gradwatch aggregator: job %r reporting, world %d", label, admitted[label])
        for label in sorted(self._announced - admitted.keys()):
            log.info("gradwatch aggregator: job %r gone", label)
        self._announced = set(admitted)

    def _receive(self) -> None:
        """Intake thread: the only user of the PULL socket; moves frames into :attr:`intake`."""
        sock = self._sock
        curve = self._refused is not None
        intake = self.intake
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                batch = []
                for _ in range(1000):
                    try:
                        frame = sock.recv(zmq.NOBLOCK, copy=not curve)
                    except zmq.Again:
                        break
                    # with CURVE the ZAP handler set User-Id to the peer's public key
                    batch.append((frame.bytes, frame.get("User-Id")) if curve else (frame, None))
                intake.put(batch)
        except Exception as e:  # never expected: the writer's /healthz reports a dead intake
            log.exception("gradwatch aggregator: intake thread stopped: %r", e)
        finally:
            if curve:
                sock.disable_monitor()
            sock.close(linger=0)

    def _loop(self) -> None:
        published = -1
        last_pub = last_tick = 0.0
        interval = wait = self.cfg.publish_interval_s
        tick_wait = 0.1
        gate = SliceGate()
        intake = self.intake
        try:
            while not self._stop.is_set():
                if intake.ready.wait(min(interval, 0.1) if not self.state.closing else 0):
                    for frame, key in intake.take(1000):
                        self.handle(frame, key)
                    if self.state.slots != self._slots:  # a job took or left a slot: its own queue
                        self._slots = self.state.slots
                        intake.admit(self.state.admitted)
                # a large round's reconciliation, a slice between batches (SliceGate: frames first)
                if self.state.closing and gate.ready(self.state.closing[0], intake.frames > 0, time.perf_counter()):
                    t0 = time.perf_counter()
                    self._guarded(self.state.advance, "reconcile a round")
                    gate.ran(t0, time.perf_counter())
                dropped = intake.dropped  # read once: the intake thread may add more meanwhile
                if intake.shed != self.state.probes_shed:
                    self.state.probes_shed = intake.shed
                    self._warn_small_intake(intake.take_shed())
                if dropped != self._overload_counted:
                    self.state.reject("overload", dropped - self._overload_counted)
                    drops = intake.take_dropped()
                    self.state.overloaded(drops)
                    self._warn_small_intake(drops)
                    self._overload_counted = dropped
                if self._refused is not None and self._refused.poll(0):
                    self._count_refused()
                now = self.clock()
                if now - last_tick >= tick_wait:
                    last_tick = now
                    t0 = time.perf_counter()
                    self._guarded(self.state.tick, "tick")
                    # ticks walk every rank (25 ms at 16,384 ranks): every 0.1 s, or more rarely
                    # so that they take at most PERIODIC_SHARE of the writer, yet every second (a
                    # tick that had to finish a large round is no measure of the next)
                    tick_wait = min(1.0, max(0.1, (time.perf_counter() - t0) / PERIODIC_SHARE))
                if self.state.version != published and now - last_pub >= wait:
                    published = self.state.version
                    t0 = time.perf_counter()
                    self.publish()
                    # a snapshot of a huge job takes long to build (50-100 ms at 16,384 ranks): at
                    # most PERIODIC_SHARE of the writer's time goes to them, the rest to the frames
                    wait = max(interval, (time.perf_counter() - t0) / PERIODIC_SHARE)
                    last_pub = now
        finally:
            self._guarded(self.state.finish_closing, "reconcile a round")  # counts a failing round, goes on
            self.publish()
            if self._intake_thread is not None:
                self._intake_thread.join(5)  # it closes the PULL socket (and disables its monitor)
            if self._refused is not None:
                self._refused.close(linger=0)

    def _guarded(self, fn: Callable[[], object], what: str) -> None:
        """``fn()`` on the writer thread: a bug of ours it raises never stops the receive loop; it
        is counted (rejected, reason ``internal``) and the first one logged."""
        try:
            fn()
        except Exception as e:
            self.state.reject("internal")
            if not self._internal_warned:
                self._internal_warned = True
                log.exception("gradwatch aggregator: failed to %s: %r", what, e)

    def _warn_small_intake(self, drops) -> None:
        """Log once per job whose frames were dropped or probe reports shed when the intake
        settings cannot hold one probed step of it (:meth:`Intake.short_for`), naming the settings
        and the values that would."""
        for ident, _ in drops:
            job = self.state.jobs.get(self.state.labels.get(ident))
            if job is None or not job.admitted or job.job in self._intake_warned or not job.schemas:
                continue
            biggest = max(wire.probe_bytes(len(s.params), len(s.slots)) for s in job.schemas.values())
            need = self.intake.short_for(job.world, biggest)
            if need is None:
                continue
            if len(self._intake_warned) >= 1024:  # jobs come and go over months
                self._intake_warned.clear()
            self._intake_warned.add(job.job)
            frames, nbytes = self.intake.share_for(job.world, biggest)
            log.warning(
                "gradwatch aggregator: job %s (%d ranks) loses frames or probe arrays to overload: a probed step of it (%d reports "
                "of ~%d kB) and the steps that come while it is handled need ~%d frames and ~%d MB of the intake, "
                "more than one job's share (half of --max-intake-frames %d and --max-intake-bytes %d once it is "
                "half full); to hold it set --max-intake-frames %d --max-intake-bytes %d",
                job.job, job.world, job.world, biggest // 1000, frames, nbytes // 1_000_000,
                self.cfg.max_intake_frames, self.cfg.max_intake_bytes, *need)

    def _count_refused(self) -> None:
        """One rejection (``unauthenticated``) per refused CURVE handshake: a peer without keys,
        with a client key not admitted, or with another server key."""
        while self._refused.poll(0):
            try:
                self._refused.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            self.state.reject("unauthenticated")
            if not self._refused_warned:
                self._refused_warned = True
                log.warning("gradwatch aggregator: refused a peer's CURVE handshake (counted in "
                            'gradwatch_messages_rejected_total{reason="unauthenticated"})')

    # --- HTTP -----------------------------------------------------------------------------------

    def _wsgi(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path == "/api/findings":
            try:
                return self._json(start_response, self._findings(environ))
            except ValueError as e:  # a query it cannot answer: said, not ignored
                return self._json(start_response, {"error": str(e)}, "400 Bad Request")
        if path == "/api/checks":
            view = self._snapshot.checks
            status = [dict(job_id=j, check=c, status=o) for j, c, o in (view.status if view else ())]
            return self._json(start_response, {"checks": status})
        if path == "/healthz":
            ok = all(t is not None and t.is_alive() for t in (self._thread, self._intake_thread))
            body = json.dumps({"ok": ok}).encode()
            # 503 when the writer or the intake thread died, so a liveness probe restarts the aggregator
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
            return [body]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /metrics\n"]

    @staticmethod
    def _json(start_response, obj, status: str = "200 OK"):
        body = json.dumps(obj, allow_nan=False).encode()
        start_response(status, [("Content-Type", "application/json")])
        return [body]

    #: /api/findings' query parameters, and the values ``active`` takes (true, false)
    FINDINGS_QUERY = ("job_id", "check", "active")
    _ACTIVE = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False, "": False}

    def _findings(self, environ) -> dict:
        """``/api/findings[?job_id=J][&check=C][&active=1]``: events newest first, or active findings
        (each with ``since``, the wall-clock time it was raised, None once the event ring has let
        its raised event go); every item also carries its job as ``job_id``.

        Raises:
            ValueError: a parameter not in :data:`FINDINGS_QUERY`, an ``active`` that is no
                yes or no (``?active=yes`` had been ignored, answering with every event), or a
                ``check`` that names no check (a typo answered "no findings").
        """
        from dataclasses import asdict
        from urllib.parse import parse_qs

        from .checks import CHECKS, _clean

        q = {k: v[-1] for k, v in parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True).items()}
        unknown = sorted(set(q) - set(self.FINDINGS_QUERY))
        if unknown:
            raise ValueError(f"unknown parameter {unknown[0]!r}: /api/findings takes {', '.join(self.FINDINGS_QUERY)}")
        active = self._ACTIVE.get(q.get("active", "").lower())
        if active is None:
            raise ValueError(f"active={q['active']!r}: give 1 (active findings only) or 0")
        if "check" in q and q["check"] not in CHECKS:
            raise ValueError(f"check={q['check'][:64]!r} names no check: {', '.join(sorted(CHECKS))}")
        view = self._snapshot.checks
        if view is None:
            return {"findings": []}
        if active:
            # since: when it was raised (its latest raised event, while the event ring holds it)
            since = {(e.check, e.job, e.rank, e.layer): e.time for e in view.events if e.event == "raised"}
            items = [dict(asdict(f), severity=view.severity.get(f.check, ""),
                          since=since.get((f.check, f.job, f.rank, f.layer))) for f in view.active]
        else:
            items = [asdict(e) for e in reversed(view.events)]
        items = [
            dict(i, job_id=i["job"]) for i in items  # job_id as the query and the metrics' label say it
            if q.get("job_id", i["job"]) == i["job"] and q.get("check", i["check"]) == i["check"]
        ]
        return {"findings": _clean(items)}

    @property
    def _metrics_app(self):
        app = getattr(self, "_metrics_app_cached", None)
        if app is None:
            app = self._metrics_app_cached = make_wsgi_app(self.registry)
        return app
