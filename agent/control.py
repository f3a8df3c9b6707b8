"""What the aggregator's commands do in an agent, on the sender thread (:mod:`.transport` takes
them, checks them and sends the answers).

* ``stacks``: the training thread's Python stack, taken by the sender thread from
  ``sys._current_frames()`` (no signal into the training thread: a thread blocked in a collective,
  a data loader, a sleep or a lock has released the interpreter lock, so the sender thread runs);
  file, line and function of each frame, the innermost :data:`gradwatch.wire.MAX_FRAMES` kept,
  source lines only with the ``stack_source`` setting; with torch's Flight Recorder enabled
  (``TORCH_FR_BUFFER_SIZE``, or ``TORCH_NCCL_TRACE_BUFFER_SIZE``), its latest entries. Where the
  training thread holds the interpreter lock in native code, the sender thread cannot run and no
  answer comes: the aggregator says so.
* ``probe``: a probe window (:meth:`.schedule.ProbeSchedule.window`), acked with its first step.
* ``budget``: the budget replaced for a while (:meth:`.schedule.ProbeSchedule.override`).
* ``halt``: only in an agent attached with ``on_critical="halt"`` and the check among its
  ``halt_on``: the step is kept (:class:`HaltAt`) and the optimizer's step pre-hook raises
  :class:`gradwatch.Halt` at the first step at or after it (:mod:`.monitor`); refused ("disabled")
  otherwise.

Nothing here raises into training: a command that fails is refused and counted.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import msgspec

from gradwatch import wire

log = logging.getLogger("gradwatch.agent")

#: most characters of a frame's file (its tail is kept), function and source line
FILE_CHARS, FUNCTION_CHARS, SOURCE_CHARS = 512, 256, 256


@dataclass
class Training:
    """Where the training thread is, as the monitor writes it (training thread) and the control
    part reads it (sender thread).

    Attributes:
        ident: ``threading.get_ident()`` of the thread that stepped the optimizer last (the key of
            ``sys._current_frames()``), the thread that attached until then.
        step: the step the training thread takes next (as the agent numbers them).
        step_end: ``time.perf_counter()`` at the latest step's end.
        waiting: ``() -> bool``, whether the training thread waits on its peers in all-reduce now
            (the heartbeats' ``waiting``).
    """

    ident: int = field(default_factory=threading.get_ident)
    step: int = 0
    step_end: float = field(default_factory=time.perf_counter)
    waiting: Callable[[], bool] = lambda: False


@dataclass
class HaltAt:
    """The halt the aggregator asked for: the sender thread sets it, the optimizer's step
    pre-hook reads it (``step`` -1: none)."""

    step: int = -1
    check: str = ""
    summary: str = ""

    def set(self, step: int, check: str, summary: str) -> None:
        # one assignment the training thread reads: the step last, after what goes with it
        self.check, self.summary = check, summary
        self.step = step if self.step < 0 else min(self.step, step)


def _cut(text: str, most: int, tail: bool = False) -> str:
    if len(text) <= most:
        return text
    return "..." + text[-(most - 3):] if tail else text[: most - 3] + "..."


def frames(frame, source: bool) -> tuple[wire.Frame, ...]:
    """The stack from ``frame`` (a thread's innermost) outwards, as wire frames outermost first,
    innermost last, the innermost :data:`wire.MAX_FRAMES` kept; source lines only with ``source``."""
    summary = traceback.StackSummary.extract(traceback.walk_stack(frame), limit=wire.MAX_FRAMES, lookup_lines=False)
    out = []
    for f in reversed(summary):
        line = (f.line or "").strip() if source else ""
        out.append(wire.Frame(_cut(f.filename, FILE_CHARS, tail=True), max(int(f.lineno or 0), 0),
                              _cut(f.name, FUNCTION_CHARS), _cut(line, SOURCE_CHARS)))
    return tuple(out)


def flight_recorder() -> tuple[tuple[wire.FlightEntry, ...], str]:
    """torch's Flight Recorder's latest entries (:data:`wire.MAX_FLIGHT`, oldest first) and ""; or
    () and why not ("" when it is not enabled). Never raises."""
    size = os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0"))
    try:
        if int(size) <= 0:
            return (), ""
    except ValueError:
        return (), ""
    try:
        torch = sys.modules.get("torch")
        if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return (), ""
        dump = torch._C._distributed_c10d._dump_fr_trace_json(True, False)
        entries = json.loads(dump).get("entries", [])[-wire.MAX_FLIGHT:]
        return tuple(wire.FlightEntry(_cut(str(e.get("profiling_name", "")), 128), _cut(str(e.get("state", "")), 32),
                                      _cut(str(e.get("collective_seq_id", "")), 32)) for e in entries), ""
    except Exception as e:
        return (), _cut(f"the Flight Recorder could not be read: {e!r}", 256)


class Control:
    """Carries out the commands the sender's inbox takes (module docstring); the sender thread's.

    Args:
        training: where the training thread is.
        schedule: the probe schedule (:class:`.schedule.ProbeSchedule`) probe and budget change.
        halt: where a halt is kept for the step pre-hook.
        stack_source: the ``stack_source`` setting: source lines go with a stack asked with them.
        halt_on: the checks a halt may name (the ``halt_on`` setting), None when
            ``on_critical`` is off.

    Attributes:
        done: ``Counter`` of the commands carried out, by kind, and refused (``refused``).
    """

    def __init__(self, training: Training, schedule, halt: HaltAt, stack_source: bool = False,
                 halt_on: Optional[tuple[str, ...]] = None):
        self.training, self.schedule, self.halt = training, schedule, halt
        self.stack_source = stack_source
        self.halt_on = halt_on
        self.done: collections.Counter = collections.Counter()

    def __call__(self, cmd: wire.Command):
        """``cmd`` carried out now; returns the builder (``header -> message``) of its answer."""
        kind = cmd.action
        try:
            answer = getattr(self, f"_{kind}")(cmd.args)
        except Exception as e:  # a part that fails refuses the command; training never sees it
            log.debug("gradwatch: a %s command failed: %r", kind, e)
            answer = -1, "other"
        if isinstance(answer, wire.Stack):
            self.done[kind] += 1
            return lambda h, s=answer: msgspec.structs.replace(s, header=h, command=cmd.id)
        step, refusal = answer
        self.done[kind if not refusal else "refused"] += 1
        return lambda h: wire.Ack(h, cmd.id, not refusal, step if not refusal else -1, refusal)

    def _stacks(self, args: wire.StacksArgs) -> wire.Stack:
        t = self.training
        frame = sys._current_frames().get(t.ident)
        fr, fr_error = flight_recorder()
        in_step = time.perf_counter() - t.step_end
        if frame is None:
            return wire.Stack(_NO_HEADER, 0, (), in_step, bool(t.waiting()), fr, fr_error, "the training thread is gone")
        try:
            got = frames(frame, args.source and self.stack_source)
        finally:
            del frame
        return wire.Stack(_NO_HEADER, 0, got, in_step, bool(t.waiting()), fr, fr_error)

    def _probe(self, args: wire.ProbeArgs) -> tuple[int, str]:
        first = self.schedule.window(args.start, args.steps, args.layers)
        return (first, "") if first is not None else (-1, "passed")

    def _budget(self, args: wire.BudgetArgs) -> tuple[int, str]:
        step = self.schedule.override(args.budget, args.for_s)
        return (step, "") if step is not None else (-1, "disabled")

    def _halt(self, args: wire.HaltArgs) -> tuple[int, str]:
        if self.halt_on is None or args.check not in self.halt_on:
            return -1, "disabled"
        self.halt.set(args.step, args.check, args.summary)
        return max(self.halt.step, self.training.step), ""


_NO_HEADER = wire.Header("-", 0, 1, "", 0, 0.0)  # replaced by the sender's header when it goes out

