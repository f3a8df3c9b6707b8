#!/usr/bin/env python
"""Precision and cost of the L2 norms the agent takes, float32 vs float64 accumulation.

For tensors of 2^20 to 2^26 elements (float32, values N(0, 1) plus an offset so the sum of
squares is large) this measures, on the current device:

  f32      ``torch._foreach_norm(ts, 2, dtype=torch.float32)``   (the agent's former choice)
  f64      ``torch._foreach_norm(ts, 2, dtype=torch.float64)``   (float64 accumulation)

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
    print(f"{'numel':>10} {'rel err f32':>12} {'rel err f64':>12} {'ms f32':>9} {'ms f64':>9} {'f64/f32':>8}")
    for k in [20, 24] + list(range(26, a.max_log2 + 1)):
        n = 1 << k
        x = (torch.randn(n, generator=g) + 0.5).to(dev)
        ref = x.double().norm().item()
        row = [n]
        for dt in (torch.float32, torch.float64):
            got = torch._foreach_norm([x], 2, dtype=dt)[0].item()
            row.append(abs(got - ref) / ref)
        for dt in (torch.float32, torch.float64):
            row.append(1e3 * timed(lambda: torch._foreach_norm([x], 2, dtype=dt), a.repeat, dev))
        print(f"{row[0]:>10} {row[1]:>12.2e} {row[2]:>12.2e} {row[3]:>9.2f} {row[4]:>9.2f} {row[4] / row[3]:>8.2f}")
        del x


if __name__ == "__main__":
    main()
