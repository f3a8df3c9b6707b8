"""What the parts of the device check share: the result record, the run's context, a real ZeroMQ
ROUTER socket that decodes what the agents send, the models, and float64 references."""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

PASS, FAIL, SKIP, ERROR = "pass", "fail", "skipped", "error"
NEEDS_CUDA = "skipped: needs CUDA"


# --- results ---------------------------------------------------------------------------------------


class Part:
    """The record of one part: checks (each pass, fail or skipped against a stated target), the
    numbers measured, notes, and the traceback of an error. Prints each check as it is made."""

    def __init__(self, name: str, title: str, json_path: str | None = None):
        self.name, self.title = name, title
        self.json_path = json_path  # rewritten after every check, so a part stopped midway leaves its checks
        self.checks: list[dict] = []
        self.numbers: dict[str, Any] = {}
        self.notes: list[str] = []
        self.error = ""
        self.skipped = ""  # the whole part skipped, and why
        self.t0 = time.perf_counter()
        self.wall_s = math.nan

    def check(self, name: str, ok: bool, value: Any = None, target: Any = None, detail: str = "") -> bool:
        """Record one assertion; returns ``ok``."""
        self.checks.append({"name": name, "status": PASS if ok else FAIL, "value": _plain(value),
                            "target": _plain(target), "detail": detail})
        say(f"  [{self.name}] {'PASS' if ok else 'FAIL'} {name}: {_short(value)}"
            + (f" (target {_short(target)})" if target is not None else "") + (f" -- {detail}" if detail else ""))
        self.save()
        return ok

    def save(self) -> None:
        """Write the record so far to ``json_path`` (when given)."""
        if not self.json_path:
            return
        import json

        self.wall_s = time.perf_counter() - self.t0
        tmp = self.json_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1, default=str)
        os.replace(tmp, self.json_path)

    def skip(self, name: str, reason: str) -> None:
        """Record a check that cannot run here, and why (e.g. :data:`NEEDS_CUDA`)."""
        self.checks.append({"name": name, "status": SKIP, "value": None, "target": None, "detail": reason})
        say(f"  [{self.name}] SKIP {name}: {reason}")
        self.save()

    def note(self, text: str) -> None:
        self.notes.append(text)
        say(f"  [{self.name}] note: {text}")

    @property
    def status(self) -> str:
        if self.error:
            return ERROR
        states = {c["status"] for c in self.checks}
        if FAIL in states:
            return FAIL
        if PASS in states:
            return PASS
        return SKIP

    def to_json(self) -> dict:
        return {"name": self.name, "title": self.title, "status": self.status, "wall_s": self.wall_s,
                "skipped": self.skipped, "checks": self.checks, "numbers": _plain(self.numbers),
                "notes": self.notes, "error": self.error}

    @classmethod
    def failed(cls, name: str, title: str, error: str, wall_s: float = math.nan) -> dict:
        """The record of a part that left none (it crashed or ran out of time)."""
        p = cls(name, title)
        p.error, p.wall_s = error, wall_s
        return p.to_json()


def guarded(part: Part, fn: Callable[[Part], None]) -> Part:
    """Run ``fn(part)``; an exception becomes the part's error (with its traceback), never raised."""
    try:
        fn(part)
    except BaseException as e:  # noqa: BLE001 - a part's failure is recorded, the others still run
        if isinstance(e, KeyboardInterrupt):
            raise
        part.error = traceback.format_exc()
        say(f"  [{part.name}] ERROR {type(e).__name__}: {e}")
    part.wall_s = time.perf_counter() - part.t0
    return part


