"""Fault injection for the demo and the tests: ``KIND@STEP[:key=value...]``. Never used by the agent.

Kinds (``rank`` defaults to the last rank, ``all`` for ``dead`` and ``vanish``; a fault acts on
that one rank only, or on every rank with ``rank=all``):

    explode    multiply the loss by ``scale`` (default 1e6) at STEP: a gradient spike
    nan        replace the output of module ``layer`` (default ``blocks.0.mlp.fc``) with NaN at STEP
               (``pass=backward``: the gradient arriving at that output instead)
    desync     add ``scale`` (default 1e-3) to the gradient of parameter ``param`` (default
               ``head.weight``) after all-reduce, before the optimizer step, at STEP
    drift      flip mantissa bit ``bit`` (default 10 of 0-22: a relative change near 1e-4) of the
               first element of ``param`` after the optimizer step at STEP: the replicas differ from
               then on (flipping bit 0 can heal itself: later updates may round both replicas to
               the same float)
    straggler  sleep ``seconds`` (default 0.2) before every forward pass from STEP on; with
               ``factor=F`` instead F times the median of the rank's own step times before STEP
               (factor=0.3: 30 % slower); with ``before=step`` between backward and the optimizer
               step instead (a rank slow in its gradient clipping, logging or optimizer)
    hang       stop the training thread for ``seconds`` (default 60) at STEP; the agent's
               sender thread keeps running, as it would in a rank stuck in a collective or a
               dead data loader; before the forward pass, or with ``before=step`` between
               backward and the optimizer step
    silent     stop the whole rank process (SIGSTOP to itself) at STEP for ``seconds`` (default
               30, > 0): nothing is sent any more, as from a frozen host or a lost network; then
               a process it started before stopping resumes it (SIGCONT), and the job goes on
    dead       fill the bias of module ``layer`` (default ``blocks.0.mlp.fc``) with ``scale``
               (default -1e3) after the optimizer step at STEP: the units of the activation
               after it (the demo's GELU) stop firing and, without gradient, stay dead. On every
               rank unless ``rank=`` says otherwise (on one rank it is a drifted replica)
    vanish     multiply the loss by ``scale`` (default 1e-12) from STEP on: gradients vanish.
               On every rank unless ``rank=`` says otherwise (on one rank all-reduce averages
               it away)
    shard      replace the rank's input batch with noise from STEP on (random values of the same
               dtype and range): a bad data shard

Example: ``gradwatch demo --inject nan@40:rank=1 --inject straggler@100``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

KINDS = ("explode", "nan", "desync", "drift", "straggler", "hang", "silent", "dead", "vanish", "shard")
_DEFAULTS = {
    "explode": {"scale": "1e6"},
    "nan": {"layer": "blocks.0.mlp.fc", "pass": "forward"},
    "desync": {"scale": "1e-3", "param": "head.weight"},
    "drift": {"param": "head.weight", "bit": "10"},
    "straggler": {"seconds": "0.2", "before": "forward"},
    "hang": {"seconds": "60", "before": "forward"},
    "silent": {"seconds": "30"},
    "dead": {"layer": "blocks.0.mlp.fc", "scale": "-1e3", "rank": "all"},  # job-wide faults
    "vanish": {"scale": "1e-12", "rank": "all"},
    "shard": {},
}
_KEYS = {"rank", "scale", "layer", "param", "seconds", "bit", "factor", "pass", "before"}
_NUMBERS = {"scale": float, "seconds": float, "factor": float, "bit": int}  # options read as numbers
ALL = -1  # Fault.rank of a fault on every rank


def kinds_help() -> str:
    """The kinds with their default options, for ``--help``: ``explode (scale=1e6), ...``."""
    return ", ".join(k + (f" ({', '.join(f'{o}={v}' for o, v in _DEFAULTS[k].items())})" if _DEFAULTS[k] else "")
                     for k in KINDS)


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int
    options: dict = field(default_factory=dict)


def parse(spec: str, world_size: int) -> Fault:
    """Parse ``KIND@STEP[:key=value...]``.

    Raises:
        ValueError: naming the part of ``spec`` that is wrong.
    """
    head, *opts = spec.split(":")
    kind, at, step = head.partition("@")
    if kind not in KINDS or not at:
        raise ValueError(f"inject {spec!r}: expected KIND@STEP with KIND one of {', '.join(KINDS)}")
    try:
        step_i = int(step)
    except ValueError:
        raise ValueError(f"inject {spec!r}: STEP must be an integer, got {step!r}") from None
    options = dict(_DEFAULTS[kind])
    for o in opts:
        k, eq, v = o.partition("=")
        if not eq or k not in _KEYS:
            raise ValueError(f"inject {spec!r}: unknown option {o!r} (known: {', '.join(sorted(_KEYS))})")
        options[k] = v
    if options.get("pass", "forward") not in ("forward", "backward"):
        raise ValueError(f"inject {spec!r}: pass must be forward or backward")
    if "before" in options and kind not in ("straggler", "hang"):
        raise ValueError(f"inject {spec!r}: before applies to straggler and hang only")
    if options.get("before", "forward") not in ("forward", "step"):
        raise ValueError(f"inject {spec!r}: before must be forward or step")
    for k, kind_of in _NUMBERS.items():
        if k in options:
            try:
                kind_of(options[k])
            except ValueError:
                raise ValueError(f"inject {spec!r}: {k} must be {'an integer' if kind_of is int else 'a number'}, "
                                 f"got {options[k]!r}") from None
    for k in ("seconds", "factor"):  # time.sleep takes no negative, NaN or infinite length
        if k in options and not 0 <= float(options[k]) < math.inf:
            raise ValueError(f"inject {spec!r}: {k} must be a finite number >= 0, got {options[k]!r}")
    if kind == "silent" and not float(options["seconds"]) > 0:
        raise ValueError(f"inject {spec!r}: seconds must be > 0 (the rank stops that long), got {options['seconds']!r}")
    if "bit" in options and not 0 <= int(options["bit"]) < 32:  # a bit of a float32's int32 view
        raise ValueError(f"inject {spec!r}: bit must be in [0, 32), got {options['bit']!r}")
    rank_s = options.pop("rank", str(world_size - 1))
    if rank_s == "all":
        return Fault(kind, step_i, ALL, options)
    try:
        rank = int(rank_s)
    except ValueError:
        raise ValueError(f"inject {spec!r}: rank must be an integer or 'all', got {rank_s!r}") from None
    if not 0 <= rank < world_size:
        raise ValueError(f"inject {spec!r}: rank must be in [0, {world_size}), got {rank}")
    return Fault(kind, step_i, rank, options)


def check(fault: Fault, spec: str, modules: dict, params: dict, steps: int) -> None:
    """What :func:`parse` cannot see without the model and the run: the module and parameter a
    fault names exist (``modules``, ``params``: the model's named modules and parameters), and its
    step comes within ``steps``.

    Raises:
        ValueError: naming what is wrong (it would fail in a spawned rank, or never fire).
    """
    if not 0 <= fault.step < steps:
        raise ValueError(f"inject {spec!r}: STEP must be in [0, {steps}) (--steps {steps}): it would never fire")
    layer, param = fault.options.get("layer"), fault.options.get("param")
    if layer is not None and layer not in modules:
        raise ValueError(f"inject {spec!r}: no module {layer!r} (e.g. {', '.join(list(modules)[1:4])})")
    if fault.kind == "dead" and getattr(modules[layer], "bias", None) is None:
        raise ValueError(f"inject {spec!r}: module {layer!r} has no bias to fill")
    if param is not None and param not in params:
        raise ValueError(f"inject {spec!r}: no parameter {param!r} (e.g. {', '.join(list(params)[:3])})")


class Injector:
    """Applies the faults meant for one rank at the training loop's points (:meth:`batch`,
    :meth:`before_forward`, :meth:`loss`, :meth:`after_backward`, :meth:`after_step`).

    ``applied``: ``{kind: time.time() when first applied}``, for measuring time to detection.
    """

    def __init__(self, faults: list[Fault], rank: int):
        self.faults = [f for f in faults if f.rank in (rank, ALL)]
        self._handles = []
        self.applied: dict[str, float] = {}
        self._last = None  # time.perf_counter() at the previous before_forward
        self._step_times: list[float] = []  # the rank's own step times, for straggler factors

    def _mark(self, f: Fault) -> None:
        self.applied.setdefault(f.kind, time.time())

    def batch(self, step: int, x, y):
        """The rank's input batch, replaced by noise under a ``shard`` fault."""
        import torch

        for f in self.faults:
            if f.kind == "shard" and step >= f.step:
                self._mark(f)
                g = torch.Generator().manual_seed(step)
                if x.is_floating_point():
                    x = torch.randn(x.shape, generator=g, dtype=x.dtype) * (x.std() + 1) * 3
                else:
                    x = torch.randint(0, int(x.max()) + 1, x.shape, generator=g, dtype=x.dtype)
        return x, y

    def before_forward(self, step: int, model) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self._step_times.append(now - self._last)
        self._last = now
        for f in self.faults:
            if f.kind == "straggler" and step >= f.step and self._before(f, "forward"):
                self._straggle(f)
                self._last = time.perf_counter()  # the sleep is not the rank's own step time
            elif f.kind == "hang" and step == f.step and self._before(f, "forward"):
                self._hang(f)
            elif f.kind == "silent" and step == f.step:
                import os
                import signal

                import subprocess

                self._mark(f)
                # a stopped process cannot wake itself (its threads stop with it): a shell outside
                # it, detached (no zombie child of the rank), waits for the stop, then sends SIGCONT
                # only if the rank is still stopped (a user's SIGCONT came first; it is gone)
                pid, stopped = os.getpid(), "grep -q '^State:[[:space:]]*T' /proc/$p/status 2>/dev/null"
                waker = (f"p={pid}; until {stopped}; do [ -e /proc/$p ] || exit 0; sleep 0.01; done; "
                         f"sleep {float(f.options['seconds'])}; if {stopped}; then kill -CONT $p; fi")
                subprocess.run(["sh", "-c", f"({waker}) </dev/null >/dev/null 2>&1 &"], start_new_session=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
                os.kill(pid, signal.SIGSTOP)
            elif f.kind == "nan" and step == f.step:
                self._mark(f)
                module = dict(model.named_modules())[f.options["layer"]]
                if f.options["pass"] == "backward":
                    def poison(m, a, out):
                        out.register_hook(lambda g: g * float("nan"))  # the gradient arriving here

                    # prepend: this tensor hook runs before the agent's, which sees the NaN
                    self._handles.append(module.register_forward_hook(poison, prepend=True))
                else:
                    # prepend: the module itself yields NaN, so every observer (the agent's probe
                    # hooks, registered earlier) sees it, as it would a NaN made inside its forward
                    self._handles.append(
                        module.register_forward_hook(lambda m, a, out: out * float("nan"), prepend=True)
                    )

    @staticmethod
    def _before(f: Fault, point: str) -> bool:
        """A straggler or hang acts before this point of the step: ``forward`` or ``step``."""
        return f.options.get("before", "forward") == point

    def _hang(self, f: Fault) -> None:
        self._mark(f)
        time.sleep(float(f.options["seconds"]))

    def _straggle(self, f: Fault) -> None:
        self._mark(f)
        if "factor" in f.options:
            times = sorted(self._step_times[: f.step - 1])  # the steps before STEP
            time.sleep(float(f.options["factor"]) * (times[len(times) // 2] if times else 0.0))
        else:
            time.sleep(float(f.options["seconds"]))

    def loss(self, step: int, loss):
        for f in self.faults:
            if f.kind == "explode" and step == f.step:
                self._mark(f)
                loss = loss * float(f.options["scale"])
            elif f.kind == "vanish" and step >= f.step:
                self._mark(f)
                loss = loss * float(f.options["scale"])
        for h in self._handles:  # a nan fault lasts one forward pass
            h.remove()
        self._handles = []
        return loss

    def after_backward(self, step: int, model) -> None:
        import torch

        for f in self.faults:
            if f.kind == "straggler" and step >= f.step and self._before(f, "step"):
                self._straggle(f)
            elif f.kind == "hang" and step == f.step and self._before(f, "step"):
                self._hang(f)
            if f.kind == "desync" and step == f.step:
                self._mark(f)
                with torch.no_grad():
                    dict(model.named_parameters())[f.options["param"]].grad.add_(float(f.options["scale"]))

    def train_step(self, step: int, model, ddp, opt, x, y, loss_of, monitor, clip: float = 0.0):
        """One optimizer step of ``ddp`` on batch ``(x, y)`` with this rank's faults injected at
        each point (batch, forward, loss, gradients, weights), the gradient norm clipped to
        ``clip`` (0: not) before the step; returns the loss tensor."""
        x, y = self.batch(step, x, y)
        self.before_forward(step, model)
        loss = self.loss(step, loss_of(ddp(x), y))
        monitor.observe_loss(loss)
        loss.backward()
        self.after_backward(step, model)
        if clip:
            import torch

            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        self.after_step(step, model)
        opt.zero_grad(set_to_none=True)
        return loss

    def after_step(self, step: int, model) -> None:
        import torch

        for f in self.faults:
            if f.kind == "drift" and step == f.step:
                self._mark(f)
                with torch.no_grad():
                    p = dict(model.named_parameters())[f.options["param"]]
                    bits = p.data.view(-1).view(torch.int32)
                    bits[0] ^= 1 << int(f.options["bit"])
            elif f.kind == "dead" and step == f.step:
                self._mark(f)
                with torch.no_grad():
                    dict(model.named_modules())[f.options["layer"]].bias.fill_(float(f.options["scale"]))
