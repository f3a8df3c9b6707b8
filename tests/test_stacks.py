"""Where a hung rank is stuck, on real 3-rank gloo DDP jobs (tests/controljob.py) and a real
aggregator process: the training_stalled finding is updated with the stuck rank's Python stack
beside a healthy rank's, in /api/findings, the events log and /metrics; ``gradwatch stacks``
groups a healthy job's ranks into one stack; a probe burst on demand reaches every rank at the
same steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from .conftest import ROOT, free_port, samples, start_aggregator, wait_for

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(240)]

TOKEN = "stacks-test-token-0123456789"
JOB_FILE = Path(__file__).with_name("controljob.py")


def source_line(function: str, text: str) -> int:
    """The line number in controljob.py of the first line of ``function`` holding ``text``."""
    lines = JOB_FILE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {function}("))
    return next(i for i in range(start, len(lines)) if text in lines[i]) + 1


class Job:
    """tests/controljob.py running in its own session (killed whole at the end)."""

    def __init__(self, tmp_path: Path, endpoint: str, *args: str, name: str = "job", env: dict | None = None):
        self.out = tmp_path / name
        self.log = tmp_path / f"{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, str(JOB_FILE), "--endpoint", endpoint, "--port", str(free_port()), "--out", str(self.out),
             *args], stdout=self.log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def wait(self, timeout: float = 180) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not end within {timeout} s: {self.log.read_text()[-3000:]}")
        assert self.proc.returncode == 0, self.log.read_text()[-3000:]

    def info(self, rank: int) -> dict:
        return json.loads(Path(f"{self.out}.{rank}.json").read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def agg(tmp_path):
    a = start_aggregator(tmp_path, "--control-token", TOKEN, "--publish-interval-s", "0.05",
                         "--events-path", str(tmp_path / "events.jsonl"))
    yield a
    a.stop()


def stacks_finding(agg, job: str) -> dict:
    """The training_stalled finding of ``job`` once it carries its stacks (an updated event)."""
    def found():
        for f in agg.findings(job):
            if f["check"] == "training_stalled" and f["event"] == "updated" and "stacks" in f["details"]:
                return f
        return None

    return wait_for(found, 90, 0.25, what=f"a training_stalled finding of {job} updated with stacks")


def functions(frames: list[dict]) -> list[tuple[str, str, int]]:
    return [(Path(f["file"]).name, f["function"], f["line"]) for f in frames]


@pytest.mark.parametrize("fault, function, text", [
    ("sleep", "load_batch", "time.sleep(a.hold_s)"),
    ("collective", "sync_extra", "dist.all_reduce(flag, group=group)"),
], ids=["hung-in-the-data-loader", "stuck-in-a-collective"])
def test_a_stalled_finding_names_the_hung_ranks_function_and_line_beside_a_healthy_ranks_stack(
        tmp_path, agg, fault, function, text):
    """Rank 1 hangs at step 15 (asleep in the user's data loader, or in an all-reduce its peers
    never enter); training_stalled names it, and the aggregator updates the finding with rank 1's
    stack, whose frames hold the user's function at the line it hangs on, and rank 0's, which
    differ from it at the training loop's line (rank 0 waits in backward's all-reduce); the same
    update is in the events log, and /metrics says where rank 1 is in gradwatch_finding_stack_info.
    With torch's Flight Recorder on (the collective case), the stacks carry its latest entries:
    rank 1's last all-reduce never completed."""
    recorder = {"TORCH_FR_BUFFER_SIZE": "64"} if fault == "collective" else {}
    job = Job(tmp_path, agg.endpoint, "--job", f"hang-{fault}", "--fault", fault, "--rank", "1", "--at", "15",
              "--steps", "1000", "--hold-s", "120", "--timeout-s", "150", env=recorder)
    try:
        f = stacks_finding(agg, f"hang-{fault}")
        stuck, healthy, at = f["details"]["stacks"]["stuck"], f["details"]["stacks"]["healthy"], f["details"]["stacks"]["differ_at"]
        assert f["rank"] == 1 and stuck["rank"] == 1 and healthy["rank"] == 0
        got = functions(stuck["frames"])
        line = source_line(function, text)
        assert ("controljob.py", function, line) in got, got
        assert ("controljob.py", "worker", source_line("worker", "load_batch(gen, step, a, rank)" if fault == "sleep"
                                                       else "sync_extra(rank, side)")) in got
        mine = functions(healthy["frames"])
        assert all(fr[1] != function for fr in mine), mine
        # they share the outer frames down to the training loop, and differ at the loop's line
        assert isinstance(at, int) and got[:at] == mine[:at] and got[at] != mine[at]
        assert got[at][:2] == mine[at][:2] == ("controljob.py", "worker")
        assert healthy["waiting"] and not stuck["waiting"]
        # no source lines unless the agent's stack_source is on
        assert all("source" not in fr for fr in stuck["frames"] + healthy["frames"])
        if recorder:
            last = stuck["flight"][-1]
            assert "all_reduce" in last[0] and last[1] != "completed", stuck["flight"]
            assert healthy["flight"] and "flight_error" not in stuck
        else:
            assert "flight" not in stuck
        events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert any(e["event"] == "updated" and e["check"] == "training_stalled" and
                   e["details"].get("stacks", {}).get("stuck", {}).get("rank") == 1 for e in events)
        info = wait_for(lambda: {k: v for k, v in samples(agg.scrape(), "gradwatch_finding_stack_info").items()
                                 if dict(k)["job_id"] == f"hang-{fault}"}, 20, what="gradwatch_finding_stack_info")
        (labels, value), = info.items()
        labels = dict(labels)
        assert value == 1.0 and labels["rank"] == "1" and labels["check"] == "training_stalled"
        top = stuck["frames"][-1]
        assert labels["frame"].endswith(f"{top['file'][-60:]}:{top['line']} {top['function']}")
    finally:
        job.kill()


