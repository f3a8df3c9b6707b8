"""The sender: a background thread that finalises, encodes and sends messages over ZeroMQ, and
takes the aggregator's commands on the same connection.

The training thread only appends to a bounded deque (drop-oldest, counted) and sets an event; it
never touches the socket, never waits and never sees an exception from here. The sender is a
conductor of small parts, each with explicit inputs:

* :class:`Link`, the connection: a DEALER socket that connects (never binds: a bound socket
  blocks without peers, case C24) with ``LINGER 0`` so process exit never waits on unsent data
  (case C26; only the last messages at close, the goodbye among them, get
  :data:`CLOSE_LINGER_MS` to leave), ``IMMEDIATE`` so nothing is queued to an aggregator that is
  not connected, sends with ``NOBLOCK`` (case C25), and watches its handshakes: a refused one is
  counted and said (a wrong key, a wrong port), as is an aggregator not reached for
  :data:`UNREACHED_WARN_S`. ZMTP heartbeats drop a silent peer after 3 s (partition, stopped
  aggregator) and reconnection backs off from 0.1 s to 1 s, so reports flow again within ~2 s of
  the aggregator's return;
* :class:`Backoff`: the thread never spins, whatever the aggregator does: it builds a
  message only when ZeroMQ can take it (``POLLOUT``); when it cannot, reports wait in the bounded
  queue (the oldest dropped and counted once) and the next attempt comes after a backoff doubling
  from 10 ms to ``max(1 s, heartbeat_s)`` (10 s at most), reset by a (re)connection or a send. A
  report that was built and refused is counted as dropped once; schemas and heartbeats are
  retried, not counted;
* :class:`Batch` coalesces: the records of unprobed steps gather and go out as one
  ``wire.Steps`` message once the oldest is ``coalesce_s`` old, so the message rate does not
  grow with the step rate. The batch goes out sooner before any other queued message (a probe's
  report: steps stay in order), at once when a record shows an anomaly (``watch``: a non-finite
  or spiking gradient norm, so detection waits for no timer), before a record that cannot share
  its message (another schema, another ``grad_norms`` width or ``grad_sq`` dims, a step not after
  the last), when it holds :data:`wire.MAX_STEPS` records or :data:`BATCH_BYTES`, and when
  stopping. A batch ZeroMQ refuses is dropped whole, each record counted once;
* :class:`Inbox` takes the aggregator's commands (the only peer of the socket this agent
  connected: with CURVE, the aggregator whose server key it was given), once per turn, a few at
  most (``poll(0)``, never waiting): it decodes each (:func:`gradwatch.wire.decode_command`) and
  drops, counting by reason and logging once, a malformed or oversized one, one for another job,
  rank or boot, one seen among the last :data:`SEEN_IDS` ids (a replay or a resend), and any past
  :data:`COMMANDS_PER_S` a second; an expired one is refused (an ``ack`` saying so). What a
  command does is the ``control`` input's (:mod:`.control`); its answer goes out at once.

* :class:`Pulse`: a heartbeat goes out only when no message went out for ``heartbeat_s`` (any
  message says the rank is alive), when the error count changed since the last one (only a
  heartbeat carries it; at most one per ``heartbeat_s``), after a (re)connection, and always when
  stopping (the goodbye);
* :class:`SchemaTimer`: the full schema goes out on demand (it changed), whenever the connection
  (re)establishes (socket monitor ``EVENT_CONNECTED``), so a late or restarted aggregator learns it
  (case C24), and again after ``schema_every_s``, the gap doubling after each resend up to ``32 x
  schema_every_s``, each resend up to its gap late at random (spread further past
  :data:`SCHEMA_RANKS` ranks, :func:`schema_spread`); the heartbeats carry its hash in between.

The sender itself stamps a per-rank sequence number on each message actually handed to ZeroMQ,
so the aggregator can count messages lost in flight (case C28), and survives any failure of one
message: it is dropped and counted in ``errors`` (case C32).
"""

from __future__ import annotations

import collections
import logging
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import msgspec
import zmq
import zmq.utils.monitor

from gradwatch import auth, wire

log = logging.getLogger("gradwatch.agent")

Build = Callable[[wire.Header], Optional[wire.Message]]
Ready = Optional[Callable[[], bool]]

