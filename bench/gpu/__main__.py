"""``python -m bench.gpu``: the device check's entry point (see the package docstring)."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

from . import PARTS
from .common import ERROR, FAIL, Context, Part, device_info, env_info, guarded, say

# per part on CUDA: (at most, at least) seconds of the run's budget, start-up of its process included
TIME_S = {"truth": (75, 30), "nosync": (40, 15), "compiled": (110, 40), "distributed": (75, 30),
          "cost": (140, 90), "guard": (45, 15)}
#: the order the parts run in: the inductor compile of the compiled part, the longest to foresee,
#: last, with what the others left; results are listed in the order of PARTS
RUN_ORDER = ("truth", "nosync", "distributed", "cost", "guard", "compiled")
TITLES = {name: importlib.import_module(f".{name}", __package__).TITLE for name in PARTS}
FILES = ("gpu.json", "gpu.md", "gpu.log")


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description="gradwatch's device check (bench/gpu/__init__.py)")
    p.add_argument("--out", required=True, help="folder for gpu.json, gpu.md and gpu.log")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)} (default: all)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for all parts together (default 330 on CUDA, 600 on the CPU); each part gets "
                        "its share and shortens its work to fit")
    p.add_argument("--fused", default="off,on", help="the agent's fused settings the truth part runs (default off,on)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="each part in its own process (default: on CUDA yes, on the CPU no)")
    p.add_argument("--part", help=argparse.SUPPRESS)  # the child process of one isolated part
    p.add_argument("--part-json", help=argparse.SUPPRESS)
    p.add_argument("--part-s", type=float, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    a.parts = [x.strip() for x in a.parts.split(",") if x.strip()]
    bad = [x for x in a.parts if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {bad}; choose from {', '.join(PARTS)}")
    a.parts = [x for x in RUN_ORDER if x in a.parts]
    a.fused = tuple(x.strip() for x in a.fused.split(",") if x.strip())
    if not set(a.fused) <= {"on", "off"} or not a.fused:
        p.error("--fused: a comma list of on, off")
    if a.budget_s is None:
        a.budget_s = 330.0 if a.device == "cuda" else 600.0
    if a.isolate is None:
        a.isolate = a.device == "cuda"
    return a


def run_part(name: str, device: str, seconds: float, fused: tuple, out: str, json_path: str | None = None) -> Part:
    """Run one part in this process within ``seconds``; never raises."""
    ctx = Context(device=device, deadline=time.monotonic() + seconds, fused=fused, out_dir=out)
    part = Part(name, TITLES[name], json_path)
    say(f"== part {name}: {TITLES[name]} ({seconds:.0f} s at most)")
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        part.error = "--device cuda but torch.cuda.is_available() is false"
        return part
    if device == "cpu":
        torch.set_num_threads(1)  # as bench/overhead.py: steadier on a shared machine
    mod = importlib.import_module(f".{name}", __package__)
    return guarded(part, lambda p: mod.run(ctx, p))


def _child(a) -> int:
    part = run_part(a.part, a.device, a.part_s, a.fused, a.out, a.part_json)
    _write(a.part_json, part.to_json())
    say(f"== part {a.part}: {part.status} in {part.wall_s:.1f} s")
    sys.stdout.flush()
    os._exit(0)  # leave threads (the agent's compile, gloo's) behind without waiting at exit


def _write(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


class Tee:
    """Everything printed goes to the console and to ``gpu.log``; the last lines are kept."""

    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)
        self.tail: deque = deque(maxlen=80)
        self.lock = threading.Lock()

    def line(self, text: str) -> None:
        with self.lock:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.f.write(text)
            self.tail.append(text)


def _isolated(name: str, a, seconds: float, tee: Tee, work: str) -> dict:
    path = os.path.join(work, f"part-{name}.json")  # not under --out: the device returns 8 files at most
    cmd = [sys.executable, "-u", "-m", "bench.gpu", "--out", a.out, "--device", a.device, "--fused", ",".join(a.fused),
           "--part", name, "--part-json", path, "--part-s", f"{seconds:.1f}"]
    t0 = time.monotonic()
    tee.tail.clear()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            cwd=os.getcwd(), env={**os.environ, "PYTHONUNBUFFERED": "1"})
    reader = threading.Thread(target=lambda: [tee.line(ln) for ln in proc.stdout], daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=seconds + 20)  # its own deadline, and start-up and the JSON's writing beside it
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its ranks and aggregators too
        except ProcessLookupError:
            pass
        proc.wait()
        reader.join(5)
    wall = time.monotonic() - t0
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        rec = None
    if rec is not None and not timed_out:
        return rec
    why = f"timed out after {seconds + 20:.0f} s" if timed_out else f"exited with {proc.returncode} without a result"
    tail = "".join(tee.tail)
    if rec is not None:  # checks it made before it was stopped are kept
        rec["error"] = (rec.get("error") or "") + f"\n{why}; the output's tail:\n{tail}"
        rec["status"] = ERROR
        return rec
    return Part.failed(name, TITLES[name], f"{why}; the output's tail:\n{tail}", wall)


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [
        "# gradwatch device check",
        "",
        f"{env.get('gpu') or 'CPU'}; torch {env.get('torch')} (CUDA {env.get('cuda')}); commit {env.get('commit')}; "
        f"{env.get('time')}; {result['config']['device']}; total {result.get('wall_s', math.nan):.0f} s; "
        f"**{'PASS' if result.get('ok') else 'FAIL'}**",
        "",
        "| part | status | wall s | checks pass / fail / skipped |",
        "|---|---|---:|---|",
    ]
    for name, p in result["parts"].items():
        st = [c["status"] for c in p["checks"]]
        lines.append(f"| {name} | {p['status']} | {p['wall_s']:.0f} | {st.count('pass')} / {st.count('fail')} / {st.count('skipped')} |")
    for name, p in result["parts"].items():
        lines += ["", f"## {name}: {p['title']}", "", "| check | status | value | target | detail |", "|---|---|---|---|---|"]
        for c in p["checks"]:
            lines.append(f"| {_cell(c['name'])} | {c['status']} | {_cell(c['value'])} | {_cell(c['target'])} | {_cell(c['detail'])} |")
        for n in p.get("notes", []):
            lines.append(f"\n{n}")
        if p.get("error"):
            lines += ["", "```", p["error"].strip()[-3000:], "```"]
    return "\n".join(lines) + "\n"


def _cell(v) -> str:
    if v is None or v == "":
        return ""
    s = json.dumps(v, default=str) if not isinstance(v, str) else v
    s = s.replace("|", "\\|").replace("\n", " ")
    return s if len(s) <= 300 else s[:297] + "..."


def main(argv=None) -> int:
    a = _args(argv)
    if a.part:
        return _child(a)
    os.makedirs(a.out, exist_ok=True)
    for f in FILES:
        if os.path.exists(os.path.join(a.out, f)):
            os.remove(os.path.join(a.out, f))
    tee = Tee(os.path.join(a.out, "gpu.log"))
    work = tempfile.mkdtemp(prefix="gradwatch-gpu-")
    t0 = time.monotonic()
    end = t0 + a.budget_s
    env = env_info()
    if a.device == "cuda":
        env.update(device_info())
    result = {"env": env, "config": {"device": a.device, "parts": a.parts, "budget_s": a.budget_s, "fused": a.fused,
                                     "isolate": a.isolate}, "status": "running", "ok": None, "parts": {}}
    jpath = os.path.join(a.out, "gpu.json")
    _write(jpath, result)
    tee.line(f"gradwatch device check: {env.get('gpu') or 'CPU'}, torch {env['torch']}, commit {env['commit']}, "
             f"parts {','.join(a.parts)}, budget {a.budget_s:.0f} s\n")
    for i, name in enumerate(a.parts):
        cap, least = TIME_S[name] if a.device == "cuda" else (a.budget_s, 5)
        later = sum((TIME_S[n][1] if a.device == "cuda" else 5) for n in a.parts[i + 1:])
        seconds = min(cap, end - time.monotonic() - later)
        if seconds < least / 2:
            p = Part(name, TITLES[name])
            p.skip("the whole part", f"out of time: {seconds:.0f} s left for it, needs {least} s")
            p.wall_s = 0.0
            rec = p.to_json()
        elif a.isolate:
            rec = _isolated(name, a, seconds, tee, work)
        else:
            real = sys.stdout
            sys.stdout = _TeeStream(tee, real)
            try:
                rec = run_part(name, a.device, seconds, a.fused, a.out).to_json()
            finally:
                sys.stdout = real
        result["parts"][name] = rec
        result["wall_s"] = time.monotonic() - t0
        _write(jpath, result)
        tee.line(f"== part {name}: {rec['status']} ({rec['wall_s']:.1f} s; {time.monotonic() - t0:.0f} s so far)\n")
    result["wall_s"] = time.monotonic() - t0
    result["parts"] = {n: result["parts"][n] for n in PARTS if n in result["parts"]}
    result["ok"] = all(p["status"] not in (FAIL, ERROR) for p in result["parts"].values())
    result["status"] = "done"
    _write(jpath, result)
    md = markdown(result)
    with open(os.path.join(a.out, "gpu.md"), "w") as f:
        f.write(md)
    tee.line("\n" + md)
    failed = [n for n, p in result["parts"].items() if p["status"] in (FAIL, ERROR)]
    tee.line(f"device check {'passed' if result['ok'] else 'FAILED: ' + ', '.join(failed)} in {result['wall_s']:.0f} s; "
             f"{jpath}\n")
    return 0 if result["ok"] else 1


class _TeeStream:
    def __init__(self, tee: Tee, real):
        self.tee, self.real = tee, real

    def write(self, s: str) -> int:
        self.tee.f.write(s)
        self.tee.tail.append(s)
        return self.real.write(s)

    def flush(self) -> None:
        self.real.flush()
        self.tee.f.flush()


if __name__ == "__main__":
    sys.exit(main())
