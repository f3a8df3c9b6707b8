"""The sender: a background thread that finalises, encodes and pushes messages over ZeroMQ.

The training thread only appends to a bounded deque (drop-oldest, counted) and sets an event; it
never touches the socket, never waits and never sees an exception from here. The thread:

* connects a PUSH socket (never binds: a bound PUSH blocks without peers, case C24) with
  ``LINGER 0`` so process exit never waits on unsent data (case C26), and sends with ``NOBLOCK``:
  a full ZeroMQ queue drops the message and counts it (case C25);
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

from gradwatch import wire

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
        self.sent = 0
        self.connected = False  # the socket reached a peer at least once
        self.errors = 0
        # one counter per writing thread: a shared += from two threads can lose counts
        self._queue_drops = 0
        self._send_drops = 0
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, send_hwm)
        if keys is not None:
            keys.apply(self._sock)  # CURVE client: before connect
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED)
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
        if urgent or len(self._queue) >= self._wake_at:
            self._wake.set()

    def request_schema(self) -> None:
        self._schema_due = True
        self._wake.set()

    @property
    def drops(self) -> int:
        """Messages dropped so far: queue overflow plus ZeroMQ high-water mark."""
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

    def _send(self, make: Build) -> bool:
        try:
            msg = make(self._header(self.seq))
            if msg is None:
                return False
            frame = wire.encode(msg)
        except Exception as e:
            self.errors += 1
            log.debug("gradwatch: dropped a message that failed to build: %r", e)
            return False
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self._send_drops += 1
            return False
        except zmq.ZMQError as e:
            self.errors += 1
            log.debug("gradwatch: send failed: %r", e)
            return False
        self.seq += 1
        self.sent += 1
        return True

    def _reconnected(self) -> bool:
        seen = False
        while self._monitor.poll(0):
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
                seen = self.connected = True
            except zmq.ZMQError:
                break
        return seen

    def _run(self) -> None:
        now = self._clock()
        next_beat = now
        next_schema = now
        try:
            while True:
                stopping = self._stop.is_set()
                now = self._clock()
                if self._reconnected():
                    self._schema_due = True
                if self._schema_due or now >= next_schema:
                    if self._send(self._schema):
                        self._schema_due = False
                        next_schema = now + self._schema_every_s
                    elif self._schema(self._header(self.seq)) is None:
                        next_schema = now + self._schema_every_s  # nothing to say yet
                waiting = False
                while self._queue:
                    try:
                        build, ready = self._queue[0]
                    except IndexError:
                        break
                    if ready is not None and not ready():
                        waiting = True
                        break
                    if self._schema_due and self._send(self._schema):
                        self._schema_due = False  # a report never overtakes the schema it names
                        next_schema = now + self._schema_every_s
                    try:
                        self._queue.popleft()
                    except IndexError:
                        break
                    self._send(build)
                if now >= next_beat or stopping:
                    self._send(self._heartbeat)
                    next_beat = now + self._heartbeat_s
                if stopping:
                    return
                timeout = max(0.0, min(next_beat, next_schema) - self._clock())
                # a turn every flush_s at least: reports that did not wake the thread wait no longer
                self._wake.wait(min(timeout, 0.002 if waiting else self.flush_s))
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