def test_a_rank_whose_training_thread_holds_the_gil_is_named_silent_and_the_finding_says_why_no_stack_came(
        tmp_path, agg):
    """Rank 1 computes in one C call that holds the interpreter lock: its agent's thread cannot run,
    so it goes silent; rank_silent names it, and 5 s after asking, the finding says that no stack
    came from rank 1 because its training thread holds the GIL or its process is stopped, beside
    the healthy rank 0's stack."""
    job = Job(tmp_path, agg.endpoint, "--job", "gil", "--fault", "gil", "--rank", "1", "--at", "15",
              "--steps", "1000", "--hold-s", "60", "--timeout-s", "150")
    try:
        def found():
            return next((f for f in agg.findings("gil") if f["check"] == "rank_silent" and f["event"] == "updated"
                         and "stacks" in f["details"]), None)

        f = wait_for(found, 90, 0.25, what="the rank_silent finding updated with stacks")
        stacks = f["details"]["stacks"]
        assert f["rank"] == 1 and stacks["stuck"] == {"rank": 1, "frames": [], "error": "no answer"}
        assert stacks["differ_at"] == ("no answer from rank 1 within 5 s: its training thread holds the GIL, or the "
                                       "process is stopped")
        assert stacks["healthy"]["rank"] == 0 and ("controljob.py", "worker") in {
            (Path(fr["file"]).name, fr["function"]) for fr in stacks["healthy"]["frames"]}
    finally:
        job.kill()


def test_gradwatch_stacks_groups_a_healthy_jobs_ranks_into_one_stack(tmp_path, agg):
    """Every rank of a healthy 3-rank job pauses in the same evaluation function: ``gradwatch
    stacks`` prints one group of ranks 0-2 with that function innermost, at its line, and every
    rank answered; the token is required (without it: exit status 2, and the aggregator answers
    401 to a wrong one)."""
    job = Job(tmp_path, agg.endpoint, "--job", "healthy", "--fault", "pause", "--at", "20", "--hold-s", "60",
              "--steps", "40")
    cli = [sys.executable, "-m", "gradwatch.commands", "stacks", "--url", agg.base_url, "--job", "healthy"]
    try:
        def paused():
            out = subprocess.run(cli, capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "GRADWATCH_CONTROL_TOKEN": TOKEN})
            return out if out.returncode == 0 and out.stdout.startswith("ranks 0-2 (3)") and "evaluate" in out.stdout else None

        out = wait_for(paused, 90, 0.5, what="the three ranks paused in evaluate, in one group")
        text = out.stdout
        assert text.count("(3):") == 1 and "no answer" not in text, text
        frames = [line.strip() for line in text.splitlines()[1:] if line.startswith("    ")]
        assert frames[-1] == f"evaluate ({JOB_FILE}:{source_line('evaluate', 'time.sleep(a.hold_s)')})", text
        assert any(line.startswith("worker (") for line in frames)
        bare = subprocess.run(cli, capture_output=True, text=True, timeout=60,
                              env={k: v for k, v in os.environ.items() if k != "GRADWATCH_CONTROL_TOKEN"})
        assert bare.returncode == 2 and "GRADWATCH_CONTROL_TOKEN" in bare.stderr
        wrong = subprocess.run([*cli, "--token", "x" * 20], capture_output=True, text=True, timeout=60)
        assert wrong.returncode == 1 and "401" in wrong.stderr
    finally:
        job.kill()


def test_a_probe_burst_on_demand_reaches_every_rank_at_the_same_steps(tmp_path, agg):
    """A 3-rank job probing only step 0 on its cadence (every=100000): POST /api/probe for 6
    steps makes every rank acknowledge the same first step, probe exactly those 6 steps, and the
    aggregator reconcile them as 6 more complete rounds (none partial or incomplete)."""
    job = Job(tmp_path, agg.endpoint, "--job", "probe", "--every", "100000", "--steps", "400", "--sleep-s", "0.03")
    try:
        wait_for(lambda: samples(agg.scrape(), "gradwatch_rank_step").get((("job_id", "probe"), ("rank", "2")), 0) >= 30,
                 90, what="the job at step 30")
        r = requests.post(agg.base_url + "/api/probe", json={"job_id": "probe", "steps": 6, "wait_s": 10},
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert r.status_code == 200, r.text
        got = r.json()
        assert set(got["acks"]) == {"0", "1", "2"} and len(set(got["acks"].values())) == 1, got
        start = got["start"]
        assert got["acks"]["0"] == start and not got["refused"] and not got["no_answer"]
        job.wait()
        for k in range(3):
            assert job.info(k)["probed"] == [0, *range(start, start + 6)], (k, job.info(k)["probed"])
            assert job.info(k)["done"] == {"probe": 1}

        def rounds():
            s = samples(agg.scrape(), "gradwatch_rounds_total")
            return s if s.get((("job_id", "probe"), ("outcome", "complete"))) == 7 else None

        s = wait_for(rounds, 30, what="7 complete rounds")
        assert s[(("job_id", "probe"), ("outcome", "incomplete"))] == 0
        assert s[(("job_id", "probe"), ("outcome", "partial"))] == 0
    finally:
        job.kill()