#: most bytes of records one steps message gathers (well below the aggregator's 16 MiB frame cap,
#: and a refused message loses at most this much)
BATCH_BYTES = 1 << 20
#: the schema resend gap doubles up to this multiple of ``schema_every_s``
SCHEMA_BACKOFF = 32
#: job size up to which a rank's periodic schema resends come up to :data:`SCHEMA_JITTER` of their
#: gap late; in a larger job up to ``world / SCHEMA_RANKS`` times that (:func:`schema_spread`), so
#: the job's resends, spread over a window as many times as long, stay at about this many per gap
#: whatever its size, and the first of them still come after the gap. A 16,384-rank job's first
#: resends (~10 kB each at 100 layers, 170 MB within 10 s) put its freshness past 2 s at those
#: steps. The aggregator keeps a job's schemas by hash, and the ranks of one pipeline stage share
#: one (their mesh coordinates travel in their headers): the earliest resend of any serves them all.
SCHEMA_RANKS = 1024
#: each periodic schema resend comes up to this fraction of its gap late, drawn at random: a large
#: job's ranks start together, and at 0.25 a 16,384-rank job's first resends (~10 kB each at 100
#: layers) reached the aggregator within 2.5 s, a burst that crowded out the steps' records there
SCHEMA_JITTER = 1.0
#: milliseconds the sender's last messages (the goodbye among them) may take to leave at close,
#: when connected: with none, ZeroMQ drops what it has taken but not yet written, now and then
#: the goodbye, and a job that closed properly would be named silent
CLOSE_LINGER_MS = 200
#: seconds failed handshakes (none succeeded) last before the agent says so, unless the aggregator
#: refused its key (said at once): a peer killed or stopped mid-handshake, or a proxy before it
#: starting, fails some handshakes of an agent that is rightly configured
HANDSHAKE_WARN_S = 10.0
#: ms a plain-TCP handshake may take: a peer that accepts TCP but never speaks ZMTP (an HTTP port)
#: fails it then, not after ZeroMQ's 30 s. (With CURVE the aggregator's ZAP thread admits ~1,000
#: handshakes a second: a large job connecting at once needs ZeroMQ's default.)
HANDSHAKE_TIMEOUT_MS = 5000
#: seconds after a disconnect with no reconnection attempt before the agent opens a new socket:
#: ZeroMQ retries a lost connection at once (reconnect interval 0.1 s), but a session it ended on
#: a protocol error (a frame over the socket's MAXMSGSIZE from the peer) is never retried
REOPEN_AFTER_S = 1.0
#: seconds a command may be issued ahead of this host's wall clock (the hosts' clocks apart):
#: further ahead it is refused as expired, so no command lives past its time window here, nor
#: outlasts the ids the inbox remembers (:data:`SEEN_IDS`) to be replayed
MAX_CLOCK_AHEAD_S = 300.0
#: seconds an agent goes without reaching any aggregator (no connection at all: none listening,
#: a wrong host or port) before it says so, once; and says so again when one answers. A job may
#: start before its aggregator; a multi-day one must not learn this only at close
UNREACHED_WARN_S = 60.0
#: most commands the sender reads from the aggregator in one turn (it turns every ``flush_s`` at least)
COMMANDS_PER_TURN = 4
#: most commands an agent carries out a second; the rest are counted and dropped
COMMANDS_PER_S = 10
#: command ids an agent remembers: a command whose id is among them changes nothing
SEEN_IDS = 256
_ROW_BYTES = 8 * len(wire.STEP_COLUMNS)


def schema_spread(world: int) -> float:
    """How many times further a rank of a ``world``-rank job spreads its periodic schema resends
    than a small job's rank (:data:`SCHEMA_RANKS`): 1 up to that many ranks, ``world /
    SCHEMA_RANKS`` past it. A resend after a gap ``g`` comes ``jitter x min(g x spread, top) x
    U(0, 1)`` late (``top``: ``SCHEMA_BACKOFF x schema_every_s``, the longest gap), so a job's first
    resends, ``g = schema_every_s``, come at about ``SCHEMA_RANKS / (g x jitter)`` a second (~100 at
    the defaults) whatever its size, and no resend comes more than ``top`` late."""
    return max(1.0, world / SCHEMA_RANKS)


def nonfinite(r: wire.Report) -> bool:
    """Whether a record shows a non-finite gradient (a NaN norm without non-finite parameters
    means the step had no gradients: not a fault)."""
    return r.grad_nonfinite > 0 or math.isinf(r.grad_norm)


def _record_bytes(r: wire.Report) -> int:
    """What a record adds to a steps message, bytes (about)."""
    g = r.grad_norms
    return (_ROW_BYTES + (4 * len(g) if g is not None else 0) + (8 * len(r.grad_sq) if r.grad_sq else 0)
            + (4 if r.nonfinite_slot is not None else 0))


def _joins(last: wire.Report, r: wire.Report) -> bool:
    """Whether ``r`` can follow ``last`` in one steps message: a later step of the same schema,
    with ``grad_norms`` of the same width and ``grad_sq`` over the same dims."""
    a, b = last.grad_norms, r.grad_norms
    return (r.step > last.step and r.schema == last.schema
            and (a is None) == (b is None) and (a is None or len(a) == len(b))
            and (last.grad_sq is None) == (r.grad_sq is None)
            and (r.grad_sq is None or [d for d, _ in last.grad_sq] == [d for d, _ in r.grad_sq]))




@dataclass(frozen=True)
class Identity:
    """Who an agent is on the wire: every header's fields but the sequence number and the time.

    Attributes:
        job: the job id; rank, world: the rank and the job's size; boot: this agent instance's
        random id; key: the job's identity digest (``wire.Header.key``); coord: the rank's mesh
        coordinates (() without a mesh).
    """

    job: str
    rank: int
    world: int
    boot: str
    key: str = ""
    coord: tuple = ()

    def header(self, seq: int) -> wire.Header:
        """The header of a message sent now (wall clock) with sequence number ``seq``."""
        return wire.Header(self.job, self.rank, self.world, self.boot, seq, time.time(), self.key, self.coord)


