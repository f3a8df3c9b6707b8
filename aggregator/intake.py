"""The intake: every agent's frames, from the socket to the writer, bounded and shared fairly.

The intake thread owns the aggregator's ROUTER socket (:class:`Receiver`, its one user: ZeroMQ
sockets are not thread-safe). It moves frames from ZeroMQ, each with the routing id of the
connection it came on, into :class:`Intake`, a queue bounded in bytes over all agents
together (``max_intake_bytes``; beyond it frames are dropped and counted, reason ``overload``), so
that under overload memory does not grow with the number of connected agents times ZeroMQ's
per-connection high-water mark. Once the queue is half full, each job (the identity its frames'
headers claim, :func:`gradwatch.wire.peek`, and with CURVE the sender's key) may hold only its
fair share of it: a job flooding the aggregator loses its own frames, not another job's. The
writer thread takes frames from the jobs' queues in turn. With CURVE on, the receiver's socket
authenticates every peer (the ZAP handler) and counts the handshakes it refused. Between receives
the intake thread sends the commands other threads queued for agents (the control room's outbox,
:class:`~.control.Outbox`): ``ROUTER_MANDATORY`` and ``NOBLOCK``, so a command to a connection
gone, or to an agent not reading, is dropped and counted, never waited for.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Optional

import msgspec.inspect
import zmq

from gradwatch import auth, wire
from gradwatch.errors import ConfigError

log = logging.getLogger("gradwatch.aggregator")

#: most job identities :attr:`Intake.dropped_jobs` tracks between two :meth:`Intake.take_dropped`
#: calls (each pass of the writer's loop, 0.1 s or so): a peer's flood of forged job ids cannot grow it
#: past this. Far more than the jobs :class:`~.state.State` holds at the defaults (``max_jobs`` 64 and
#: ``max_pending_jobs`` 16); a drop past it goes untracked: its job's silence checks are not muted.
MAX_DROPPED_JOBS = 1024
#: the :class:`Intake` queue of every frame whose identity holds no slot (:meth:`Intake.admit`)
PENDING = "pending"
#: most share of a job's room in the :class:`Intake` the bulk of its frames may take: past it a
#: probe report is kept as its step's record alone (~1/40 of its bytes at 100 layers) and a schema
#: (~15 kB at 100 layers, resent by every rank) is dropped (:func:`gradwatch.wire.shed`); the rest
#: of the room holds the records of the steps that follow. A 16,384-rank job's probed step is ~160
#: MB of reports at 100 layers, and its schema resends 245 MB: dropping whatever found no room hid
#: those ranks' step until their next message (~1 s at a step a second), and dropped the next
#: steps' records that found the room full of arrays.
BULK_SHARE = 0.75
#: is nobody's (decoding would reject the frame) and is not tracked, so each identity stays small
_MAX_JOB_ID, _MAX_JOB_KEY = (
    next(f.type.max_length for f in msgspec.inspect.type_info(wire.Header).fields if f.name == n) for n in ("job", "key")
)



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

    def advice(self, job: str, world: int, report_bytes: int) -> Optional[str]:
        """What to tell about job ``job`` of ``world`` ranks with ``report_bytes`` probe reports
        when its frames were dropped or probe arrays shed: the settings that would hold one probed
        step of it (:meth:`short_for`), or None when these do."""
        need = self.short_for(world, report_bytes)
        if need is None:
            return None
        frames, nbytes = self.share_for(world, report_bytes)
        return (
            f"gradwatch aggregator: job {job} ({world} ranks) loses frames or probe arrays to overload: a probed step "
            f"of it ({world} reports of ~{report_bytes // 1000} kB) and the steps that come while it is handled need "
            f"~{frames} frames and ~{nbytes // 1_000_000} MB of the intake, more than one job's share (half of "
            f"--max-intake-frames {self.max_frames} and --max-intake-bytes {self.max_bytes} once it is half full); "
            f"to hold it set --max-intake-frames {need[0]} --max-intake-bytes {need[1]}"
        )

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
                job = item[-1]
                if job in new:
                    self._queues.setdefault(job, collections.deque()).append(item[:-1])
                    self._bytes[job] += len(item[0])
                    self._bytes[PENDING] -= len(item[0])
                else:
                    rest.append(item)
            if rest:
                self._queues[PENDING] = rest
            else:
                del self._queues[PENDING], self._bytes[PENDING]

    def put(self, batch: list) -> None:
        """Intake thread: hold ``(frame bytes, CURVE user id or None[, routing id])`` items while
        room lasts; :meth:`take` gives each back as it came."""
        jobs = [(item[1], wire.peek(item[0])) for item in batch]  # read outside the lock
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
            item, n = (kept, *item[1:]), len(kept)
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
        self._drop(item[-1] if queue is PENDING else queue)

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
        """Writer thread: up to ``most`` items as :meth:`put` was given them (``(frame, user id,
        routing id)`` from the receiver), the jobs in turn, each job's oldest first; ``ready``
        stays set while more wait."""
        out: list = []
        with self._lock:
            while self._queues and len(out) < most:
                each = max(1, (most - len(out)) // len(self._queues))
                for job in list(self._queues):
                    q = self._queues[job]
                    for _ in range(min(each, len(q), most - len(out))):
                        item = q.popleft()
                        out.append(item if job is not PENDING else item[:-1])
                        self._forget(job, len(item[0]))
                        if job not in self._queues:
                            break
            if not self._queues:
                self.ready.clear()
        return out


#: seconds the intake thread waits for frames before it looks at the outbox again: a command
#: queued meanwhile leaves at most this late
POLL_S = 0.05
#: commands sent to agents per pass of the intake thread, at most
SENDS_PER_PASS = 1000


def _address(frame) -> Optional[str]:
    """The address of the peer a received frame came from (ZeroMQ's Peer-Address: the IP of a TCP
    peer), or None where the transport has none (ipc, inproc)."""
    try:
        return frame.get("Peer-Address") or None
    except zmq.ZMQError:
        return None


class Receiver:
    """The intake thread and the socket it drains: the aggregator's ROUTER socket bound at
    ``cfg.listen`` (with CURVE keys, a ZAP handler authenticating every peer, and a monitor of
    the handshakes it refused), every frame moved into ``intake`` with its sender's CURVE key and
    the routing id of its connection; and the commands of ``outbox`` sent to their connections.

    Args:
        cfg: the aggregator's settings (``listen``, ``rcv_hwm``, ``max_message_bytes``, keys).
        intake: the queue the frames go to.
        stop: set when the aggregator stops; the intake thread then closes the socket.
        outbox: the commands to send (``take(most) -> [(routing id, frame)]``, ``sent(n)``,
            ``dropped(n)``: :class:`~.control.Outbox`), or None.

    Attributes:
        endpoint: the endpoint bound (the port filled in for ``:0``), after :meth:`bind`.
        thread: the intake thread, once started.
    """

    def __init__(self, cfg, intake: Intake, stop: threading.Event, outbox=None):
        self.cfg, self.intake, self._stop, self.outbox = cfg, intake, stop, outbox
        self.endpoint = ""
        self.thread: Optional[threading.Thread] = None
        self._ctx: Optional[zmq.Context] = None
        self._sock = None
        self._auth = None  # zmq.auth.thread.ThreadAuthenticator with CURVE
        self._refused = None  # monitor socket of refused CURVE handshakes

    def bind(self) -> str:
        """Bind the socket; returns the endpoint bound.

        Raises:
            ConfigError: the keys are unusable (naming the setting), or the endpoint cannot be bound.
        """
        cfg = self.cfg
        keys = cfg.curve_keys()  # ConfigError naming the setting before anything is bound
        if keys is None and not cfg.listen_is_local:
            log.warning(
                "gradwatch aggregator: %s accepts reports from anyone who reaches it (no CURVE); "
                "run `gradwatch keys` and pass --server-key and --client-keys (docs/security.md: CURVE keys)", cfg.listen,
            )
        self._ctx = zmq.Context()
        self._auth = keys.authenticator(self._ctx) if keys else None  # ZAP handler before bind
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, cfg.rcv_hwm)
        # a command to a connection that is gone raises (dropped, counted) instead of vanishing
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 64)  # per connection: an agent reads a few commands a turn
        # libzmq drops (and disconnects) frames far beyond our own limit before buffering them
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * cfg.max_message_bytes)
        if keys:
            keys.apply(sock)
            # refused handshakes are counted: gradwatch_messages_rejected_total{reason="unauthenticated"}
            self._refused = sock.get_monitor_socket(auth.REFUSED_EVENTS)
        self._sock = sock
        try:
            if cfg.listen.startswith("tcp://") and cfg.listen.endswith(":0"):
                port = sock.bind_to_random_port(cfg.listen[: -len(":0")])
                self.endpoint = cfg.listen[: -len(":0")] + f":{port}"
            else:
                sock.bind(cfg.listen)
                self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self.close()
            raise ConfigError(f"aggregator.listen: cannot bind {cfg.listen}: {e}") from None
        return self.endpoint

    @property
    def curve(self) -> bool:
        """Peers are authenticated (CURVE keys set)."""
        return self._refused is not None

    def start(self) -> threading.Thread:
        """Start the intake thread (after :meth:`bind`); returns it."""
        self.thread = threading.Thread(target=self._receive, name="gradwatch-intake", daemon=True)
        self.thread.start()
        return self.thread

    def _receive(self) -> None:
        """Intake thread: the only user of the ROUTER socket; moves frames into the intake and
        sends the outbox's commands."""
        sock = self._sock
        curve = self.curve
        intake = self.intake
        wait_ms = int(POLL_S * 1000) if self.outbox is not None else 100
        try:
            while not self._stop.is_set():
                if self.outbox is not None:
                    self._send()
                if not sock.poll(wait_ms):
                    continue
                batch = []
                for _ in range(1000):
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if len(parts) < 2:
                        continue
                    # the sender, for admission's quotas per source: with CURVE the key the ZAP
                    # handler set as User-Id, else the peer's address
                    user = parts[1].get("User-Id") if curve else None
                    source = user if curve else _address(parts[1])
                    # a peer's message of several frames gives each (an agent sends one)
                    batch.extend((f.bytes, user, parts[0].bytes, source) for f in parts[1:])
                intake.put(batch)
        except Exception as e:  # never expected: the writer's /healthz reports a dead intake
            log.exception("gradwatch aggregator: intake thread stopped: %r", e)
        finally:
            if curve:
                sock.disable_monitor()
            sock.close(linger=0)

    def _send(self) -> None:
        """Intake thread: the commands queued for agents, each to the connection named, without
        waiting; one to a connection gone or full is dropped (counted by the outbox)."""
        sent = dropped = 0
        for rid, frame in self.outbox.take(SENDS_PER_PASS):
            try:
                self._sock.send_multipart((rid, frame), zmq.NOBLOCK)
                sent += 1
            except zmq.ZMQError:  # EHOSTUNREACH (ROUTER_MANDATORY: gone), EAGAIN (its queue is full)
                dropped += 1
        if sent:
            self.outbox.sent(sent)
        if dropped:
            self.outbox.dropped(dropped)

    def refused(self) -> int:
        """Writer thread: CURVE handshakes refused since the last call (a peer without keys, with
        a client key not admitted, or with another server key); 0 without CURVE."""
        n = 0
        while self._refused is not None and self._refused.poll(0):
            try:
                self._refused.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            n += 1
        return n

    def join(self, timeout: float) -> None:
        """Writer thread, at its end: wait for the intake thread (it closes the socket and
        disables its monitor), then close the monitor's socket."""
        if self.thread is not None:
            self.thread.join(timeout)
        if self._refused is not None:
            self._refused.close(linger=0)

    def close(self) -> None:
        """After a failed start: close the socket, its monitor and the ZAP handler, then the context."""
        if self._refused is not None:
            self._sock.disable_monitor()
            self._refused.close(linger=0)
        if self._sock is not None:
            self._sock.close(linger=0)
        self.term()
        self._ctx = None

    def term(self) -> None:
        """Stop the ZAP handler and terminate the context (once the socket is closed)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
