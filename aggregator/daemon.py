"""The aggregator daemon: an intake thread, one writer thread that owns the state, an HTTP server.

The intake thread owns the socket (:mod:`.intake`: it receives into a queue bounded in bytes and
shared fairly between jobs, and sends the control room's commands). The writer thread takes frames from the intake, decodes them
(:mod:`gradwatch.wire`, with explicit limits), applies them to :class:`~.state.State`, ticks it
(rounds whose grace period ran out, the checks' ticks), runs a large round's reconciliation in
slices between batches of frames (:class:`SliceGate`), and publishes an immutable snapshot
(:mod:`.snapshot`) at most every ``publish_interval_s``. The HTTP server's threads
(:mod:`.web`) read the published snapshot, and ask the control room (:mod:`.control`) for stacks,
probes and budgets. Agents' answers to commands go to the control room, every other frame to the
state; the control room learns which connection each rank's accepted frames came on. A peer's
bytes can fail one frame, never the loop: every failure is counted in
``gradwatch_messages_rejected_total{reason}``.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import Callable, Optional

from prometheus_client import CollectorRegistry

from gradwatch import wire

from .config import AggregatorConfig, ConfigError
from .control import Control
from .discovery import TargetFile, target_host
from .exporter import SnapshotCollector
from .intake import Intake, Receiver
from .limits import Limits
from .runner import Runner
from .snapshot import Snapshot, snapshot
from .state import State
from .web import Api, HTTPServer, serve

log = logging.getLogger("gradwatch.aggregator")

#: most share of the writer thread's time that ticks, and separately snapshots, may take: both walk
#: every rank (25 ms and 50-100 ms at 16,384 ranks), so a huge job's come more rarely than every
#: 0.1 s and every publish_interval_s. At 1/4 each, half the writer went to them at 16,384 ranks.
PERIODIC_SHARE = 0.1
#: most share of the writer thread's time a large round's reconciliation slices take while frames
#: wait in the intake (:class:`SliceGate`): the steps after a probed step are handled first, so
#: that a 16,384-rank job's metrics do not wait for its round (0.5-1 s of the writer)
ROUND_SHARE = 0.25
#: seconds after which a round's slices run back to back whatever waits: the round's checks wait
#: for it (:attr:`.jobs.JobState.deferred`, its job's ticks included: ``rank_silent``,
#: ``training_stalled``), so its findings come at most about this much later than without the share
ROUND_WAIT_S = 1.0
#: seconds between two turns of the writer's loop (it turns at least every 0.1 s, a large round's
#: reconciliation in slices between them) past which the gap is the aggregator's own pause (the
#: process stopped, a VM paused, swapping): :meth:`Aggregator._turn` leaves it out of the state's
#: clock, so no rank is judged silent, nor training stalled, for time the aggregator did not run
PAUSE_S = 2.0
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


def keep_freed_memory() -> bool:
    """Apply :data:`MALLOC_OPTIONS` to this process's C allocator (glibc's ``mallopt``); call it
    before the process starts threads (a thread that has allocated keeps its arena). Process-wide,
    so the daemon's alone (:meth:`Aggregator.serve_forever`). Returns False where the C library
    has no ``mallopt`` (musl, macOS) or refused an option: the daemon keeps the C library's defaults there. (An
    allocator preloaded in glibc's place, jemalloc or tcmalloc, ignores the options it took.)"""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or None).mallopt
    except (OSError, AttributeError, TypeError):  # no C library to load, or one without mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all([mallopt(param, value) == 1 for param, value in MALLOC_OPTIONS])  # a list: every option is tried