class Batch:
    """The records of unprobed steps waiting to go out as one ``wire.Steps`` message (the
    module docstring says when it goes). The sender thread's alone.

    Args:
        coalesce_s: seconds its oldest record may wait (0: until the sender's next turn).
    """

    def __init__(self, coalesce_s: float):
        self.coalesce_s = coalesce_s
        self.records: list[wire.Report] = []
        self.at = 0.0  # clock when the oldest record joined
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.records)

    def joins(self, r: wire.Report) -> bool:
        """Whether ``r`` may join the batch (always, when empty: :func:`_joins`)."""
        return not self.records or _joins(self.records[-1], r)

    def add(self, r: wire.Report, now: float) -> bool:
        """Add ``r`` (it must :meth:`join <joins>`) at clock ``now``; returns whether the batch is
        full (:data:`wire.MAX_STEPS` records or :data:`BATCH_BYTES`) and must go now."""
        if not self.records:
            self.at = now
        self.records.append(r)
        self.nbytes += _record_bytes(r)
        return len(self.records) >= wire.MAX_STEPS or self.nbytes >= BATCH_BYTES

    def due(self, now: float) -> bool:
        """Whether the oldest record has waited ``coalesce_s``."""
        return bool(self.records) and now - self.at >= self.coalesce_s

    @property
    def due_at(self) -> float:
        """Clock when the batch falls due (inf when empty)."""
        return self.at + self.coalesce_s if self.records else math.inf

    def take(self) -> list[wire.Report]:
        """Empty the batch; returns its records, oldest first."""
        out, self.records, self.nbytes = self.records, [], 0
        return out


class Backoff:
    """When the sender tries again after ZeroMQ took nothing: ``min_s`` doubling up to ``max_s``
    (``max(1 s, heartbeat_s)``, 10 s at most), back to ``min_s`` after a send or a (re)connection.

    Attributes:
        retry_at: clock of the next attempt after a refusal.
        blocked: refusals so far (tests bound them).
    """

    def __init__(self, heartbeat_s: float):
        # short first retries: a fresh socket is refused until its connection completes (~1 ms on
        # a LAN), and reports of fast steps wait in the bounded queue meanwhile
        self.min_s = 0.01
        self.max_s = min(10.0, max(1.0, heartbeat_s))
        self.current = self.min_s
        self.retry_at = 0.0
        self.blocked = 0

    def refused(self, now: float) -> None:
        """ZeroMQ took nothing at ``now``: no attempt before ``now + current``, which doubles."""
        self.retry_at = now + self.current
        self.current = min(self.current * 2, self.max_s)
        self.blocked += 1

    def reset(self, now: Optional[float] = None) -> None:
        """A send went through, or (with ``now``) a connection came: the next refusal waits
        ``min_s`` (and a connection allows an attempt at once)."""
        self.current = self.min_s
        if now is not None:
            self.retry_at = now


class SchemaTimer:
    """When the schema goes out (module docstring): on demand (:attr:`demanded`: a change, a
    (re)connection), and again after a gap of ``every_s`` doubling after each resend up to
    ``SCHEMA_BACKOFF x every_s``, each resend up to ``jitter`` of ``min(gap x spread, top)`` late
    at random (:func:`schema_spread` of the job's ``world``). The sender thread's.

    Raises:
        ValueError: a negative ``jitter``.
    """

    def __init__(self, every_s: float, jitter: float = SCHEMA_JITTER, world: int = 1):
        if jitter < 0:
            raise ValueError(f"schema_jitter must be >= 0, got {jitter}")
        self.every_s, self.jitter, self.spread = every_s, jitter, schema_spread(world)
        self.gap = every_s  # until the next periodic resend; doubles after each
        self.next = 0.0  # clock of the next periodic resend
        self.demanded = True
        self.rng = random.Random()  # the jitter: every agent its own

    def due(self, now: float) -> bool:
        """Whether the schema is to go out at ``now``: demanded, or the resend timer ran out."""
        return self.demanded or now >= self.next

    def went(self, now: float, on_demand: bool, sent: bool) -> None:
        """The schema was handed over (``sent``), or there was none to send, at ``now``: a send on
        demand restarts the gap, a timed one doubles it; the next resend is drawn."""
        top = SCHEMA_BACKOFF * self.every_s
        if sent:
            self.gap = self.every_s if on_demand else min(2 * self.gap, top)
        # up to the jitter late, stretched in a large job, but never more than the top gap late
        late = self.jitter * min(self.gap * self.spread, top) * self.rng.random()
        self.next = now + self.gap + late


