"""The sender: a background thread that finalises, encodes and pushes messages over ZeroMQ.

The training thread only appends to a bounded deque (drop-oldest, counted) and sets an event; it
never touches the socket, never waits and never sees an exception from here. The thread:

* connects a PUSH socket (never binds: a bound PUSH blocks without peers, case C24) with
  ``LINGER 0`` so process exit never waits on unsent data (case C26), ``IMMEDIATE`` so nothing is
  queued to an aggregator that is not connected, and sends with ``NOBLOCK`` (case C25);
* never spins, whatever the aggregator does (issue 9): it builds a message only when ZeroMQ can
  take it (``POLLOUT``); when it cannot, reports wait in the bounded queue (the oldest dropped and
  counted once) and the next attempt comes after a backoff doubling from 10 ms to
  ``max(1 s, heartbeat_s)`` (10 s at most), reset by a (re)connection or a send. A report that was
  built and refused is counted as dropped once; schemas and heartbeats are retried, not counted.
  ZMTP heartbeats drop a silent peer after 3 s (partition, stopped aggregator) and reconnection
  backs off from 0.1 s to 1 s, so reports flow again within ~2 s of the aggregator's return;
* stamps a per-rank sequence number on each message actually handed to ZeroMQ, so the
  aggregator can count messages lost in flight (case C28);
* sends a heartbeat every ``heartbeat_s`` and the schema every ``schema_every_s``, on demand,
  and whenever the connection (re)establishes (socket monitor ``EVENT_CONNECTED``), so a late or
  restarted aggregator learns the schema (case C24);
* survives any failure of one message: it is dropped and counted in ``errors`` (case C32).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional

import zmq
import zmq.utils.monitor

from gradwatch import auth, wire

log = logging.getLogger("gradwatch.agent")

Build = Callable[[wire.Header], Optional[wire.Message]]
Ready = Optional[Callable[[], bool]]


class Sender:
    """Owns the socket and the sender thread of one agent.

    Args:
        endpoint: ZeroMQ endpoint to connect to.
        header: ``seq -> wire.Header`` factory (identity fields plus the given sequence number).
        schema: ``header -> wire.Schema | None``; None until the first probe names the slots.
        heartbeat: ``header -> wire.Heartbeat``.
        queue_size: most pending reports; the oldest is dropped beyond it.
        send_hwm: ZeroMQ send high-water mark, messages.
        heartbeat_s, schema_every_s: periods, seconds.
        clock: monotonic clock, seconds (injectable for tests).
        keys: CURVE keys (:class:`gradwatch.auth.ClientKeys`) to authenticate and encrypt with;
            None for plain TCP.
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
        clock: Callable[[], float] = time.monotonic,
        keys=None,
    ):
        self._header = header
        self._schema = schema
        self._heartbeat = heartbeat
        self._queue: collections.deque[tuple[Build, Ready]] = collections.deque()
        self._queue_size = queue_size
        self._wake_at = max(1, min(16, queue_size // 2))
        self.flush_s = 0.05
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._schema_due = True
        self._clock = clock
        self._heartbeat_s = heartbeat_s
        self._schema_every_s = schema_every_s
        self.seq = 0
        self.sent = 0  # messages handed to ZeroMQ, and the reports among them
        self.reports = 0
        self.connected = False  # the socket reached a peer at least once
        self.errors = 0
        # one counter per writing thread: a shared += from two threads can lose counts
        self._queue_drops = 0
        self._send_drops = 0
        # backoff while ZeroMQ takes nothing (no aggregator, partition, high-water mark)
        # short first retries: a fresh socket is refused until its connection completes (~1 ms
        # on a LAN), and reports of fast steps wait in the bounded queue meanwhile
        self.backoff_min_s = 0.01
        self.backoff_max_s = min(10.0, max(1.0, heartbeat_s))
        self._backoff = self.backoff_min_s
        self.retry_at = 0.0  # monotonic time of the next attempt after a refusal
        self._next_beat = self._next_schema = 0.0
        self.turns = 0  # sender loop turns (tests bound them)
        self.blocked = 0  # attempts that found ZeroMQ refusing
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, send_hwm)
        if keys is not None:
            keys.apply(self._sock)  # CURVE client: before connect
        # queue only to a connected aggregator: a restarted one must not first get stale reports
        # queued during the outage, ahead of the schema resent on connect
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)  # ms, exponential in between
        self._sock.setsockopt(zmq.CONNECT_TIMEOUT, 2000)  # a SYN into a partition is given up
        # ZMTP heartbeats: a peer silent for 3 s (partition, SIGSTOP) is dropped and reconnected,
        # instead of waiting out TCP's retransmission backoff after the network heals
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        # connections, and with CURVE the handshakes the aggregator refuses (said once, counted)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | (auth.REFUSED_EVENTS if keys is not None else 0))
        self._endpoint = endpoint
        self.refused = 0  # CURVE handshakes the aggregator refused
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, name="gradwatch-sender", daemon=True)

    def start(self) -> "Sender":
        """Start the thread; separate from construction so the owner can finish wiring first
        (the thread's first heartbeat reads the owner's counters)."""
        self._thread.start()
        return self

    # --- training thread side: O(1), never blocks ------------------------------------------

    def submit(self, build: Build, ready: Ready = None, urgent: bool = False) -> None:
        """Queue a report builder; drops (and counts) the oldest when the queue is full.

        ``ready``, if given, says whether the builder's data has arrived (a CUDA event's
        ``query``); reports go out in order, and an unready one holds back those after it
        without holding back heartbeats. Only ``urgent`` reports (probes) or a filling queue wake
        the thread at once; others wait for its next turn, at most ``flush_s`` later, so a short
        step does not pay a thread switch (measured: a wake-up per 5 ms step cost ~20% wall)."""
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
        if len(self._queue) == self._wake_at or (urgent and self._clock() >= self.retry_at):
            self._wake.set()

    def request_schema(self) -> None:
        self._schema_due = True
        self._wake.set()

    @property
    def drops(self) -> int:
        """Reports dropped so far, each counted once: pushed out of the full queue (the sender could
        not hand them to ZeroMQ in time) or built and refused by ZeroMQ. Heartbeats and schemas
        that could not go out are retried, not counted."""
        return self._queue_drops + self._send_drops

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 1.0) -> None:
        """Flush what is queued without blocking, stop the thread, close socket and context."""
        self._stop.set()
        self._wake.set()
        if self._thread.ident is None:  # never started: the thread would have closed these
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._ctx.term()
        elif threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # --- sender thread -------------------------------------------------------------------------

    def _writable(self) -> bool:
        """Whether ZeroMQ takes a message now: a connected peer (``IMMEDIATE``) and room below the
        high-water mark. One getsockopt: nothing is built to find out."""
        try:
            return bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT)
        except zmq.ZMQError:
            return False

    def _send(self, make: Build) -> Optional[bool]:
        """Build, encode and hand one message to ZeroMQ without blocking: True when handed over,
        False when ZeroMQ refused it (no peer, high-water mark), None when there was nothing to
        send or it failed to build (counted in ``errors``)."""
        try:
            msg = make(self._header(self.seq))
            if msg is None:
                return None
            frame = wire.encode(msg)
        except Exception as e:
            self.errors += 1
            log.debug("gradwatch: dropped a message that failed to build: %r", e)
            return None
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            self.errors += 1
            log.debug("gradwatch: send failed: %r", e)
            return None
        self.seq += 1
        self.sent += 1
        return True

    def _reconnected(self) -> bool:
        """Whether the socket (re)connected since the last turn; counts refused CURVE handshakes
        in ``refused`` and warns at the first one (nothing this agent sends would arrive)."""
        seen = False
        while self._monitor.poll(0):
            try:
                event = zmq.utils.monitor.parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except (zmq.ZMQError, ValueError, KeyError):
                break
            if event == zmq.EVENT_CONNECTED:
                seen = self.connected = True
            elif event & auth.REFUSED_EVENTS:
                self.refused += 1
                if self.refused == 1:
                    log.warning(
                        "gradwatch: the aggregator at %s refused this agent's CURVE handshake: no report "
                        "reaches it (is GRADWATCH_SERVER_KEY the aggregator's public key, and this agent's "
                        "client key among its --client-keys?)", self._endpoint)
        return seen

    def _blocked(self, now: float) -> None:
        """ZeroMQ takes nothing now: no attempt before ``now + backoff``; the backoff doubles from
        ``backoff_min_s`` up to ``backoff_max_s``. Reports wait in the queue meanwhile."""
        self.retry_at = now + self._backoff
        self._backoff = min(self._backoff * 2, self.backoff_max_s)
        self.blocked += 1

    def _schema_first(self) -> Optional[bool]:
        """Send a due schema; False when ZeroMQ refused it (it stays due)."""
        ok = self._send(self._schema)
        if ok:
            self._schema_due = False
        return ok

    def _work(self, now: float, stopping: bool) -> bool:
        """One turn's sending; returns whether an unready report holds back the queue."""
        if not self._writable():
            self._blocked(now)
            return False
        if self._schema_due or now >= self._next_schema:
            if self._schema_first() is False:
                self._blocked(now)
                return False
            # sent, or no schema yet (no probe ran): request_schema() makes it due again
            self._next_schema = now + self._schema_every_s
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
            if self._schema_due and self._schema_first() is False:
                self._blocked(now)
                return False
            try:
                self._queue.popleft()
            except IndexError:
                break
            ok = self._send(build)
            if ok:
                self.reports += 1
            elif ok is False:  # built but refused: this report is lost, counted once
                self._send_drops += 1
                self._blocked(now)
                return False
        if now >= self._next_beat or stopping:
            if self._send(self._heartbeat) is False:
                self._blocked(now)
                return False
            self._next_beat = now + self._heartbeat_s
        self._backoff = self.backoff_min_s
        return waiting

    def _run(self) -> None:
        self._next_beat = self._next_schema = self._clock()
        try:
            while True:
                self.turns += 1
                stopping = self._stop.is_set()
                now = self._clock()
                if self._reconnected():  # a (new) aggregator: schema and heartbeat at once
                    self._schema_due = True
                    self._next_beat = now
                    self._backoff = self.backoff_min_s
                    self.retry_at = now
                waiting = self._work(now, stopping) if stopping or now >= self.retry_at else False
                if stopping:
                    return
                now = self._clock()
                if now < self.retry_at:  # blocked: nothing can go out before then
                    timeout = self.retry_at - now
                else:  # a turn every flush_s at least: reports that did not wake the thread wait no longer
                    timeout = min(self._next_beat - now, self._next_schema - now, 0.002 if waiting else self.flush_s)
                # never a zero wait: a turn that could not send does not come round at once
                self._wake.wait(max(timeout, 0.001))
                self._wake.clear()
        except Exception as e:  # never expected; keep the process healthy regardless
            self.errors += 1
            log.warning("gradwatch: sender thread stopped: %r", e)
        finally:
            try:
                self._sock.disable_monitor()
            except Exception:
                pass
            for s in (self._monitor, self._sock):
                try:
                    s.close(linger=0)
                except Exception:
                    pass
            try:
                self._ctx.term()
            except Exception:
                pass