#: the kind each data message is counted under in ``State.received`` (counted: accepted)
_KIND = {wire.Schema: "schema", wire.Steps: "steps", wire.Report: "report", wire.Heartbeat: "heartbeat"}


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
    """Receives reports from every rank and serves ``/metrics``, the findings API and ``/healthz``.

    Args:
        cfg: settings.
        registry: Prometheus registry to expose (a fresh one by default).
        clock: monotonic clock, seconds.
        sinks: callables receiving each raised or updated finding's event (besides Grafana's, when
            set, and the control room's).

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
        # the control channel: findings ask it for stacks and halts, and it annotates them
        self.control = Control(clock, annotate=lambda *a: self.runner.annotate(*a),
                               named=lambda job: self.runner.named_ranks([job]).get(job, set()))
        sinks = (*sinks, self.control.on_event)
        self.annotations = None
        if cfg.grafana_url:  # findings as Grafana annotations, posted off the writer thread
            from .annotations import GrafanaAnnotations

            self.annotations = GrafanaAnnotations.from_config(cfg)
            sinks = (*sinks, self.annotations)
        try:
            self.runner = Runner(cfg.check_names, cfg.checks, cfg.events_path, sinks=sinks)
        except OSError as e:
            raise ConfigError(f"aggregator.events_path: cannot open {cfg.events_path!r}: {e}") from None
        self._paused = 0.0  # seconds of the writer's own pauses (PAUSE_S), left out of the state's clock
        self.state = State(Limits.of(cfg), self._state_clock, runner=self.runner)
        self._snapshot = Snapshot()
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(lambda: self._snapshot, cfg.layer_depth, cfg.rank_detail_max,
                                                 cfg.rank_series_max, cfg.max_series_total))
        self.api = Api(lambda: self._snapshot, self.registry, self._alive, self.control,
                       cfg.control_token.get_secret_value())
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._intake_thread: Optional[threading.Thread] = None
        self.intake = Intake(cfg.max_intake_bytes, cfg.max_intake_frames)
        self.receiver = Receiver(cfg, self.intake, self._stop, self.control.outbox)
        self._overload_counted = 0
        self._slots = 0  # State.slots when the intake last learnt which jobs hold a slot
        self._http: Optional[HTTPServer] = None
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

    def _alive(self) -> bool:
        """The writer and the intake thread are running (``/healthz``)."""
        return all(t is not None and t.is_alive() for t in (self._thread, self._intake_thread))

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> "Aggregator":
        self.endpoint = self.receiver.bind()
        try:
            self._http = serve(self.cfg.metrics_host, self.cfg.metrics_port, self.api)
        except ConfigError:
            self.receiver.close()
            raise
        self.metrics_port = self._http.server_port
        if self.cfg.file_sd_path:  # announced once the port is bound: Prometheus may scrape at once
            target = f"{target_host(self.cfg.metrics_host, self.cfg.file_sd_host)}:{self.metrics_port}"
            sd = TargetFile(self.cfg.file_sd_path, target, self.cfg.file_sd_labels)
            try:
                sd.write()
            except OSError as e:
                self._http.server_close()
                self.receiver.close()
                raise ConfigError(f"aggregator.file_sd_path: cannot write {self.cfg.file_sd_path!r}: {e}") from None
            self._target_file = sd
        # a short poll: stop() returns within 50 ms instead of the server's default 0.5 s
        threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, name="gradwatch-http",
                         daemon=True).start()
        self._thread = threading.Thread(target=self._loop, name="gradwatch-writer", daemon=True)
        self._intake_thread = self.receiver.start()
        self._thread.start()
        log.info("gradwatch aggregator: listening on %s%s, metrics at %s%s", self.endpoint,
                 " (CURVE)" if self.receiver.curve else "", self.metrics_url,
                 f" (file_sd target in {self.cfg.file_sd_path})" if self._target_file else "")
        return self

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
        self.receiver.term()
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

    def handle(self, frame: bytes, peer_key: Optional[str] = None, peer: Optional[bytes] = None,
               source: Optional[str] = None) -> None:
        """Decode and apply one frame; count it as rejected by reason if it is not valid.

        ``peer_key``: the sender's CURVE public key (Z85) with CURVE on; a job is bound to the key
        that created it. ``peer``: the routing id of the connection it came on (the control room
        sends the rank's commands there once the frame is accepted; answers to commands must come
        on the connection their command went to). ``source``: the sender for admission's quotas
        per source (its CURVE key, else its address; None: no quota)."""
        st = self.state
        t0 = time.perf_counter()
        try:
            msg = wire.decode(frame, self.cfg.limits, st.schema_sizes, st.known_schema)
        except wire.WireError as e:
            st.reject(e.reason)
        else:
            try:
                if isinstance(msg, (wire.Stack, wire.Ack)):
                    self.control.answer(msg, peer, st.labels.get((msg.header.job, msg.header.key)))
                else:
                    kind = _KIND[type(msg)]
                    taken = st.received[kind]
                    st.apply(msg, peer_key=peer_key, source=source)
                    if peer is not None and st.received[kind] != taken:  # accepted: its rank's route
                        self._route(msg.header, peer)
            except Exception as e:  # a bug of ours must not let one peer stop the aggregator
                st.reject("internal")
                if not self._internal_warned:
                    self._internal_warned = True
                    log.exception("gradwatch aggregator: failed to apply a message: %r", e)
        st.decode_seconds += time.perf_counter() - t0
        st.decode_count += 1

    def _route(self, h: wire.Header, peer: bytes) -> None:
        """A frame of ``h``'s rank was accepted: the control room sends its commands to ``peer``
        while the rank's job holds a slot and the rank this boot."""
        job = self.state.registry.of(h)
        if job is not None and job.admitted:
            r = job.ranks.get(h.rank)
            if r is not None and r.boot == h.boot:
                self.control.heard(job.job, h.rank, h.boot, peer)

    def _on_signal(self, signum, _frame) -> None:
        self._signal = signal.Signals(signum).name
        self._stop.set()

    def publish(self) -> None:
        self._snapshot = replace(snapshot(self.state, time.time()), control=self.control.view())
        self._announce()

    def _announce(self) -> None:
        """Log a job once when it is proven (its ranks showed steps: not a pending or unproven id
        stray or forged frames made) and once when it is gone (every rank silent past
        rank_ttl_s). At most ``max_jobs`` hold a slot at once, and a proven job's slot frees only
        after rank_ttl_s of silence: at most 2 x max_jobs lines per rank_ttl_s, whatever peers send."""
        jobs = self.state.jobs
        admitted = {label: job.world for label, job in jobs.items() if job.proven}
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

    def _state_clock(self) -> float:
        """The state's clock: ``clock`` less the writer's pauses (:meth:`_turn`), so that time the
        aggregator did not run counts as no rank's silence nor a stall."""
        return self.clock() - self._paused

    def _turn(self, last: Optional[float]) -> float:
        """The writer's loop at a turn: a gap since the ``last`` one (``clock``, seconds) longer
        than :data:`PAUSE_S` was the aggregator's own pause, left out of the state's clock from now
        on (every rank's last heard time, its latest report, rounds' and votes' ages move forward
        by it). Returns this turn's time."""
        t = self.clock()
        if last is not None and t - last > PAUSE_S:
            self._paused += t - last
            log.warning("gradwatch aggregator: did not run for %.1f s (the process was stopped, or starved of CPU); "
                        "that time counts as no rank's silence", t - last)
        return t

    def _loop(self) -> None:
        turn = None
        published = -1
        last_pub = last_tick = last_control = 0.0
        control_slots = -1
        interval = wait = self.cfg.publish_interval_s
        tick_wait = 0.1
        gate = SliceGate()
        intake = self.intake
        try:
            while not self._stop.is_set():
                turn = self._turn(turn)
                if intake.ready.wait(min(interval, 0.1) if not self.state.closing else 0):
                    for item in intake.take(1000):
                        self.handle(*item)
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
                refused = self.receiver.refused()
                if refused:
                    self._count_refused(refused)
                now = self.clock()
                self._guarded(self.control.tick, "close control requests")  # the open ones: a few at most
                if now - last_tick >= tick_wait:
                    last_tick = now
                    t0 = time.perf_counter()
                    turn = self._turn(turn)  # a pause while frames were handled is no silence either
                    self._guarded(self.state.tick, "tick")
                    # each job's latest step for the commands' start steps; routes and halt_on once a second
                    full = now - last_control >= 1.0 or self.state.slots != control_slots
                    if full:
                        last_control, control_slots = now, self.state.slots
                    self._guarded(lambda: self.control.refresh(self.state.jobs, full, self._state_clock()), "refresh the control room")
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
            self.receiver.join(5)  # its thread closes the ROUTER socket (and disables its monitor)

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
        settings cannot hold one probed step of it (:meth:`.intake.Intake.advice`), naming the
        settings and the values that would."""
        for ident, _ in drops:
            job = self.state.registry.find(ident)
            if job is None or not job.admitted or job.job in self._intake_warned or not job.schemas:
                continue
            biggest = max(wire.probe_bytes(len(s.params), len(s.slots)) for s in job.schemas.values())
            advice = self.intake.advice(job.job, job.world, biggest)
            if advice is None:
                continue
            if len(self._intake_warned) >= 1024:  # jobs come and go over months
                self._intake_warned.clear()
            self._intake_warned.add(job.job)
            log.warning(advice)

    def _count_refused(self, n: int) -> None:
        """One rejection (``unauthenticated``) per refused CURVE handshake: a peer without keys,
        with a client key not admitted, or with another server key."""
        self.state.reject("unauthenticated", n)
        if not self._refused_warned:
            self._refused_warned = True
            log.warning("gradwatch aggregator: refused a peer's CURVE handshake (counted in "
                        'gradwatch_messages_rejected_total{reason="unauthenticated"})')