class Pulse:
    """When a heartbeat goes out (module docstring): ``every_s`` after the latest message or
    heartbeat attempt, at once after a (re)connection (:attr:`due`), and within ``every_s`` of a
    change of the error count, which only a heartbeat says. The sender thread's."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.due = True  # at the first turn and after each (re)connection
        self.errors = 0  # the error count the latest heartbeat said
        self.last_sent = self.last_beat = 0.0  # clock of the latest message, and heartbeat, handed over

    @property
    def quiet_until(self) -> float:
        """When a heartbeat falls due: ``every_s`` after the latest message (or the latest
        heartbeat attempt, so one that fails to build is not retried at every turn)."""
        return max(self.last_sent, self.last_beat) + self.every_s

    def is_due(self, now: float, errors: Callable[[], int]) -> bool:
        if self.due or now >= self.quiet_until:
            return True
        # only a heartbeat says the error count: a change is said within every_s, steps flowing or not
        return now >= self.last_beat + self.every_s and errors() != self.errors

    def went(self, now: float, errors: int) -> None:
        self.due, self.errors, self.last_beat = False, errors, now


class Link:
    """The agent's connection to the aggregator: a ZeroMQ DEALER socket connected to
    ``endpoint`` (options in the module docstring), the monitor of its handshakes, and what the
    agent says about them. The sender thread's alone once made.

    Args:
        endpoint: the aggregator's ZeroMQ endpoint.
        keys: CURVE keys (:class:`gradwatch.auth.ClientKeys`), or None for plain TCP.
        send_hwm: ZeroMQ send high-water mark, messages.
        clock: monotonic clock, seconds.

    Raises:
        Whatever ZeroMQ or ``keys.apply`` raise; nothing made is left open then.

    Attributes:
        sock: the DEALER socket.
        connected: a ZMTP handshake with a peer completed at least once.
        refused: handshakes that failed (refused keys, no CURVE keys, not an aggregator).
        reopened: new sockets opened after ZeroMQ gave a connection up for good
            (:data:`REOPEN_AFTER_S`).
    """

    def __init__(self, endpoint: str, keys=None, send_hwm: int = 256, clock: Callable[[], float] = time.monotonic):
        self.endpoint = endpoint
        self._curve = keys is not None
        self._clock = clock
        self.connected = False
        self.refused = 0
        self._told = False
        self._failing_since = math.nan  # clock of the first failed handshake, while none succeeded
        self._started = clock()
        self._told_unreached = False
        self._send_hwm, self._keys = send_hwm, keys
        self.reopened = 0
        self._dropped_at = math.nan  # clock of a disconnect not followed by a reconnection attempt
        self._handshake_failed = False  # the latest connection's handshake failed (its end is ZeroMQ's choice)
        self._ctx = zmq.Context(io_threads=1)
        try:
            self._open()
        except BaseException:
            # nothing half-made is left for the garbage collector to close on another thread
            self._ctx.destroy(linger=0)
            raise

    def _open(self) -> None:
        """Make the DEALER socket and its monitor, and connect (module docstring: the options)."""
        keys, send_hwm, endpoint = self._keys, self._send_hwm, self.endpoint
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, send_hwm)
        self.sock.setsockopt(zmq.RCVHWM, 16)  # commands: a handful at most, each turn reads a few
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4 * wire.MAX_COMMAND_BYTES)  # larger frames: the peer is cut off
        if keys is not None:
            keys.apply(self.sock)  # CURVE client: before connect
        # queue only to a connected aggregator: a restarted one must not first get stale reports
        # queued during the outage, ahead of the schema resent on connect
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)  # ms, exponential in between
        self.sock.setsockopt(zmq.CONNECT_TIMEOUT, 2000)  # a SYN into a partition is given up
        if keys is None:
            self.sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
        # ZMTP heartbeats: a peer silent for 3 s (partition, SIGSTOP) is dropped and reconnected,
        # instead of waiting out TCP's retransmission backoff after the network heals
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        # completed handshakes (a TCP connection alone is not one: a CURVE aggregator refuses a
        # keyless agent, an HTTP port answers no ZMTP) and failed ones (said once, counted)
        self._monitor = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | auth.REFUSED_EVENTS
            | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECT_DELAYED)
        self.sock.connect(endpoint)

    def _reopen(self) -> None:
        """Close the socket ZeroMQ gave up on and open a new one (its frames still queued are lost,
        as at any disconnect)."""
        try:
            self.sock.disable_monitor()
        except Exception:
            pass
        for s in (self._monitor, self.sock):
            try:
                s.close(linger=0)
            except Exception:
                pass
        self._open()
        self.reopened += 1
        self._dropped_at = math.nan

    def writable(self) -> bool:
        """Whether ZeroMQ takes a message now: a connected peer (``IMMEDIATE``) and room below the
        high-water mark. One getsockopt: nothing is built to find out."""
        try:
            return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT)
        except zmq.ZMQError:
            return False

    def send(self, frame: bytes) -> Optional[bool]:
        """Hand ``frame`` to ZeroMQ without blocking: True when taken, False when refused (no
        peer, high-water mark), None when ZeroMQ failed otherwise (logged at debug level)."""
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            log.debug("gradwatch: send failed: %r", e)
            return None
        return True

    def receive(self, most: int) -> list[bytes]:
        """Up to ``most`` frames the aggregator sent, without waiting (``poll(0)``). A message of
        several frames (never sent by an aggregator) gives its frames one by one."""
        out: list[bytes] = []
        try:
            while len(out) < most and self.sock.poll(0, zmq.POLLIN):
                out.append(self.sock.recv(zmq.NOBLOCK))
        except zmq.ZMQError:
            pass
        return out

    def events(self) -> bool:
        """Whether the socket (re)connected since the last call (TCP: the schema and a heartbeat
        go out at once, sent as soon as the handshake lets them); ``connected`` once a handshake
        completed. Counts failed handshakes in ``refused``; before any succeeded (nothing this agent
        sends would arrive) warns at once when the aggregator refused the key, else once they
        lasted :data:`HANDSHAKE_WARN_S`; and once when no aggregator was reached for
        :data:`UNREACHED_WARN_S`."""
        seen = False
        while self._monitor.poll(0):
            try:
                event = zmq.utils.monitor.parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except (zmq.ZMQError, ValueError, KeyError):
                break
            if event == zmq.EVENT_DISCONNECTED:
                # after a failed handshake ZeroMQ's own choice stands (a refused key is not retried:
                # a job with a wrong key must not knock at the aggregator every second)
                if not self._handshake_failed:
                    self._dropped_at = self._clock()
                self._handshake_failed = False
            elif event in (zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CONNECT_DELAYED):
                self._dropped_at = math.nan  # ZeroMQ reconnects on its own
            elif event == zmq.EVENT_CONNECTED:
                self._dropped_at, self._handshake_failed = math.nan, False
                seen = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if not self.connected and self._told_unreached:
                    log.warning("gradwatch: reached the aggregator at %s after %.0f s", self.endpoint,
                                self._clock() - self._started)
                self.connected = True
            elif event & auth.REFUSED_EVENTS:
                self._handshake_failed = True
                self.refused += 1
                if math.isnan(self._failing_since):
                    self._failing_since = self._clock()
                if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    self._failing_since = -math.inf  # a refused key is final: said at once
        if self._clock() - self._dropped_at >= REOPEN_AFTER_S:
            # a session ZeroMQ ended for good (a frame past MAXMSGSIZE): never retried by itself
            if not self.reopened:
                log.warning("gradwatch: the peer at %s ended this agent's connection on a protocol error (a frame "
                            "over %d bytes?): reconnecting on a new socket", self.endpoint, 4 * wire.MAX_COMMAND_BYTES)
            try:
                self._reopen()
            except Exception as e:  # a context terminated under us (closing): nothing to reopen
                log.debug("gradwatch: reopening the socket failed: %r", e)
                self._dropped_at = math.nan
        # other failures may be a peer killed or stopped mid-handshake, or a proxy before one
        # starting: said once they have lasted HANDSHAKE_WARN_S (checked every turn, events or not)
        if not (self.connected or self._told) and self._clock() - self._failing_since >= HANDSHAKE_WARN_S:
            self._told = True
            log.warning("gradwatch: %s", self.refusal())
        waited = 0.0 if self.connected or self._told or self._told_unreached else self._clock() - self._started
        if waited >= UNREACHED_WARN_S:
            self._told_unreached = True
            log.warning("gradwatch: no aggregator reached at %s in %.0f s: this rank's reports wait in a bounded "
                        "queue, then are dropped, until one answers (is it running, and is GRADWATCH_ENDPOINT right?)",
                        self.endpoint, waited)
        return seen

    def refusal(self) -> str:
        """What a failed handshake with the endpoint means, and the settings to check."""
        if self._curve:
            return (f"the aggregator at {self.endpoint} refused this agent's CURVE handshake: no report reaches "
                    "it (is GRADWATCH_SERVER_KEY the aggregator's public key, and this agent's client key "
                    "among its --client-keys?)")
        return (f"the ZeroMQ handshake with {self.endpoint} failed: no report reaches it (an aggregator with "
                "CURVE on needs GRADWATCH_SERVER_KEY and GRADWATCH_CLIENT_KEY; is GRADWATCH_ENDPOINT its "
                "ZeroMQ --listen port, not its HTTP one?)")

    def close(self) -> None:
        """Close the monitor and the socket (the socket's last messages get :data:`CLOSE_LINGER_MS`
        to leave when connected, none otherwise) and terminate the context. Never raises."""
        try:
            self.sock.disable_monitor()
        except Exception:
            pass
        for s, linger in ((self._monitor, 0), (self.sock, CLOSE_LINGER_MS if self.connected else 0)):
            try:
                s.close(linger=linger)
            except Exception:
                pass
        try:
            self._ctx.term()
        except Exception:
            pass

    def release(self) -> None:
        """Close both sockets without lingering and end the context; returns at once (nothing
        left open for ``term`` to wait for). Never raises."""
        try:
            self.sock.disable_monitor()
        except Exception:
            pass
        try:
            self._ctx.destroy(linger=0)
        except Exception:
            pass


class Inbox:
    """The aggregator's commands, checked before anything is done with them (module docstring).
    The sender thread's alone.

    Args:
        identity: the agent's job, rank and boot, which a command must name (rank -1 and boot ""
            name any).
        wall: wall clock, seconds since the epoch (a command's expiry is the aggregator's).
        clock: monotonic clock, seconds (the rate).

    Attributes:
        accepted: commands taken (expired ones among them: they are refused, not dropped).
        rejected: ``Counter`` of the commands dropped, by reason: a :data:`wire.REJECT_REASONS`
            (malformed, too large, the wrong direction...), ``job``, ``rank`` or ``boot`` (another
            agent's), ``replayed`` (an id among the last :data:`SEEN_IDS`), ``rate`` (over
            :data:`COMMANDS_PER_S` a second).
    """

    def __init__(self, identity: Identity, wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic):
        self.identity = identity
        self._wall, self._clock = wall, clock
        self.accepted = 0
        self.rejected: collections.Counter = collections.Counter()
        self._seen: collections.OrderedDict = collections.OrderedDict()  # the last SEEN_IDS ids
        self._recent: collections.deque = collections.deque()  # clock of the commands taken within 1 s
        self._told: set[str] = set()

    def take(self, frame: bytes) -> Optional[tuple[wire.Command, str]]:
        """``(command, why)`` for a command to answer (``why``: "" to carry it out, "expired" to
        refuse it: past its expiry, or issued more than :data:`MAX_CLOCK_AHEAD_S` ahead of this
        host's clock), or None for one dropped (counted in ``rejected``, the first of each reason
        logged). Never raises."""
        try:
            cmd = wire.decode_command(frame)
        except wire.WireError as e:
            return self._drop(e.reason, f"a command that is not one ({e})")
        except Exception as e:  # never expected of the decoder
            return self._drop("malformed", f"a command that failed to decode: {e!r}")
        me = self.identity
        if cmd.job != me.job:
            return self._drop("job", f"a command for job {cmd.job[:64]!r}")
        if cmd.rank not in (-1, me.rank):
            return self._drop("rank", f"a command for rank {cmd.rank}")
        if cmd.boot not in ("", me.boot):
            return self._drop("boot", "a command for another boot of this rank")
        if cmd.id in self._seen:
            return self._drop("replayed", "a command already seen (a replay or a resend)")
        now = self._clock()
        while self._recent and now - self._recent[0] >= 1.0:
            self._recent.popleft()
        if len(self._recent) >= COMMANDS_PER_S:
            return self._drop("rate", f"commands past {COMMANDS_PER_S} a second")
        self._recent.append(now)
        self._seen[cmd.id] = None
        if len(self._seen) > SEEN_IDS:
            self._seen.popitem(last=False)
        self.accepted += 1
        wall = self._wall()
        return cmd, ("expired" if wall > cmd.expires or cmd.issued > wall + MAX_CLOCK_AHEAD_S else "")

    def _drop(self, reason: str, what: str) -> None:
        self.rejected[reason] += 1
        if reason not in self._told:
            self._told.add(reason)
            log.warning("gradwatch: dropped %s (counted; later ones not logged)", what)
        return None


def refusal_ack(h: wire.Header, cmd: wire.Command, why: str) -> wire.Ack:
    """The answer to ``cmd`` refused for ``why`` (one of :data:`wire.ACK_REASONS`)."""
    return wire.Ack(h, cmd.id, False, -1, why)


class Sender:
    """Owns the sender thread of one agent and the parts it conducts (module docstring).

    Args:
        endpoint: ZeroMQ endpoint to connect to.
        header: ``seq -> wire.Header`` factory (identity fields plus the given sequence number),
            e.g. :meth:`Identity.header`.
        schema: ``header -> wire.Schema | None``; None until the first probe names the slots.
        heartbeat: ``header -> wire.Heartbeat``.
        queue_size: most pending reports; the oldest is dropped beyond it.
        send_hwm: ZeroMQ send high-water mark, messages.
        heartbeat_s: seconds without a message before a heartbeat goes out.
        schema_every_s: seconds from a (re)connect or a schema change to the first resend; the gap
            doubles after each resend, up to ``SCHEMA_BACKOFF x schema_every_s``.
        world: the job's ranks: past :data:`SCHEMA_RANKS` the jitter is stretched
            (:func:`schema_spread`).
        schema_jitter: each resend comes up to this fraction of its gap later, drawn at random
            (:data:`SCHEMA_JITTER`; >= 0, else ValueError), in a large job this fraction of
            ``min(gap x schema_spread(world), SCHEMA_BACKOFF x schema_every_s)``: the ranks of a
            job start together, and their resends should not reach the aggregator as one wave
            (16,384 schemas at once).
        coalesce_s: seconds the records of unprobed steps gather before going out as one message
            (0: at the sender's next turn).
        watch: ``report -> bool``, called on the sender thread for every step report built, in
            step order; True (an anomaly) sends the batch at once. Default :func:`nonfinite`.
        errors: ``() -> int``, the owner's error count, which its heartbeats report beside the
            sender's own (a change brings a heartbeat forward).
        clock: monotonic clock, seconds (injectable for tests).
        keys: CURVE keys (:class:`gradwatch.auth.ClientKeys`) to authenticate and encrypt with;
            None for plain TCP.
        identity: whom commands must name (:class:`Inbox`); None: every command is dropped
            (reason ``job``).
        control: ``command -> (header -> answer)``, run on the sender thread for each command the
            inbox takes, returning the builder of its answer (a ``wire.Stack`` or ``wire.Ack``);
            None: every command is refused (``why`` "disabled").
    """

    def __init__(
        self,
        endpoint: str,
        header: Callable[[int], wire.Header],
        schema: Callable[[wire.Header], Optional[wire.Schema]],
        heartbeat: Callable[[wire.Header], wire.Heartbeat],
        *,
        queue_size: int = 64,
        send_hwm: int = 256,
        heartbeat_s: float = 1.0,
        schema_every_s: float = 10.0,
        world: int = 1,
        schema_jitter: float = SCHEMA_JITTER,
        coalesce_s: float = 0.25,
        watch: Optional[Callable[[wire.Report], bool]] = None,
        errors: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.monotonic,
        keys=None,
        identity: Optional[Identity] = None,
        control: Optional[Callable[[wire.Command], Build]] = None,
    ):
        self._header = header
        self._schema = schema
        self._heartbeat = heartbeat
        self._watch = watch if watch is not None else nonfinite
        self._owner_errors = errors
        self._control = control
        self._clock = clock
        # the training thread's side: the bounded queue, and the event that wakes the thread
        self._queue: collections.deque[tuple[Build, Ready]] = collections.deque()
        self._queue_size = queue_size
        self._wake_at = max(1, min(16, queue_size // 2))
        self.flush_s = 0.05
        self._wake = threading.Event()
        self._stop = threading.Event()
        # the parts
        self.schema_timer = SchemaTimer(schema_every_s, schema_jitter, world)
        self.pulse = Pulse(heartbeat_s)
        self._batch = Batch(coalesce_s)
        self.backoff = Backoff(heartbeat_s)
        self.inbox = Inbox(identity if identity is not None else Identity("", -2, 1, ""), clock=clock)
        self.link = Link(endpoint, keys, send_hwm, clock)
        # counters
        self.seq = 0
        self.sent = 0  # messages handed to ZeroMQ, and the step records among them
        self.reports = 0
        self.batches = 0  # steps messages handed to ZeroMQ
        self.errors = 0
        # one counter per writing thread: a shared += from two threads can lose counts
        self._queue_drops = 0
        self._send_drops = 0
        self.turns = 0  # sender loop turns (tests bound them)
        self._thread = threading.Thread(target=self._run, name="gradwatch-sender", daemon=True)

    def start(self) -> "Sender":
        """Start the thread; separate from construction so the owner can finish wiring first
        (the thread's first heartbeat reads the owner's counters)."""
        self._thread.start()
        return self

    # --- the parts' state, as the owner and tests read it ---------------------------------------

    @property
    def coalesce_s(self) -> float:
        return self._batch.coalesce_s

    @coalesce_s.setter
    def coalesce_s(self, value: float) -> None:
        self._batch.coalesce_s = value

    @property
    def connected(self) -> bool:
        """A ZMTP handshake with a peer completed at least once."""
        return self.link.connected

    @property
    def refused(self) -> int:
        """Handshakes that failed: refused keys, no CURVE keys, not an aggregator."""
        return self.link.refused

    def refusal(self) -> str:
        return self.link.refusal()

    @property
    def retry_at(self) -> float:
        return self.backoff.retry_at

    @property
    def blocked(self) -> int:
        return self.backoff.blocked

    @property
    def backoff_min_s(self) -> float:
        return self.backoff.min_s

    @property
    def backoff_max_s(self) -> float:
        return self.backoff.max_s

    # --- training thread side: O(1), never blocks ------------------------------------------

    def submit(self, build: Build, ready: Ready = None, urgent: bool = False) -> None:
        """Queue a report builder; drops (and counts) the oldest when the queue is full.

        ``ready``, if given, says whether the builder's data has arrived (a CUDA event's
        ``query``); reports go out in order, and an unready one holds back those after it
        without holding back heartbeats. An unprobed report (``wire.Report`` with ``probe``
        false) joins the batch of steps; any other message goes out as it is, after the batch.
        Only ``urgent`` reports (probes) or a filling queue wake the thread at once; others wait
        for its next turn, at most ``flush_s`` later, so a short step does not pay a thread
        switch (measured: a wake-up per 5 ms step cost ~20% wall)."""
        if len(self._queue) >= self._queue_size:
            try:
                self._queue.popleft()
                self._queue_drops += 1
            except IndexError:
                pass
        self._queue.append((build, ready))
        # wake on crossing the mark, not on every report above it: a sender that cannot send
        # (aggregator away, queue full) must not be woken at every step
        # and not for a probe while backing off: nothing could go out before ``retry_at`` anyway
        if len(self._queue) == self._wake_at or (urgent and self._clock() >= self.backoff.retry_at):
            self._wake.set()

    def request_schema(self) -> None:
        self.schema_timer.demanded = True
        self._wake.set()

    @property
    def drops(self) -> int:
        """Reports dropped so far, each counted once: pushed out of the full queue (the sender could
        not hand them to ZeroMQ in time) or built and refused by ZeroMQ (alone, or in a steps
        message: each of its records). Heartbeats and schemas that could not go out are retried,
        not counted."""
        return self._queue_drops + self._send_drops

    @property
    def pending(self) -> int:
        """Reports neither sent nor dropped: queued, or built and waiting in the batch."""
        return len(self._queue) + len(self._batch)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 1.0) -> None:
        """Flush what is queued and batched without blocking (what ZeroMQ cannot take at once
        stays unsent), send the goodbye, stop the thread, close socket and context."""
        self._stop.set()
        self._wake.set()
        if self._thread.ident is None:  # never started: the thread would have closed these
            self.link.release()
        elif threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # --- sender thread -------------------------------------------------------------------------

    def _build(self, make: Build) -> Optional[wire.Message]:
        """``make``'s message, or None (nothing to send, or it failed: counted in ``errors``)."""
        try:
            return make(self._header(self.seq))
        except Exception as e:
            self.errors += 1
            log.debug("gradwatch: dropped a message that failed to build: %r", e)
            return None

    def _hand(self, msg: Optional[wire.Message]) -> Optional[bool]:
        """Encode ``msg`` and hand it to ZeroMQ without blocking: True when handed over, False
        when ZeroMQ refused it (no peer, high-water mark), None when there was nothing to send or
        it failed to encode (counted in ``errors``). Stamps the sequence number due now."""
        if msg is None:
            return None
        try:
            if msg.header.seq != self.seq:  # built before a message that went out ahead of it
                msg = msgspec.structs.replace(msg, header=msgspec.structs.replace(msg.header, seq=self.seq))
            frame = wire.encode(msg)
        except Exception as e:
            self.errors += 1
            log.debug("gradwatch: dropped a message that failed to encode: %r", e)
            return None
        ok = self.link.send(frame)
        if ok is None:
            self.errors += 1
            return None
        if ok:
            self.seq += 1
            self.sent += 1
            self.pulse.last_sent = self._clock()
        return ok

    def _commands(self) -> None:
        """The aggregator's commands since the last turn (a few at most): each the inbox takes is
        carried out (``control``) and answered at once; what ZeroMQ does not take of the answer
        is lost (the aggregator gives up waiting)."""
        for frame in self.link.receive(COMMANDS_PER_TURN):
            got = self.inbox.take(frame)
            if got is None:
                continue
            cmd, why = got
            if why or self._control is None:
                answer: Build = lambda h, c=cmd, w=why or "disabled": refusal_ack(h, c, w)
            else:
                try:
                    answer = self._control(cmd)
                except Exception as e:  # never expected of the control part: refused, counted
                    self.errors += 1
                    log.debug("gradwatch: a command failed: %r", e)
                    answer = lambda h, c=cmd: refusal_ack(h, c, "other")
            self._hand(self._build(answer))

    def _send_schema(self, now: float) -> Optional[bool]:
        """Send the schema if due (on demand, or the resend timer); False when ZeroMQ refused it
        (it stays due). A resend on demand restarts the resend backoff, a timed one doubles it."""
        timer = self.schema_timer
        if not timer.due(now):
            return None
        on_demand = timer.demanded
        timer.demanded = False  # before building: a change requested meanwhile makes it due again
        ok = self._hand(self._build(self._schema))
        if not ok and on_demand:
            timer.demanded = True  # refused, or no schema yet (no probe ran): still due
        if ok is False:
            return False
        timer.went(now, on_demand, bool(ok))
        return ok

    def _flush(self) -> Optional[bool]:
        """Send the batch as one steps message; its records are dropped (counted) if ZeroMQ
        refuses it or it fails to encode. The result as :meth:`_hand`'s (True with no batch)."""
        if not self._batch:
            return True
        batch = self._batch.take()
        try:
            msg = wire.Steps.of(batch, self._header(self.seq))
            msg = msgspec.structs.replace(msg, drops=self.drops)  # the latest count, not the last record's
        except Exception as e:
            self.errors += 1
            log.debug("gradwatch: dropped a steps message that failed to build: %r", e)
            msg = None
        ok = self._hand(msg)
        if ok:
            self.reports += len(batch)
            self.batches += 1
        else:  # built and lost: each record counted once
            self._send_drops += len(batch)
        return ok

    def _add(self, r: wire.Report, now: float, alarm: bool) -> Optional[bool]:
        """Put an unprobed report in the batch (after sending the batch if ``r`` cannot join it);
        send the batch at once after an anomaly (``alarm``) or when full. False: refused."""
        if not self._batch.joins(r) and self._flush() is False:
            self._send_drops += 1
            return False
        if self._batch.add(r, now) or alarm:
            return self._flush()
        return True

    def _alarm(self, msg: wire.Report) -> bool:
        try:
            return bool(self._watch(msg))
        except Exception as e:  # the record itself is fine: it still goes out
            self.errors += 1
            log.debug("gradwatch: watching a report failed: %r", e)
            return False

    def _errors(self) -> int:
        try:
            return self._owner_errors() + self.errors
        except Exception:
            return self.errors

    def _work(self, now: float, stopping: bool) -> bool:
        """One turn's sending; returns whether an unready report holds back the queue."""
        if not self.link.writable():
            self.backoff.refused(now)
            return False
        if self._send_schema(now) is False:
            self.backoff.refused(now)
            return False
        waiting = False
        while self._queue:
            try:
                build, ready = self._queue[0]
            except IndexError:
                break
            if ready is not None and not ready():  # holds back later reports, not heartbeats
                waiting = True
                break
            # a report never overtakes the schema it names (request_schema() may come any time)
            if self.schema_timer.demanded and self._send_schema(now) is False:
                self.backoff.refused(now)
                return False
            try:
                self._queue.popleft()
            except IndexError:
                break
            msg = self._build(build)
            if msg is None:
                continue
            alarm = isinstance(msg, wire.Report) and self._alarm(msg)
            if isinstance(msg, wire.Report) and not msg.probe:
                ok = self._add(msg, now, alarm)
            else:  # a probe travels with its step: after the steps before it, in its own message
                ok = self._flush()
                if ok is False:
                    self._send_drops += 1  # refused before its turn came: lost with the batch
                else:
                    ok = self._hand(msg)
                    if ok:
                        self.reports += 1
                    elif ok is False:  # built but refused: this report is lost, counted once
                        self._send_drops += 1
            if ok is False:
                self.backoff.refused(now)
                return False
        if self._batch and (stopping or self._batch.due(now)):
            if self._flush() is False:
                self.backoff.refused(now)
                return False
        if stopping or self.pulse.is_due(now, self._errors):
            errors = self._errors()
            if self._hand(self._build(self._heartbeat)) is False:
                self.backoff.refused(now)
                return False
            self.pulse.went(now, errors)
        self.backoff.reset()
        return waiting

    def _next_turn(self, now: float, waiting: bool) -> float:
        """Seconds until the next timer (heartbeat, schema, the batch's age) or ``flush_s``."""
        due = min(self.pulse.quiet_until, self.schema_timer.next, self._batch.due_at)
        return min(due - now, 0.002 if waiting else self.flush_s)

    def _run(self) -> None:
        self.schema_timer.next = self._clock()
        try:
            while True:
                self.turns += 1
                stopping = self._stop.is_set()
                now = self._clock()
                if self.link.events():  # a (new) aggregator: schema and heartbeat at once
                    self.schema_timer.demanded = self.pulse.due = True
                    self.backoff.reset(now)
                if not stopping:
                    self._commands()
                waiting = self._work(now, stopping) if stopping or now >= self.backoff.retry_at else False
                if stopping:
                    return
                now = self._clock()
                if now < self.backoff.retry_at:  # blocked: nothing can go out before then
                    timeout = self.backoff.retry_at - now
                else:  # a turn every flush_s at least: reports that did not wake the thread wait no longer
                    timeout = self._next_turn(now, waiting)
                # never a zero wait: a turn that could not send does not come round at once
                self._wake.wait(max(timeout, 0.001))
                self._wake.clear()
        except Exception as e:  # never expected; keep the process healthy regardless
            self.errors += 1
            log.warning("gradwatch: sender thread stopped: %r", e)
        finally:
            self.link.close()
