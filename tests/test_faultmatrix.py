"""The fault matrix's CI slice (bench/faultmatrix.py, issue 12): real 2-rank gloo DDP jobs on the
CNN against a real aggregator at default thresholds, one fault each, injected into the job's own
tensors at step 30 (probed) or 35 (not: the rotation puts explode and the forward NaN there, which
the NaN guard locates); each fault must be found by its check, naming the injected rank (and
module), and the clean run must raise nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import ROOT

FAULTS = ("explode", "nan_fwd_late", "hang", "silent")


@pytest.mark.ddp
def test_fault_matrix_slice_finds_each_fault_with_its_rank_and_nothing_in_clean_runs(tmp_path):
    out = tmp_path / "faultmatrix.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "faultmatrix.py"), "--worlds", "2", "--models", "cnn", "--load", "idle",
         "--faults", ",".join((*FAULTS, "clean")), "--at", "30,35", "--clean-runs", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    res = json.loads(out.read_text())
    runs = {r["fault"]: r for r in res["runs"] if r["fault"] != "clean"}
    assert sorted(runs) == sorted(FAULTS)
    faults = res["scores"]["faults"]
    for name in FAULTS:
        assert faults[name]["recall"] == 1.0, (name, runs[name]["findings"])
        assert faults[name]["attribution"] == 1.0, (name, runs[name]["findings"])
    assert runs["nan_fwd_late"]["step"] == 35  # not probed: the NaN guard's step
    assert runs["nan_fwd_late"]["findings"][0]["layer"] == "6"  # the module whose output was NaN
    assert runs["silent"]["findings"][0]["rank"] == runs["silent"]["rank"]
    # time-based checks within the bound: 3 s after the fault (the tiny CNN's steps are short)
    assert faults["silent"]["seconds_p95"] <= 3.0 + 1.0  # + the heartbeat period: the last message may precede the stop
    assert faults["hang"]["seconds_p95"] <= 3.0 + 1.0
    clean = [r for r in res["runs"] if r["fault"] == "clean"]
    assert len(clean) == 1 and all(r["ok"] and r["findings"] == [] for r in clean), clean
    # one fault, the findings it explains: every finding raised belongs to its run's fault
    for name, c in res["scores"]["checks"].items():
        assert c["true"] == c["findings"], (name, c)
