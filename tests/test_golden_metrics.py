"""Golden /metrics: a recorded input (a fixed sequence of wire messages from a 3-rank job) fed to an
in-process aggregator on a fake clock must expose exactly the text in tests/golden/.

The input covers schemas, heartbeats, every-step sentinel reports and probed steps, a straggler
rank, a non-finite gradient, a frozen parameter, a slot one rank did not run, a lost message and a
malformed frame. Only samples that depend on the wall clock or on how long the machine took
(:data:`VOLATILE`) are left out. After an intended change of the exposition, regenerate with

    GRADWATCH_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/test_golden_metrics.py

and review the diff of tests/golden/ like code.
"""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gradwatch import wire

from .conftest import ROOT
from .fakejob import FakeJob, Model

GOLDEN = ROOT / "tests" / "golden"
#: (layer_depth, golden file)
CASES = ((0, "metrics.txt"), (2, "metrics_layer_depth_2.txt"))
#: sample names whose values depend on the wall clock or on the machine's speed
VOLATILE = ("gradwatch_rank_last_seen_timestamp_seconds", "gradwatch_rank_finding_raised_timestamp_seconds", "gradwatch_check_seconds_total", "gradwatch_decode_seconds_sum")

JOB, WORLD, EVERY, STEPS = "golden", 3, 5, 51  # the last step is probed
T0 = 1_700_000_000.0  # senders' wall clock at the first message
MODULES = ("emb", "blocks.0.fc", "blocks.1.fc", "head")
PARAMS = (("emb.weight", (16, 8), "float32"),) + tuple(
    (f"{m}.{p}", (8, 8) if p == "weight" else (8,), "float32") for m in MODULES[1:] for p in ("weight", "bias")
)
SLOTS = (
    ("emb", "", "Embedding", "float32"),
    ("blocks.0.fc", "", "Linear", "float32"),
    ("blocks.0.act", "", "ReLU", "float32"),
    ("blocks.1.fc", "", "Linear", "float32"),
    ("blocks.1.act", "", "ReLU", "float32"),
    ("head", "", "Linear", "float32"),
)
MODEL = Model(PARAMS, SLOTS)


def _probe(rank: int, step: int) -> dict:
    """Per-layer statistics of one probed step: smooth in rank and step, with the faults planted."""
    n_slots, n_params = len(SLOTS), len(PARAMS)
    i = np.arange(n_slots, dtype=np.float64)
    act = np.stack([
        0.1 * (i + 1) + 0.01 * rank,  # mean
        1.0 + 0.1 * i + 0.02 * step,  # std
        -2.0 - i,  # min
        2.0 + i + 0.5 * rank,  # max
        np.where([t == "ReLU" for _, _, t, _ in SLOTS], 0.5, 0.0),  # zero ratio
        np.zeros(n_slots),  # non-finite
    ], axis=1)
    act[4, 4] = 0.995  # blocks.1.act: almost every unit dead on every rank
    act_grad = np.stack([0.01 * (i + 1) * (1 + rank) / (1 + step), np.zeros(n_slots)], axis=1)
    p = np.arange(n_params, dtype=np.float64)
    param = np.stack([0.1 * (p + 1) * (1 + 0.1 * rank), 1.0 + 0.5 * p + 0.001 * step, np.zeros(n_params)], axis=1)
    param[0, [0, 2]] = np.nan  # emb.weight is frozen: no gradient on any rank
    if rank == 1 and step == STEPS - 1:
        act[2, :] = np.nan  # rank 1 skipped blocks.0.act at the last probed step: not observed
    if rank == 2 and step == STEPS - 1:
        act[3, 3] = np.inf  # an observed Inf propagates into every aggregate of blocks.1.fc's max
    if rank == 1 and step == 10:
        act[5, 5], act_grad[5, 1], param[5, 2] = 3.0, 2.0, 1.0  # non-finite elements at the head
        param[5, 0] = np.inf
    # calls and output elements: blocks.1.act runs twice per step (reused); rank 1 skipped blocks.0.act
    act_count = np.stack([np.ones(n_slots), np.full(n_slots, 64.0 * (1 + rank))], axis=1)
    act_count[4] = (2, 128 * (1 + rank))
    if rank == 1 and step == STEPS - 1:
        act_count[2] = np.nan
    fp = (np.arange(n_params) + 1000 * step).astype(np.uint64)
    return dict(probe=True, act=act.astype(np.float32), act_grad=act_grad.astype(np.float32),
                param=param.astype(np.float32), act_count=act_count.astype(np.float32), fp_grad=fp,
                fp_weight=fp + np.uint64(7))


def recorded_input() -> list[tuple[float, bytes | None]]:
    """``(aggregator clock, frame)`` in arrival order; a None frame is a tick of the aggregator."""
    out: list[tuple[float, bytes | None]] = []
    now = [0.0]  # the aggregator's clock at the next frame; the senders' is T0 ahead of it
    job = FakeJob(lambda msg: out.append((now[0], wire.encode(msg))), JOB, WORLD, MODEL, every=EVERY,
                  clock=lambda: T0 + now[0], boots=[f"boot{r}" for r in range(WORLD)])

    def at(t: float) -> FakeJob:
        now[0] = t
        return job

    t = 0.0
    for r in range(WORLD):
        at(t).schema(r, host=f"node-{r // 2}", local_rank=lambda r: r % 2)
        at(t).heartbeat(r)
    out.append((t, b"\x91"))  # a malformed frame: counted by reason, nothing else changes
    for step in range(STEPS):
        t += 0.5
        for r in range(WORLD):
            slow = 0.3 if r == 2 else 0.0  # rank 2 straggles: its own compute takes longer
            grad_norm, local, nonfinite = 1.0 + 0.01 * step, (1.0 + 0.01 * step) * (1.0 + 0.05 * r), 0
            if step == 7:  # rank 1's gradient overflows; all-reduce spreads it to every rank
                grad_norm, nonfinite = float("inf"), 2
                local = float("inf") if r == 1 else local
            if r == 2 and step == 12:
                job.lose(r)  # one message of rank 2 lost in flight
            at(t + slow).report(r, step, grad_norm, nonfinite, step_time=0.5 + slow,
                                arrays=_probe(r, step) if step % EVERY == 0 else None, micro=1, drops=0,
                                local_grad_norm=local, compute_time=0.2 + slow, loss=2.0 - 0.05 * step, batch=8)
        if step % 5 == 4:
            for r in range(WORLD):
                at(t + 0.4).heartbeat(r, step, in_step_s=0.1)
        out.append((t + 0.45, None))
    out.append((t + 1.0, None))
    return out


