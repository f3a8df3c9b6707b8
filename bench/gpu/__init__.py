"""The device check: every CUDA path of the agent run, measured and asserted, from one command.

    python -m bench.gpu --out DIR                  # on a GPU: every part, about 5 minutes on one H100
    python -m bench.gpu --out DIR --device cpu     # reduced sizes on the CPU (tests/test_gpu_bench.py)
    python -m bench.gpu --out DIR --parts truth,cost

Writes ``DIR/gpu.json`` (rewritten after every part, so a run cut short still leaves what it
measured), ``DIR/gpu.md`` (the table) and ``DIR/gpu.log`` (everything printed). Exits 1 when any
check failed or a part raised, else 0. On CUDA each part runs in its own process (``--isolate``,
the default there) under a time limit of its own, so a part that hangs or crashes is recorded as
failed with its output's tail and the others still run.

Parts (``--parts``, in this order):

``truth``
    Every statistic the agent sends (activation moments, output-gradient norms, parameter gradient
    and weight norms, global and local norms, fingerprints, loss, loss scale, skipped steps, the NaN
    guard's verdict) against a float64 reference of the same tensors, fp32, bf16 autocast and fp16
    with ``GradScaler`` (a skipped step included), the fused kernel off and on (:mod:`.truth`).
``nosync``
    No host synchronisation on unprobed steps: ``torch.cuda.set_sync_debug_mode`` and the
    profiler's count of synchronising CUDA calls per step, against the same step without the agent;
    the probed steps' count stated (:mod:`.nosync`). CUDA only.
``compiled``
    ``torch.compile`` (inductor on CUDA) with the agent's kernel compiling in its thread: the same
    graphs, breaks and recompiles as without the agent, bit-identical losses and weights
    (:mod:`.compiled`).
``distributed``
    DDP over NCCL with one rank, and two ranks on the one device over gloo with CUDA tensors,
    reporting to a real aggregator process: reports arrive, the exported global and local norms
    equal each rank's reference, and an injected explosion and NaN are found naming the rank
    and layer (:mod:`.distributed`).
``cost``
    Step time with CUDA events, variants interleaved as in bench/overhead.py (no agent, defaults,
    every step, the tutorial hooks, wandb.watch-like histograms) on a GPT-2-small-size model
    (124M parameters, 100-300 ms steps) and a small one (~10 ms), and peak GPU memory with and
    without the agent; targets defaults <= 1.005x, every step <= 1.05x, peak memory <= +1%
    (:mod:`.cost`).
``guard``
    The NaN guard's ``auto`` decision on the device, and its cost measured (:mod:`.guard`).

Run it from the repository root; gradwatch's dependencies must be importable (on the device:
bench/gpu_wheels.sh), gradwatch itself need not be installed (:func:`_rooms_importable`).

JSON layout: ``{"env": {...}, "config": {...}, "status": "running" | "done", "ok": bool,
"parts": {name: {"status": "pass" | "fail" | "skipped" | "error", "wall_s", "checks": [{"name",
"status", "value", "target", "detail"}], "numbers": {...}, "notes": [...], "error": traceback}}}``.
A check skipped on the CPU says why ("skipped: needs CUDA").
"""

import importlib.util
import os

PARTS = ("truth", "nosync", "compiled", "distributed", "cost", "guard")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rooms_importable() -> None:
    """Run from a checkout where gradwatch is not installed (the lent GPU machine), ``gradwatch``
    is the tree's foundation folder alone: extend its package path to the tree's root, so
    ``gradwatch.agent``, ``gradwatch.aggregator`` and ``gradwatch.commands`` are the tree's rooms
    (what the editable install's finder does). Installed, nothing changes."""
    import gradwatch

    if importlib.util.find_spec("gradwatch.agent") is None and ROOT not in gradwatch.__path__:
        gradwatch.__path__.append(ROOT)


_rooms_importable()
