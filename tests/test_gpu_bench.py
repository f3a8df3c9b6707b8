"""The device check (``python -m bench.gpu``, bench/gpu/) on the CPU, so it cannot rot between lent GPUs.

Each test runs the device check as a command, in a process of its own. The fast tier checks that a
part that cannot run is recorded as failed. The slow tier runs every part that needs no spawned
ranks at reduced sizes, the fused kernel off (its inductor compile on the CPU takes seconds to
minutes): the truth checks must pass on the CPU, the parts that exist only on CUDA must say so per
check, and the JSON and the table must hold what the device run's readers rely on; and it runs the
distributed part (spawned ranks, a real aggregator process) and the truth part with the fused
kernel on.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import ROOT

STATUSES = {"pass", "fail", "skipped"}
NEEDS_CUDA = "skipped: needs CUDA"


def _run(tmp_path, *args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "bench.gpu", "--out", str(out), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout)
    with open(out / "gpu.json") as f:
        result = json.load(f)
    assert (out / "gpu.md").is_file() and (out / "gpu.log").is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    return run, result


def _checks(part: dict) -> dict[str, dict]:
    return {c["name"]: c for c in part["checks"]}


def _well_formed(result: dict, parts: list[str], device: str) -> None:
    assert result["status"] == "done" and result["config"]["device"] == device
    assert {"torch", "commit", "time"} <= set(result["env"])
    assert list(result["parts"]) == parts
    for name, p in result["parts"].items():
        assert p["name"] == name and p["title"] and p["wall_s"] >= 0, name
        assert p["status"] in STATUSES | {"error"}, (name, p["status"])
        assert p["checks"], f"{name} recorded no check"
        for c in p["checks"]:
            assert c["status"] in STATUSES and c["name"], (name, c)
            if c["status"] == "skipped":
                assert c["detail"], (name, c)  # a skip says why


@pytest.mark.ddp
def test_device_check_on_the_cpu_passes_its_truth_checks_and_says_what_needs_cuda(tmp_path):
    """Training runs of every precision in a process of its own (~10 s): the slow tier."""
    parts = ["truth", "nosync", "compiled", "cost", "guard"]
    run, result = _run(tmp_path, "--device", "cpu", "--fused", "off", "--parts", ",".join(parts))
    log = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0, log
    _well_formed(result, parts, "cpu")
    assert result["ok"] is True

    truth = result["parts"]["truth"]
    assert truth["status"] == "pass", log
    checks = _checks(truth)
    for precision in ("fp32", "bf16", "fp16"):
        c = checks[f"{precision}/fused=off: every statistic of 8 steps equals the float64 reference"]
        assert c["status"] == "pass" and c["value"]["mismatches"] == 0 and c["value"]["values"] > 500, c
        case = truth["numbers"]["cases"][f"{precision}/fused=off"]
        # every family of statistic was compared, the agent counted no error
        assert {"act_mean", "act_std", "act_min", "act_max", "act_zero_ratio", "act_count", "act_grad_norm",
                "param_grad_norm", "weight_norm", "fp_grad", "fp_weight", "grad_norm", "grad_norms", "local_norm",
                "loss", "skipped"} <= set(case["max_rel_err"]), case["max_rel_err"]
        assert case["agent_errors"] == 0 and not case["missing_steps"]
    assert checks["fp16/fused=off: the overflowing iteration is skipped by the scaler, counted in the next report, "
                  "not reported"]["status"] == "pass"
    guard = checks["fp32/fused=off: the NaN guard's verdict on unprobed steps"]
    assert guard["status"] == "pass" and guard["value"]["7"] == 0  # the first module after the NaN step: tok

    nosync = result["parts"]["nosync"]  # its code ran (the agent with and without probes); its checks need CUDA
    assert nosync["status"] == "skipped" and all(c["detail"] == NEEDS_CUDA for c in nosync["checks"])
    for precision in ("bf16", "fp16"):
        ran = nosync["numbers"][precision]
        assert ran["unprobed"]["agent_errors"] == 0 and ran["unprobed"]["probes"] == 1, ran["unprobed"]
        assert ran["probed"]["agent_errors"] == 0 and ran["probed"]["probes"] > ran["probed"]["steps"]
    assert result["parts"]["compiled"]["status"] == "pass"
    cost = _checks(result["parts"]["cost"])
    assert cost["gpt-tiny: peak GPU memory with and without the agent"]["detail"] == NEEDS_CUDA
    timed = result["parts"]["cost"]["numbers"]["gpt-tiny"]["variants"]
    assert set(timed) == {"none", "budget", "every1", "anchor", "watch"}
    assert all(v["median_step_s"] > 0 for v in timed.values()) and timed["every1"]["probes"] == timed["every1"]["steps"]
    guard = _checks(result["parts"]["guard"])
    assert guard["auto judged itself within the warm-up"]["status"] == "pass"
    assert guard["auto's decision agrees with the guard's measured cost on the device"]["detail"].startswith(NEEDS_CUDA)

    md = (tmp_path / "out" / "gpu.md").read_text()
    assert "| truth | pass |" in md and "| nosync | skipped |" in md and "**PASS**" in md


def test_a_part_that_cannot_run_is_recorded_as_failed_and_the_others_still_run(tmp_path):
    """No GPU here: asked for CUDA, every part errs, each says why, and the run exits 1."""
    run, result = _run(tmp_path, "--device", "cuda", "--no-isolate", "--parts", "truth,guard", timeout=120)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert result["ok"] is False and list(result["parts"]) == ["truth", "guard"]
    for p in result["parts"].values():
        assert p["status"] == "error" and "torch.cuda.is_available() is false" in p["error"]
    assert "FAIL" in (tmp_path / "out" / "gpu.md").read_text()


@pytest.mark.ddp
def test_device_check_distributed_part_and_fused_kernel_on_the_cpu(tmp_path):
    """Two gloo ranks spawned against a real aggregator process (the NCCL job needs CUDA), and the
    truth checks with the fused kernel compiled by inductor."""
    run, result = _run(tmp_path, "--device", "cpu", "--fused", "on", "--parts", "truth,distributed", timeout=600)
    log = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0, log
    _well_formed(result, ["truth", "distributed"], "cpu")
    checks = _checks(result["parts"]["truth"])
    for precision in ("fp32", "bf16", "fp16"):
        assert checks[f"{precision}/fused=on: every statistic of 8 steps equals the float64 reference"]["status"] == "pass"
        fused = checks[f"{precision}/fused=on: the fused kernel was ready for cpu before step 0, and nothing compiled "
                       f"on the training thread (autocast, grad mode, dtypes)"]
        assert fused["status"] == "pass" and fused["value"]["graphs_compiled_during_steps"] == 0, fused
    ddp = _checks(result["parts"]["distributed"])
    assert ddp["DDP over NCCL, one rank: reports, exported norms, findings"]["detail"] == NEEDS_CUDA
    for name, c in ddp.items():
        if name.startswith("gloo"):
            assert c["status"] == "pass", c
    assert len([n for n in ddp if n.startswith("gloo")]) == 5
