#!/usr/bin/env python
"""Precision and cost of the L2 norms the agent takes, float32 vs float64 accumulation.

For tensors of 2^20 to 2^26 elements (float32, values N(0, 1) plus an offset so the sum of
squares is large) this measures, on the current device:

  f32      ``torch._foreach_norm(ts, 2, dtype=torch.float32)``   (the agent's former choice)
  f64      ``torch._foreach_norm(ts, 2, dtype=torch.float64)``   (float64 accumulation)
  chunked  ``gradwatch.agent.stats.l2_norms``: float32 over 8192-element chunks, float64 across
           (the agent's choice)

the relative error of each against a float64 reference (``x.double().norm()``) and the median wall
time of one call over ``--repeat`` calls. See bench/README.md for the figures and the choice.

    .venv/bin/python bench/norm_precision.py               # 2^20, 2^24, 2^26
    .venv/bin/python bench/norm_precision.py --max-log2 27 # up to 2^27 (needs ~2.5 GB)
    .venv/bin/python bench/norm_precision.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gradwatch.agent.stats import l2_norms


def timed(fn, repeat: int, device: torch.device) -> float:
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-log2", type=int, default=26)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads on CPU")
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cpu":
        torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    print(f"device {dev}, threads {torch.get_num_threads()}")
    print(f"{'numel':>10} {'err f32':>9} {'err f64':>9} {'err chunk':>9} {'ms f32':>8} {'ms f64':>8} {'ms chunk':>8}")
    for k in [20, 24] + list(range(26, a.max_log2 + 1)):
        n = 1 << k
        x = (torch.randn(n, generator=g) + 0.5).to(dev)
        ref = x.double().norm().item()
        fns = [lambda: torch._foreach_norm([x], 2, dtype=torch.float32)[0],
               lambda: torch._foreach_norm([x], 2, dtype=torch.float64)[0],
               lambda: l2_norms([x])[0]]
        errs = [abs(f().item() - ref) / ref for f in fns]
        ms = [1e3 * timed(f, a.repeat, dev) for f in fns]
        print(f"{n:>10} " + " ".join(f"{e:>9.1e}" for e in errs) + " " + " ".join(f"{t:>8.2f}" for t in ms))
        del x


if __name__ == "__main__":
    main()