def render(layer_depth: int, every_view: bool = False, **settings) -> str:
    """The exposition of an aggregator fed :func:`recorded_input`, without :data:`VOLATILE` samples
    (``settings``: more aggregator settings; ``every_view``: snapshots hold every rank's view even
    above ``rank_series_max``)."""
    from prometheus_client import generate_latest

    from gradwatch.aggregator import Aggregator, load

    now = [0.0]
    agg = Aggregator(
        load(listen="tcp://127.0.0.1:0", round_grace_s=2.0, layer_depth=layer_depth, events_path="", grafana_url="",
             **settings),
        clock=lambda: now[0],
    )
    if every_view:
        agg.state.limits.rank_view_max = None
    try:
        for t, frame in recorded_input():
            now[0] = t
            if frame is None:
                agg.state.tick()
            else:
                agg.handle(frame)
            agg.state.finish_closing()  # a round in slices (round_slice_ranks): as an idle writer would
        agg.publish()
        # what /metrics serves (prometheus_client's WSGI app renders the registry the same way)
        text = generate_latest(agg.registry).decode()
    finally:
        agg.runner.close()
    return "".join(line + "\n" for line in text.splitlines() if not line.startswith(VOLATILE))


@pytest.mark.parametrize("layer_depth, name", CASES)
def test_metrics_match_the_golden_file(layer_depth, name):
    text = render(layer_depth)
    path = GOLDEN / name
    if os.environ.get("GRADWATCH_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    want = path.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(path), "now", n=1))
        pytest.fail(f"/metrics differs from {path.name} (GRADWATCH_UPDATE_GOLDEN=1 regenerates it):\n{diff[:6000]}")


def test_the_recorded_input_exercises_layers_findings_and_losses():
    """The golden file is not vacuous: per-layer series, raised findings, a lost message and a rejection."""
    text = (GOLDEN / "metrics.txt").read_text()
    layer = [line for line in text.splitlines() if line.startswith("gradwatch_layer_")]
    assert len(layer) > 100
    findings = [line for line in text.splitlines() if line.startswith("gradwatch_findings_total{") and not line.endswith(" 0.0")]
    assert findings, "no finding raised"
    assert 'gradwatch_rank_messages_lost_total{job_id="golden",rank="2"} 1.0' in text
    assert 'gradwatch_messages_rejected_total{reason="malformed"} 1.0' in text


def test_rendering_does_not_depend_on_the_interpreter():
    """Fresh interpreters with other string hash seeds (set iteration order) render the same text."""
    code = textwrap.dedent(
        """
        import sys
        from tests.test_golden_metrics import CASES, render
        sys.stdout.write("".join(render(d) for d, _ in CASES))
        """
    )
    want = "".join((GOLDEN / name).read_text() for _, name in CASES)
    for seed in ("1", "12345"):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert run.returncode == 0, run.stderr
        assert run.stdout == want, f"PYTHONHASHSEED={seed}"


def test_a_scrape_reads_the_layers_the_writer_merged_with_a_round_in_slices(monkeypatch):
    """At ``--layer-depth`` the writer merges the layers of a round it reconciles in slices (a
    large one: here every round, ``round_slice_ranks`` 1) in a slice of its own: a scrape of a
    16,384-rank job would wait 0.1-0.8 s for that merge. The exposition is the same."""
    from gradwatch.aggregator import exporter

    def merge_on_scrape(rr, depth):
        raise AssertionError("the scrape merged a round's layers itself")

    monkeypatch.setattr(exporter, "group_layers", merge_on_scrape)
    text = render(2, round_slice_ranks=1)
    assert text == (GOLDEN / "metrics_layer_depth_2.txt").read_text()
    assert "gradwatch_layer_" in text


def test_a_huge_jobs_snapshot_holds_the_named_ranks_and_exports_what_a_full_one_does():
    """Above rank_series_max a snapshot keeps views only of the ranks a finding names, and columns
    for the job-level series (a 16,384-rank snapshot took ~40 ms of the writer): the exposition is
    the one the exporter makes from a snapshot of every rank."""
    def timeless(text):  # wall-clock samples differ between two renders
        seen = "gradwatch_job_rank_last_seen_timestamp_seconds{"
        assert sum(line.startswith(seen) for line in text.splitlines()) == 2  # min, max
        return [line for line in text.splitlines() if not line.startswith(seen)]

    text = render(0, rank_series_max=2)  # 3 ranks: the job is "huge"; ranks 1 and 2 are named
    assert timeless(text) == timeless(render(0, every_view=True, rank_series_max=2))
    assert 'gradwatch_job_ranks_reporting{job_id="golden"} 3.0' in text
    steps = [line for line in text.splitlines() if line.startswith("gradwatch_rank_step{")]
    assert [line.split('rank="')[1][0] for line in steps] == ["1", "2"]
    assert 'gradwatch_job_rank_step{agg="min",job_id="golden"}' in text