def _plain(v):
    """JSON-ready: numpy scalars and arrays to Python, non-finite floats kept (json writes NaN)."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, np.ndarray):
        return _plain(v.tolist())
    if isinstance(v, np.generic):
        return v.item()
    return v


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    s = str(_plain(v))
    return s if len(s) <= 160 else s[:157] + "..."


def say(text: str) -> None:
    print(text, flush=True)


# --- the run's context -----------------------------------------------------------------------------


@dataclass
class Context:
    """What every part is given.

    Attributes:
        device: ``"cuda"`` or ``"cpu"``.
        deadline: ``time.monotonic()`` by which the part must be done (it shortens its work to fit).
        fused: the ``fused`` settings the truth part runs ("off", "on").
        out_dir: where the part may leave files (logs).
    """

    device: str
    deadline: float
    fused: tuple[str, ...] = ("off", "on")
    out_dir: str = "."
    extra: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def left(self) -> float:
        """Seconds left to this part."""
        return self.deadline - time.monotonic()

    def torch_device(self):
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")


# --- a real ROUTER socket, decoding every message -----------------------------------------------------


def step_records(msg) -> list:
    """The per-step records a decoded message carries, each a namespace with the fields of a
    ``wire.Report`` (a ``steps`` message's records expanded, its arrays per record), plus ``job``
    and ``rank``; none for schemas and heartbeats."""
    from gradwatch import wire

    h = msg.header
    if isinstance(msg, wire.Report):
        d = {f: getattr(msg, f) for f in msg.__struct_fields__}
        return [SimpleNamespace(**d, job=h.job, rank=h.rank)]
    if isinstance(msg, wire.Steps):
        out = []
        for i in range(len(msg)):
            d = {c.name: msg.records[c.name][i].item() for c in wire.STEP_COLUMNS}
            d.update(header=h, schema=msg.schema, probe=False, micro=0, batch=0, act=None, act_grad=None,
                     param=None, act_count=None, fp_grad=None, fp_weight=None,
                     grad_norms=None if msg.grad_norms is None else msg.grad_norms[i],
                     nonfinite_slot=None if msg.nonfinite_slot is None else int(msg.nonfinite_slot[i]))
            out.append(SimpleNamespace(**d, job=h.job, rank=h.rank))
        return out
    return []


class Capture:
    """A ZeroMQ ROUTER socket (as the aggregator's) bound on loopback (random port), drained and
    decoded by a thread.

    Attributes:
        endpoint: where agents send (``tcp://127.0.0.1:PORT``).
        msgs: every decoded message, in arrival order.
    """

    def __init__(self):
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.msgs: list = []
        self.undecodable = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-capture", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from gradwatch import wire

        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            while self._sock.poll(0):
                frame = self._sock.recv_multipart()[-1]  # without the agent's routing id
                try:
                    m = wire.decode(frame)
                except Exception:
                    self.undecodable += 1
                    continue
                with self._lock:
                    self.msgs.append(m)

    def records(self, job: str) -> dict[int, SimpleNamespace]:
        """``{step: record}`` of ``job``, the latest record of a step winning."""
        with self._lock:
            msgs = [m for m in self.msgs if m.header.job == job]
        return {r.step: r for m in msgs for r in step_records(m)}

    def schemas(self, job: str) -> dict:
        from gradwatch import wire

        with self._lock:
            return {m.hash: m for m in self.msgs if isinstance(m, wire.Schema) and m.header.job == job}

    def wait_steps(self, job: str, n: int, timeout_s: float) -> dict[int, SimpleNamespace]:
        """The records of steps 0..n-1 of ``job`` once all arrived (or what arrived by the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.records(job)
            if all(s in got for s in range(n)) or time.monotonic() > deadline:
                return got
            time.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(0)
        self._ctx.term()


# --- models and data ---------------------------------------------------------------------------------


def gpt(width: int, layers: int, heads: int, context: int, vocab: int = 256, tie: bool = False):
    """The demo's GPT (``gradwatch.commands.demo.model.GPT``); ``tie``: the head shares the token
    embedding's weight, as GPT-2 does."""
    from gradwatch.commands.demo.model import GPT, GPTConfig

    m = GPT(GPTConfig(vocab=vocab, context=context, width=width, layers=layers, heads=heads))
    if tie:
        m.head.weight = m.tok.weight
    return m


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def token_batch(vocab: int, batch: int, context: int, device, seed: int):
    """(inputs, targets) int64 [batch, context] on ``device``: random token ids, reproducible."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, context + 1), generator=g)
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


def lm_loss(logits, y):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def autocast(precision: str, device: str):
    """The forward pass's context: fp32 plain, bf16 / fp16 under ``torch.autocast``."""
    import torch

    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


# --- references ------------------------------------------------------------------------------------


def f64(tensors):
    """float64 [n]: the concatenation of ``tensors`` (one tensor or a list), flattened."""
    import torch

    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def norm64(tensors) -> float:
    """float64 L2 norm of the concatenation of ``tensors`` (NaN and Inf propagate)."""
    return f64(tensors).norm().item()


def nonfinite64(tensors) -> int:
    import torch

    return int((~torch.isfinite(f64(tensors))).sum())


def moments64(tensors) -> dict:
    """Reference of an ``act`` row over the concatenation of ``tensors``, in float64."""
    import torch

    x = f64(tensors)
    fin = torch.isfinite(x)
    return dict(mean=x.mean().item(), std=x.std(correction=0).item() if x.numel() > 1 else 0.0,
                min=x.min().item(), max=x.max().item(), zero_ratio=(x == 0).double().mean().item(),
                nonfinite=int((~fin).sum()), scale=x[fin].abs().mean().item() if fin.any() else 0.0,
                n=x.numel())


def fingerprint64(t) -> int:
    """The agent's fingerprint computed independently: the sum of ``t``'s elements read as signed
    integers of their own width, modulo 2**64 (numpy on the host)."""
    a = t.detach().contiguous().reshape(-1).cpu()
    raw = a.numpy().view({1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[a.element_size()])
    return int(raw.astype(np.int64).sum(dtype=np.int64)) % (1 << 64)


def rel_err(got: float, want: float) -> float:
    """|got - want| / |want| (0 for two equal values, inf when only one is finite or they differ
    in kind: NaN against Inf)."""
    if math.isnan(want) or math.isnan(got):
        return 0.0 if (math.isnan(want) and math.isnan(got)) else math.inf
    if math.isinf(want) or math.isinf(got):
        return 0.0 if got == want else math.inf
    if got == want:
        return 0.0
    return abs(got - want) / abs(want) if want else math.inf


# --- the agent's side ----------------------------------------------------------------------------


def wait_fused(reducer, device, timeout_s: float, dtype=None) -> bool:
    """Wait until the agent's fused kernel is ready for ``device`` and ``dtype`` (float32 when
    None); False on timeout."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    deadline = time.monotonic() + timeout_s
    while not reducer.ready_for(device, dtype):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def compile_threads_done(timeout_s: float) -> bool:
    """Wait for the agent's background compile threads to end; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while any(t.name == "gradwatch-compile" and t.is_alive() for t in threading.enumerate()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def settle(monitor, timeout_s: float = 5.0) -> None:
    """Wait until ``monitor``'s sender has built every queued report (outside any timing), as
    bench/overhead.py's ``Runner.settle`` does: records waiting to be coalesced cost nothing."""
    q = getattr(getattr(monitor, "sender", None), "_queue", None)
    if q is None:
        return
    deadline = time.monotonic() + timeout_s
    while q and time.monotonic() < deadline:
        time.sleep(0.001)


def env_info() -> dict:
    import platform
    import subprocess

    import torch

    info = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "cuda": torch.version.cuda, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        info["commit"] = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=10).stdout.strip()
    except Exception:
        info["commit"] = ""
    return info


def device_info() -> dict:
    """The GPU, read in whatever process calls it (initialises CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {"gpu": None}
    p = torch.cuda.get_device_properties(0)
    return {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count,
            "capability": f"{p.major}.{p.minor}"}


def maybe(fn: Callable[[], Any], default=None):
    try:
        return fn()
    except Exception:
        return default

