"""No foreign or malformed bytes can reset, hide or flood a job.

Each attack runs against a real aggregator (in this process, its receive thread and HTTP server)
over real ZeroMQ TCP sockets on loopback, beside a legitimate job whose metrics and findings must
not change. The attacker knows what ``/metrics`` shows: job ids, world sizes, ranks, steps; not the
job key its ranks share (``agent.config.job_key``) nor their boot ids.
"""

from __future__ import annotations

import hashlib
import platform
import time

import msgspec
import numpy as np
import pytest
import requests
import zmq

from gradwatch import wire
from gradwatch.agent.config import AgentConfig, job_key
from gradwatch.aggregator.checks import Thresholds
from gradwatch.aggregator.daemon import Aggregator
from gradwatch.aggregator.intake import BULK_SHARE, MAX_DROPPED_JOBS, PENDING, Intake
from gradwatch.aggregator.series import SERIES_PER_LAYER, SERIES_PER_MODULE
from gradwatch.aggregator.state import State

from .conftest import loopback, samples, wait_for
from .fakejob import MLP, FakeJob, Model, to_socket

PARAMS, SLOTS = MLP.params, MLP.slots


class Agent:
    """One rank's agent reduced to its wire messages (a rank of a :class:`FakeJob`), with the job
    key its peers share; each message goes to ``send`` (encoded onto ``sock``)."""

    def __init__(self, sock, job, rank, world, key, params=PARAMS, slots=SLOTS):
        self.send = to_socket(sock) if sock is not None else None
        self.fake = FakeJob(lambda msg: self.send(msg), job, world, Model(params, slots), key=key)
        self.rank, self.step = rank, -1

    @property
    def world(self) -> int:
        return self.fake.world

    @world.setter
    def world(self, n: int) -> None:  # a forger's claim
        self.fake.world = n

    def schema(self):
        self.fake.schema(self.rank)

    def heartbeat(self, closing=False, reason=""):
        self.fake.heartbeat(self.rank, self.step, closing=closing, reason=reason)

    def report(self, step, probe=False):
        self.step = step
        arrays = None
        if probe:
            rng = np.random.default_rng(step * 100 + self.rank)
            ns, npar = len(self.fake.model.slots), len(self.fake.model.params)
            arrays = dict(
                probe=True, act=np.abs(rng.standard_normal((ns, 6))).astype(np.float32) * [1, 1, 1, 1, 0, 0],
                act_grad=np.abs(rng.standard_normal((ns, 2))).astype(np.float32) * [1, 0],
                param=np.abs(rng.standard_normal((npar, 3))).astype(np.float32) * [1, 1, 0],
                fp_grad=np.zeros(npar, np.uint64), fp_weight=np.zeros(npar, np.uint64),
            )
        self.fake.report(self.rank, step, arrays=arrays)

    def restart(self):
        self.fake.restart(self.rank)


class Job:
    def __init__(self, sock, job="none", world=3, master=("10.0.0.1", "29500")):
        import os

        env = {"MASTER_ADDR": master[0], "MASTER_PORT": master[1], "TORCHELASTIC_RUN_ID": job}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            self.key = job_key(AgentConfig(), job, world)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        self.ranks = [Agent(sock, job, r, world, self.key) for r in range(world)]
        self.next = 0
        for a in self.ranks:
            a.schema()

    def steps(self, n, every=5):
        for _ in range(n):
            for a in self.ranks:
                a.report(self.next, probe=self.next % every == 0)
            self.next += 1
        for a in self.ranks:
            a.heartbeat()


#: the aggregator the attacks run against
SETTINGS = dict(
    round_grace_s=0.5, boot_takeover_s=2.0, max_series_per_job=120, max_series_total=1200, max_pending_jobs=8, max_jobs=4,
    # silence only where a test makes it: a loaded machine's pauses between a test's frames
    # and its scrape must not name the real ranks silent
    checks=Thresholds(silent_after_s=30, skew_steps=5, skew_for_s=0),
)


@pytest.fixture
def agg(local_aggregator):
    return local_aggregator(**SETTINGS)


@pytest.fixture
def sock(agg, push):
    return push(agg.endpoint)


def base(agg) -> str:
    return agg.metrics_url.rsplit("/", 1)[0]


def label(job: str, key: str) -> str:
    """The label of a second live job under ``job`` (aggregator.state's docstring)."""
    return f"{job}~{hashlib.blake2b(key.encode(), digest_size=8).hexdigest()[:4]}"


def scrape(agg) -> dict:
    text = requests.get(agg.metrics_url, timeout=5).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            out.setdefault(name, {}).update(samples(line + "\n", name))
    return out


def legit_view(m: dict, job="none") -> dict:
    """Every sample of the legitimate job but its wall-clock timestamps (NaN as a string)."""
    return {
        (name, k): "nan" if v != v else v for name, series in m.items() if "timestamp" not in name and "age_seconds" not in name
        for k, v in series.items() if ("job_id", job) in k
    }


def settle(agg, sock, job=None, n=None):
    """Wait until the aggregator has applied everything sent: a marker heartbeat of its own job,
    twice. The intake takes the jobs' frames in turn, so the first marker can be applied before
    frames of another job sent ahead of it; once it is and the intake is empty, those are in the
    writer's current batch, which is applied before the second marker's."""

    def mark():
        marker = wire.Header("settle-marker", 0, 1, "m", int(time.monotonic() * 1e6), 0.0)
        sock.send(wire.encode(wire.Heartbeat(marker, -1, 0, 0, 0)))
        wait_for(lambda: any(k.startswith("settle-marker") for k in agg.state.jobs)
                 and agg.state.jobs[[k for k in agg.state.jobs if k.startswith("settle-marker")][0]].ranks[0].last_seq == marker.seq,
                 10, what="the aggregator to drain")

    mark()
    wait_for(lambda: agg.intake.frames == 0, 10, what="the intake to empty")
    mark()

    def published():  # the snapshot scrapes read has caught up with the state's counts
        snap = agg.snapshot
        return dict(snap.received) == dict(agg.state.received) and dict(snap.rejected) == dict(agg.state.rejected)

    wait_for(published, 10, what="a snapshot of the drained state")
    time.sleep(0.1)  # and the scrape's own view of it


def rejected(m: dict) -> dict:
    return {dict(k)["reason"]: v for k, v in m.get("gradwatch_messages_rejected_total", {}).items()}


def forge(f: Agent, reason: str) -> None:
    """The forgeries /metrics makes possible, from ``f``: a world change, a report of step 0 and
    one of step 2**62, then a goodbye giving ``reason``."""
    f.world = 4
    f.heartbeat()
    f.world = 3
    f.report(0)
    f.report(2**62)
    f.heartbeat(closing=True, reason=reason)


def test_forged_frames_with_the_public_job_id_and_world_leave_the_real_job_alone(agg, sock):
    job = Job(sock)
    job.steps(12)
    settle(agg, sock)
    forge(Agent(sock, "none", 0, 3, key=""), "closed")  # knows /metrics: id, world, ranks; not the key
    settle(agg, sock)
    before = rejected(scrape(agg))
    # the strongest forger also knows the key: each frame is still rejected by reason
    for a in job.ranks:  # the real ranks are alive (their heartbeats come every second)
        a.heartbeat()
    insider = Agent(sock, "none", 1, 3, key=job.key)
    insider.world = 4
    insider.heartbeat()
    insider.world = 3
    insider.report(0)
    insider.restart()
    insider.report(2**62)
    insider.restart()
    insider.heartbeat(closing=True, reason="closed")
    job.steps(12)
    settle(agg, sock)
    m = scrape(agg)
    lv = legit_view(m)
    assert m["gradwatch_job_restarts_total"][(("job_id", "none"),)] == 0
    assert {dict(k)["rank"]: v for (n, k), v in lv.items() if n == "gradwatch_rank_step"} == {"0": 23, "1": 23, "2": 23}
    assert all(v == 0 for (n, k), v in lv.items() if n == "gradwatch_rank_restarts_total")
    assert {dict(k)["rank"]: v for (n, k), v in lv.items() if n == "gradwatch_rank_steps_total"} == {"0": 24, "1": 24, "2": 24}
    r = rejected(m)
    assert r.get("retired_boot", 0) == 0
    delta = {k: v - before.get(k, 0) for k, v in r.items() if v != before.get(k, 0)}
    assert delta == {"boot_conflict": 4}  # rank 1 is alive: no other boot may speak for it
    # the key-less forger's frames made a job of their own, labelled apart from the real one, and
    # not proven (no step advanced): it exports nothing
    lookalike = agg.state.jobs[label("none", "")]
    assert lookalike.name == "none" and not lookalike.proven
    assert [dict(k)["job_id"] for k in m["gradwatch_job_world_size"] if dict(k)["job_id"].startswith("none")] == ["none"]
    active = requests.get(base(agg) + "/api/findings?active=1&job_id=none", timeout=5).json()["findings"]
    assert active == []


def test_the_same_job_sent_again_with_and_without_forgeries_exports_the_same_series(agg, sock):
    """The legitimate job's every series (but timestamps, and the checks that judge its silence by
    the clock: training_stalled has no data once the job is unheard for 2 s) is the same with
    forgeries beside it."""
    job = Job(sock, job="clean")
    job.steps(11)
    settle(agg, sock)

    def view():
        return {k: v for k, v in legit_view(scrape(agg), "clean").items()
                if not {("check", "training_stalled"), ("check", "rank_silent")} & set(k[1])}

    before = view()
    for rank in range(3):
        forge(Agent(sock, "clean", rank, 3, key=""), "disabled")
    settle(agg, sock)
    after = view()
    assert after == before and any(n == "gradwatch_layer_grad_norm" for n, _ in after)


def test_two_honest_jobs_under_torchruns_default_id_stay_two_jobs(agg, sock):
    a = Job(sock, "none", world=3, master=("10.0.0.1", "29500"))
    b = Job(sock, "none", world=2, master=("10.0.0.2", "29500"))
    for _ in range(3):
        a.steps(4)
        b.steps(2)
    settle(agg, sock)
    m = scrape(agg)
    worlds = {dict(k)["job_id"]: v for k, v in m["gradwatch_job_world_size"].items()}
    label_b = label("none", b.key)
    assert worlds["none"] == 3 and worlds[label_b] == 2
    steps = m["gradwatch_rank_step"]
    assert steps[(("job_id", "none"), ("rank", "2"))] == 11 and steps[(("job_id", label_b), ("rank", "1"))] == 5
    assert m["gradwatch_job_restarts_total"][(("job_id", "none"),)] == 0
    assert m["gradwatch_job_restarts_total"][(("job_id", label_b),)] == 0
    assert rejected(m).get("retired_boot", 0) == 0


def test_a_relaunch_under_a_finished_jobs_id_takes_the_id_over():
    """GRADWATCH_JOB=x under a single-node torchrun: each launch picks a new MASTER_PORT, so a new
    key. A relaunch within rank_ttl_s came up as "x~<hex>"; once every process of the first ended
    (its ranks' goodbyes say so), it is "x" again. While one rank of the first is still live, or
    its agent was switched off while training goes on ("disabled"), the two stay two."""
    st = State(clock=Clock())

    def rep(key, rank, step, seq, world=2):
        return wire.Report(wire.Header("x", rank, world, f"{key}{rank}", seq, 0.0, key), "", step, 0.01, 1.0, 0)

    def bye(key, rank, seq, reason="finished"):
        return wire.Heartbeat(wire.Header("x", rank, 2, f"{key}{rank}", seq, 0.0, key), 5, seq, 0, 0, closing=True,
                              reason=reason)

    def label(key):
        return "x~" + hashlib.blake2b(key.encode(), digest_size=8).hexdigest()[:4]

    for r in range(2):
        st.apply(rep("first", r, 5, 0))
    st.apply(bye("first", 0, 1))
    st.apply(rep("second", 0, 0, 0))  # rank 1 of the first is still live: two jobs
    assert sorted(st.jobs) == ["x", label("second")]
    st.apply(bye("first", 1, 1, reason="disabled"))  # its agent switched off, training goes on
    st.apply(rep("third", 0, 0, 0))
    assert st.jobs["x"].key == "first" and label("third") in st.jobs
    st.apply(bye("first", 1, 2, reason="exit"))  # now its process ended too
    st.apply(rep("fourth", 0, 0, 0))  # the first job finished: the relaunch is "x"
    assert st.jobs["x"].key == "fourth" and st.labels[("x", "fourth")] == "x" and ("x", "first") not in st.labels
    # README's snippet ends with monitor.close(): every rank's "closed" ends the job too (else the
    # relaunch would show as "x~<hex>" until rank_ttl_s)
    for r in range(2):
        st.apply(rep("fourth", r, 5, 1 + r))
        st.apply(bye("fourth", r, 3 + r, reason="closed"))
    st.apply(rep("fifth", 0, 0, 0))
    assert st.jobs["x"].key == "fifth" and label("fifth") not in st.jobs
    # with CURVE, only the key that created the finished job relaunches it under its id
    st = State(clock=Clock())
    for r in range(2):
        st.apply(rep("first", r, 5, 0), peer_key="K1")
        st.apply(bye("first", r, 1), peer_key="K1")
    st.apply(rep("other", 0, 0, 0), peer_key="K2")
    assert st.jobs["x"].key == "first" and label("other") in st.jobs
    st.apply(rep("again", 0, 0, 0), peer_key="K1")
    assert st.jobs["x"].key == "again" and st.jobs["x"].peer_key == "K1"


def test_a_real_restart_of_most_ranks_is_believed_and_an_elastic_shrink_too(local_aggregator, push):
    # a restart is believed once the old boots were silent for boot_takeover_s: the test waits that long
    agg = local_aggregator(**{**SETTINGS, "boot_takeover_s": 0.5})
    sock = push(agg.endpoint)
    job = Job(sock, "elastic", world=3)
    job.steps(20)
    settle(agg, sock)
    time.sleep(agg.cfg.boot_takeover_s)  # the old processes died
    for a in job.ranks:  # torchelastic restarts every rank from the checkpoint at step 10
        a.restart()
        a.schema()
    job.next = 10
    job.steps(5)
    settle(agg, sock)
    m = scrape(agg)
    assert m["gradwatch_job_restarts_total"][(("job_id", "elastic"),)] == 1
    assert {dict(k)["rank"]: v for k, v in m["gradwatch_rank_step"].items() if ("job_id", "elastic") in k} == {"0": 14, "1": 14, "2": 14}
    # the job comes back with two ranks (a node lost): both new ranks agree on world 2
    time.sleep(agg.cfg.boot_takeover_s)
    job.ranks = [Agent(sock, "elastic", r, 2, job.key) for r in range(2)]
    for a in job.ranks:
        a.schema()
    job.next = 10
    job.steps(3)
    settle(agg, sock)
    m = scrape(agg)
    assert m["gradwatch_job_world_size"][(("job_id", "elastic"),)] == 2
    assert m["gradwatch_job_restarts_total"][(("job_id", "elastic"),)] == 2


def test_cardinality_is_capped_per_job_and_the_other_jobs_scrape_is_whole(agg, sock):
    job = Job(sock, "small")
    job.steps(6)
    # 20,000 names: over max_names, the schema is rejected whole
    big = [(f"m{i}", "", "Linear", "float32") for i in range(20_000)]
    Agent(sock, "bomb", 0, 1, "", params=(), slots=tuple(big)).schema()
    # under max_names, with long names: exported up to max_series_per_job (120 here) and counted
    slots = tuple((f"{'deep.' * 100}m{i}", "", "Linear", "float32") for i in range(50))
    params = tuple((f"{'deep.' * 100}m{i}.weight", (2,), "float32") for i in range(50))
    wide = Agent(sock, "wide", 0, 1, "", params=params, slots=slots)
    wide.schema()
    for step in range(3):  # three steps: proven
        wide.report(step, probe=True)
    settle(agg, sock)
    # all jobs together stay under max_series_total (1,200 here, every family): the running jobs keep theirs
    wide2 = Agent(sock, "wide2", 0, 1, "", params=params, slots=slots)
    wide2.schema()
    for step in range(3):
        wide2.report(step, probe=True)
    job.steps(5)
    settle(agg, sock)
    m = scrape(agg)
    assert rejected(m).get("malformed", 0) + rejected(m).get("bad_field", 0) >= 1 and "bomb" not in {dict(k)["job_id"] for k in m["gradwatch_job_world_size"]}
    layer_series = [k for n, s in m.items() if n.startswith("gradwatch_layer_") for k in s if ("job_id", "wide") in k]
    assert 0 < len(layer_series) <= 120
    dropped = m["gradwatch_job_series_dropped"][(("job_id", "wide"),)]
    total = 50 * SERIES_PER_LAYER + 50 * SERIES_PER_MODULE
    # the cap counts every declared statistic; the scrape leaves out NaN ones (this agent sends no call counts)
    assert dropped == total - agg.state.jobs["wide"].exported_series
    assert len(layer_series) <= agg.state.jobs["wide"].exported_series
    assert all(len(dict(k)["layer"]) <= 200 for k in layer_series)
    small = [k for n, s in m.items() if n.startswith("gradwatch_layer_") for k in s if ("job_id", "small") in k]
    assert len(small) == 3 * 24 + 2 * 9  # 3 slots x 8 stats x 3 aggs (no call counts from this agent), 2 modules x 3 stats x 3 aggs
    wide2 = [k for n, s in m.items() if n.startswith("gradwatch_layer_") for k in s if ("job_id", "wide2") in k]
    assert len(wide2) <= 1200 - len(small) - len(layer_series)
    assert sum(len(series) for series in m.values()) <= 1200
    assert m["gradwatch_job_series_dropped"][(("job_id", "wide2"),)] == total - agg.state.jobs["wide2"].exported_series


def test_invented_job_ids_cannot_squat_slots(agg, sock):
    for i in range(100):  # max_pending_jobs 8, max_jobs 4
        Agent(sock, f"fake{i}", 0, 2, "").heartbeat()
    settle(agg, sock)
    job = Job(sock, "real")
    job.steps(6)
    settle(agg, sock)
    m = scrape(agg)
    assert m["gradwatch_rank_step"][(("job_id", "real"), ("rank", "0"))] == 5
    assert m["gradwatch_jobs_evicted_total"][()] >= 90 and rejected(m).get("too_many_jobs", 0) == 0
    assert len(agg.state.jobs) <= 8 + 4


def test_a_flood_of_invented_ids_without_schemas_churns_among_itself_and_a_starting_job_keeps_its_schemas():
    """Pending jobs without a schema are evicted first (least recently heard among them): a job
    whose ranks sent their schemas and wait for their first step outlasts any number of invented
    ids that send none, and is admitted by its first step without a schema resend. Among jobs with
    schemas the least recently heard goes (ranks heard are no measure: a squatter claims any number)."""
    clock = Clock()
    st = State(clock=clock, max_pending_jobs=4)
    params = (("fc1.weight", (8, 4), "float32"),)
    sch = wire.Schema(wire.Header("real", 0, 2, "b0", 0, 0.0, "k"), "node", 0, 1, params, SLOTS)
    st.apply(sch)
    for i in range(100):  # heartbeats and reports from invented ids, each newer than the real job
        clock.t += 0.01
        h = wire.Header(f"fake{i}", 0, 2, "x", 0, 0.0, "k")
        st.apply(wire.Heartbeat(h, -1, 0, 0, 0) if i % 2 else wire.Report(h, "f" * 16, 0, 0.01, 1.0, 0))
        assert "real" in st.jobs and len([j for j in st.jobs.values() if not j.admitted]) <= 4
    assert st.jobs_evicted == 100 - 3
    st.apply(msgspec.structs.replace(sch, header=wire.Header("real", 1, 2, "b1", 0, 0.0, "k")))
    for r in range(2):
        st.apply(wire.Report(wire.Header("real", r, 2, f"b{r}", 1, 0.0, "k"), sch.hash, 0, 0.01, 1.0, 0))
    job = st.jobs["real"]
    assert job.admitted and job.ranks[1].step == 0 and st.rejected["unknown_schema"] == 0
    # pending jobs with schemas: the least recently heard goes, however many ranks it claims
    st = State(clock=clock, max_pending_jobs=2)
    for r in range(2):
        st.apply(msgspec.structs.replace(sch, header=wire.Header("many", r, 2, f"b{r}", 0, 0.0, "k")))
    clock.t += 1
    for name in ("new", "newer"):
        st.apply(msgspec.structs.replace(sch, header=wire.Header(name, 0, 2, "x", 0, 0.0, "k")))
    assert set(st.jobs) == {"new", "newer"}


def test_a_rank_whose_agent_stops_while_its_peers_go_on_is_named(agg, sock):
    job = Job(sock, "blind")
    job.steps(10)
    job.ranks[2].heartbeat(closing=True, reason="disabled")  # switched off after errors
    stopped = job.ranks.pop()
    for _ in range(10):
        for a in job.ranks:
            a.report(job.next)
        job.next += 1
    for a in job.ranks:
        a.heartbeat()

    def named():
        f = requests.get(base(agg) + "/api/findings?active=1&job_id=blind", timeout=5).json()["findings"]
        return [x for x in f if x["check"] == "rank_silent" and x["rank"] == 2]

    (f,) = wait_for(named, 10, what="the stopped agent named")
    assert f["details"]["reason"] == "disabled" and f["details"]["last_step"] == 9
    # a job that ends together (every rank says goodbye at its last step) is not a finding
    done = Job(sock, "done")
    done.steps(10)
    for a in done.ranks:
        a.heartbeat(closing=True, reason="finished")
    settle(agg, sock)
    time.sleep(0.3)
    f = requests.get(base(agg) + "/api/findings?active=1&job_id=done", timeout=5).json()["findings"]
    assert f == [] and stopped.step == 9


# --- the state's rules, without sockets ----------------------------------------------------------


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _rep(rank, step, boot, world=3, seq=0, key="k"):
    return wire.Report(wire.Header("j", rank, world, boot, seq, 0.0, key), "", step, 0.01, 1.0, 0)


def test_restart_needs_half_the_world_or_the_old_ranks_silent():
    clock = Clock()
    st = State(clock=clock, restart_grace_s=5)
    for s in range(20):
        for r in range(4):
            st.apply(_rep(r, s, f"old{r}", world=4, seq=s))
    clock.t += st.limits.boot_takeover_s  # the old processes died
    st.apply(_rep(0, 3, "new0", world=4))
    assert st.jobs["j"].restarts == 0 and st.rejected["restart_unconfirmed"] == 1
    st.apply(_rep(1, 3, "new1", world=4))  # half of 4: believed
    assert st.jobs["j"].restarts == 1 and st.jobs["j"].retired == {"old0", "old1", "old2", "old3"}
    # one rank alone resumes earlier, the others silent past the grace: believed too
    clock.t += st.limits.boot_takeover_s
    for r in range(4):
        st.apply(_rep(r, 10, f"mid{r}", world=4, seq=1))
    clock.t += 6
    st.apply(_rep(3, 4, "late3", world=4))
    assert st.jobs["j"].restarts == 2
    # a job only one live rank of which was heard yet: a forged vote for that rank is no restart
    st = State(clock=clock, restart_grace_s=5)
    st.apply(_rep(0, 10, "real0", world=4))
    st.apply(_rep(0, 0, "forged", world=4))
    assert st.jobs["j"].restarts == 0 and st.rejected["boot_conflict"] == 1  # real0 is alive
    clock.t += st.limits.boot_takeover_s  # silent, but not yet for restart_grace_s
    st.apply(_rep(0, 0, "forged", world=4))
    assert st.jobs["j"].restarts == 0 and st.rejected["restart_unconfirmed"] == 1


def test_step_jumps_are_judged_by_the_ranks_rate():
    clock = Clock()
    st = State(clock=clock, max_step_jump=1000)
    for s in range(100):
        st.apply(_rep(0, s, "b", world=1, seq=s))
        clock.t += 0.01  # 100 steps/s
    st.apply(_rep(0, 1099, "b", world=1, seq=100))  # within max_step_jump
    assert st.rejected["step_jump"] == 0
    st.apply(_rep(0, 2**62, "b", world=1, seq=101))
    assert st.rejected["step_jump"] == 1 and st.jobs["j"].ranks[0].step == 1099
    clock.t += 60  # a minute at 100 steps/s explains 6,000 steps; 10x that is plausible
    st.apply(_rep(0, 1099 + 50_000, "b", world=1, seq=102))
    assert st.rejected["step_jump"] == 1 and st.jobs["j"].ranks[0].step == 51_099


def test_a_jobs_open_rounds_hold_at_most_max_pending_bytes():
    st = State(clock=Clock(), max_pending_bytes=1 << 20)
    n = 2000
    params = tuple((f"p{i}.w", (1,), "float32") for i in range(n))
    sch = wire.Schema(wire.Header("j", 0, 64, "b0", 0, 0.0), "h", 0, 1, params, ())
    st.apply(sch)
    per_report = n * (12 + 16)
    for step in range(200):  # rank 0 alone: every round waits for 63 missing ranks
        st.apply(wire.Report(
            wire.Header("j", 0, 64, "b0", step + 1, 0.0), sch.hash, step, 0.01, 1.0, 0, probe=True,
            act=np.zeros((0, 6), np.float32), act_grad=np.zeros((0, 2), np.float32),
            param=np.zeros((n, 3), np.float32), fp_grad=np.zeros(n, np.uint64), fp_weight=np.zeros(n, np.uint64),
        ))
        job = st.jobs["j"]
        assert job.pending_bytes == sum(r.nbytes for r in job.rounds.values()) <= 1 << 20
    assert len(job.rounds) == (1 << 20) // per_report and job.rounds_incomplete == 200 - len(job.rounds)


def test_frames_under_a_jobs_identity_cannot_make_it_hold_schemas_without_bound_between_scans():
    """The TTL scan drops unused schemas once a second; between scans, 4 per rank of the world plus
    64 is the most an admitted job holds: a flood of distinct schemas is rejected past it
    (schema_limit), and a rank's real change of model still finds room."""
    clock = Clock()
    st = State(clock=clock, max_pending=256)

    def schema(rank, seq, n_params):
        params = tuple((f"p{i}.weight", (4,), "float32") for i in range(n_params))
        return wire.Schema(wire.Header("j", rank, 3, f"b{rank}", seq, 0.0, "k"), "node", rank, 1, params, SLOTS)

    real = schema(0, 0, 3)
    for r in range(3):
        st.apply(msgspec.structs.replace(real, header=wire.Header("j", r, 3, f"b{r}", 0, 0.0, "k")))
        st.apply(wire.Report(wire.Header("j", r, 3, f"b{r}", 1, 0.0, "k"), real.hash, 0, 0.01, 1.0, 0))
    job = st.jobs["j"]
    assert job.admitted and list(job.schemas) == [real.hash]
    cap = 4 * 3 + 64
    for i in range(500):  # rank 2's identity, a new schema every frame, no tick in between
        st.apply(schema(2, 2 + i, 4 + i))
        assert len(job.schemas) <= cap  # the superseded ones are dropped at the cap
    assert st.rejected["schema_limit"] == 0
    seq = 600
    for i in range(100):  # each schema used by a probe report in a round still open: all in use
        n = 2000 + i
        sch = schema(2, seq, n)
        st.apply(sch)
        st.apply(wire.Report(
            wire.Header("j", 2, 3, "b2", seq + 1, 0.0, "k"), sch.hash, 10 + i, 0.01, 1.0, 0, probe=True,
            act=np.zeros((len(SLOTS), 6), np.float32), act_grad=np.zeros((len(SLOTS), 2), np.float32),
            param=np.zeros((n, 3), np.float32), fp_grad=np.zeros(n, np.uint64), fp_weight=np.zeros(n, np.uint64)))
        seq += 2
        assert len(job.schemas) <= cap
    assert st.rejected["schema_limit"] > 0 and len(job.rounds) > cap - 3
    assert real.hash in job.schemas and job.ranks[0].schema == real.hash  # the other ranks' is kept
    clock.t += st.limits.grace_s  # the rounds close incomplete, and the scan drops the schemas they held
    st.tick()
    assert not job.rounds and len(job.schemas) <= 3
    changed = schema(1, 2, 1000)  # rank 1 changes its model
    st.apply(changed)
    assert job.ranks[1].schema == changed.hash and changed.hash in job.schemas
    st.apply(wire.Report(wire.Header("j", 1, 3, "b1", 3, 0.0, "k"), changed.hash, 1, 0.01, 1.0, 0))
    assert job.ranks[1].step == 1


def test_placed_copies_count_toward_the_schema_cap_and_a_pending_job_keeps_its_ranks_schemas():
    """A mesh rank's place makes a placed copy of its schema: a rank of an admitted job moving
    from coordinate to coordinate leaves at most the cap of them between scans. A pending job
    keeps the schemas of ranks it has no room for until it is admitted (the scan leaves them)."""
    clock = Clock()
    st = State(clock=clock)
    msh = wire.Mesh(("dp", "tp"), (1000, 1000))
    ranks = FakeJob(st.apply, "j", 2, Model((("w", (8, 4), "float32"),), SLOTS), every=1, host="n", clock=lambda: 0.0,
                    boots=["b0", "b1"], key="k")
    for r in range(2):
        ranks.coord[r] = (r, 0)
        (sch,) = ranks.schema(r, local_rank=lambda r: 0, mesh=msh, shard=((1,),))
        ranks.report(r, 0, step_time=0.01, grad_sq=(((1,), 1.0),))
    job = st.jobs["j"]
    assert job.admitted
    for i in range(3000):  # rank 1's heartbeats, each at another point of the mesh, no tick between
        ranks.coord[1] = (1 + i % 999, i // 999)
        ranks.heartbeat(1, 0, sent=0, schema=sch.hash)
        assert len(job.schemas) <= 4 * 2 + 64
    assert job.ranks[1].schema == f"{sch.hash}@{1 + 2999 % 999},{2999 // 999}" and job.ranks[0].schema in job.schemas
    # a pending job: ranks 2 and 3 have no room (max_pending_ranks 2), their stages' schemas are kept
    st = State(clock=clock, max_pending_ranks=2)
    stages = [wire.Schema(wire.Header("p", r, 4, f"b{r}", 0, 0.0, "k"), "n", 0, 1, ((f"stage{r}", (4,), "float32"),), SLOTS)
              for r in range(4)]
    for s in stages:
        st.apply(s)
    clock.t += 2
    st.tick()  # the once-a-second scan
    assert len(st.jobs["p"].schemas) == 4
    for r in range(4):
        st.apply(wire.Report(wire.Header("p", r, 4, f"b{r}", 1, 0.0, "k"), stages[r].hash, 0, 0.01, 1.0, 0))
    job = st.jobs["p"]
    assert job.admitted and [job.ranks[r].schema for r in range(4)] == [s.hash for s in stages]
    assert st.rejected["unknown_schema"] == 0


def test_a_pending_jobs_step_table_is_small_whatever_world_its_frames_claim():
    """A record without a schema, under an invented id claiming 65,536 ranks, made a step table
    of 64 x 65,536 cells (~240 MB, four times MAX_CELLS) for a frame of ~300 bytes; sixteen such
    ids held ~3.8 GB. A job's table holds PENDING_CELLS until it is proven; then MAX_CELLS, and
    its records from before the schema are still judged (tests/test_checks_consistency.py)."""
    from gradwatch.aggregator.steps import MAX_CELLS, PENDING_CELLS

    st = State(clock=Clock(), proof_rank_share=0.001)  # proven by two ranks of 1,024
    for i in range(16):
        st.apply(wire.Report(wire.Header(f"ghost{i}", 0, 65536, "b", 0, 0.0, ""), "nope", 0, 0.01, 1.0, 0))
    tables = [j.table for j in st.jobs.values()]
    assert len(tables) == 16 and all(not j.admitted for j in st.jobs.values())
    held = sum(t.have.nbytes + sum(a.nbytes for a in t.cols.values()) for t in tables)
    assert all(t.max_rows * t.world <= PENDING_CELLS for t in tables) and held < 16 * 5 * 2**20
    # a job of 1,024 ranks: its records before its schema wait in a small table, which takes the
    # full size once the job is proven
    sch = wire.Schema(wire.Header("big", 0, 1024, "b0", 0, 0.0, "k"), "n", 0, 1, (("w", (4,), "float32"),), SLOTS)
    st.apply(wire.Report(wire.Header("big", 1, 1024, "b1", 0, 0.0, "k"), sch.hash, 0, 0.01, 1.0, 0))
    job = st.jobs["big"]
    assert job.table.max_rows == PENDING_CELLS // 1024
    st.apply(sch)
    st.apply(wire.Report(wire.Header("big", 0, 1024, "b0", 1, 0.0, "k"), sch.hash, 0, 0.01, 1.0, 0))
    assert job.admitted and job.table.max_rows == PENDING_CELLS // 1024 and job.table.pending == 1
    assert job.table.count[0] == 2  # both ranks' records of step 0 wait together
    for step in (1, 2, 3):
        for r in (0, 1):
            st.apply(wire.Report(wire.Header("big", r, 1024, f"b{r}", 1 + step, 0.0, "k"), sch.hash, step, 0.01, 1.0, 0))
    assert job.proven and job.table.max_rows == MAX_CELLS // 1024 and job.table.count[0] == 2


def test_records_of_steps_sent_before_count_once():
    """A batch sent again, or overlapping the rank's last one, counted its steps, non-finite steps
    and skipped steps again, while the step table kept each step once: 15 steps sent, 20 counted."""
    st = State(clock=Clock())
    rank = FakeJob(st.apply, "j", 1, Model((("w", (4,), "float32"),), SLOTS), every=1, host="n", clock=lambda: 0.0,
                   boots=["b0"], key="k")
    rank.schema()

    def rec(step):  # step 7 had a non-finite gradient, step 8 was skipped (AMP)
        return rank.record(0, step, 1.0, int(step == 7), step_time=0.01, skipped=int(step == 8))

    rank.steps(0, [rec(s) for s in range(10)])
    rank.steps(0, [rec(s) for s in range(5, 15)])
    st.apply(rec(14))  # one record, sent again
    r = st.jobs["j"].ranks[0]
    assert (r.step, r.steps, r.nonfinite_steps, r.skipped_steps) == (14, 15, 1, 1)


def test_the_job_key_tells_jobs_apart_and_survives_restarts(monkeypatch):
    cfg = AgentConfig()
    for var in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)

    def key(job, world, **env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        return job_key(cfg, job, world)

    # torchrun's static rendezvous under the default run id: the master address tells jobs apart
    a = key("none", 8, TORCHELASTIC_RUN_ID="none", MASTER_ADDR="node1", MASTER_PORT="29500")
    b = key("none", 8, MASTER_ADDR="node7")
    assert a != b and a == key("none", 8, MASTER_ADDR="node1") and len(a) == 16
    # an elastic run id names one job: a new rendezvous round (port, world size) keeps its key
    c = key("run-42", 8, TORCHELASTIC_RUN_ID="run-42", MASTER_ADDR="node1", MASTER_PORT="40001")
    assert c == key("run-42", 6, MASTER_ADDR="node3", MASTER_PORT="51234")
    # a key of one's own wins; a lone process without a launcher is itself
    own = AgentConfig(job_key="s3cret")
    assert job_key(own, "none", 8) == job_key(own, "other", 3) != a
    for var in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var)
    assert key("default", 1) != key("default", 2)


def test_real_agents_a_closed_one_is_named_with_its_reason_while_its_peer_trains_on(agg):
    import torch

    import gradwatch.agent as gw

    models = [torch.nn.Linear(4, 1) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    mons = [gw.attach(m, o, endpoint=agg.endpoint, job="pair", rank=r, world_size=2, every=1, heartbeat_s=0.2)
            for r, (m, o) in enumerate(zip(models, opts))]
    assert mons[0].job_key == mons[1].job_key and len(mons[0].job_key) == 16

    def step(k):
        models[k](torch.ones(2, 4)).sum().backward()
        opts[k].step()
        opts[k].zero_grad()

    try:
        for _ in range(3):
            step(0)
            step(1)
        mons[1].close()  # its training would go on, unmonitored
        for _ in range(12):
            step(0)

        def named():
            f = requests.get(base(agg) + "/api/findings?active=1&job_id=pair", timeout=5).json()["findings"]
            return [x for x in f if x["check"] == "rank_silent" and x["rank"] == 1]

        (f,) = wait_for(named, 20, what="the closed agent named")
        assert f["details"]["reason"] == "closed" and f["details"]["last_step"] == 2
        assert "pair" in agg.state.jobs and agg.state.jobs["pair"].key == mons[0].job_key
    finally:
        for m in mons:
            m.close()


def test_a_rank_back_from_a_long_gap_or_catching_up_with_its_peers_is_no_step_jump():
    clock = Clock()
    st = State(clock=clock, max_step_jump=1000)
    st.apply(_rep(0, 0, "a", world=2))
    clock.t += 10  # one report, then its reports were lost for 10 s: rate unknown, 1,000 steps/s assumed
    st.apply(_rep(0, 5000, "a", world=2, seq=1))
    st.apply(_rep(1, 5000, "b", world=2))  # a rank heard for the first time, level with its peer
    assert st.rejected["step_jump"] == 0 and {r.step for r in st.jobs["j"].ranks.values()} == {5000}
    st.apply(_rep(1, 2**62, "b", world=2, seq=1))
    st.apply(wire.Heartbeat(wire.Header("j", 1, 2, "b", 2, 0.0, "k"), 2**40, 0, 0, 0))
    assert st.rejected["step_jump"] == 2


def _live_job(world: int, steps: int):
    """A State (restart_grace_s 5, boot_takeover_s 3) whose ``world`` ranks reported steps
    0..steps-1, 0.1 s apart: ``(clock, state, real)``, ``real(step)`` every rank's next report."""
    clock = Clock()
    st = State(clock=clock, restart_grace_s=5, boot_takeover_s=3)
    seq = [0] * world

    def real(step):
        for r in range(world):
            seq[r] += 1
            st.apply(_rep(r, step, f"real{r}", world=world, seq=seq[r]))

    for s in range(steps):
        real(s)
        clock.t += 0.1
    return clock, st, real


def test_a_forged_majority_restart_of_a_live_job_changes_nothing():
    """A forger who knows the key forges restart votes from half the ranks: the real ranks are
    alive, so every forged frame is a boot_conflict, no restart happens and the real ranks are
    never locked out. Should the forged votes come while the ranks are silent (but not dead for
    restart_grace_s), the ranks returning under their own boots are heard again after the grace."""
    clock, st, real = _live_job(4, 50)
    st.apply(_rep(0, 0, "forged0", world=4))
    st.apply(_rep(1, 0, "forged1", world=4))
    assert st.jobs["j"].restarts == 0 and st.rejected["boot_conflict"] == 2
    real(50)
    assert {r: x.step for r, x in st.jobs["j"].ranks.items()} == {0: 50, 1: 50, 2: 50, 3: 50}
    clock.t += 3.5  # a pause in which the ranks said nothing (a long checkpoint)
    st.apply(_rep(0, 0, "forged0", world=4))
    st.apply(_rep(1, 0, "forged1", world=4))
    assert st.jobs["j"].restarts == 1
    real(51)
    assert st.rejected["retired_boot"] == 4
    clock.t += 6
    for s in range(52, 56):
        real(s)
    job = st.jobs["j"]
    assert {r: x.step for r, x in job.ranks.items()} == {0: 55, 1: 55, 2: 55, 3: 55}
    assert st.rejected["retired_boot"] == 4 and st.rejected["step_jump"] == 0


def test_ranks_past_a_live_jobs_world_have_no_restart_vote():
    """A forger who knows the key claims a doubled world from ranks the job does not have (no
    live boot to conflict with): half of the doubled world once restarted the job, retired the
    real ranks' boots and named a rank that does not exist silent. Only the job's own ranks vote;
    an elastic growth is still believed when half of them restart under the new world."""
    clock, st, real = _live_job(3, 30)
    for r in range(3, 6):
        st.apply(_rep(r, 0, f"forged{r}", world=6))
    job = st.jobs["j"]
    assert job.world == 3 and job.restarts == 0 and st.rejected["world_mismatch"] == 3 and not job.votes
    real(30)
    assert {r: x.step for r, x in job.ranks.items()} == {0: 30, 1: 30, 2: 30} and st.rejected["retired_boot"] == 0
    # the job itself grows to 6 (an elastic restart): its old ranks restart under the new world
    clock.t += 3.5
    st.apply(_rep(3, 0, "grown3", world=6))  # a new rank first: no vote
    st.apply(_rep(0, 0, "grown0", world=6))
    assert job.restarts == 0
    st.apply(_rep(1, 0, "grown1", world=6))  # 2 of 3: believed
    job = st.jobs["j"]
    assert job.world == 6 and job.restarts == 1
    for r in range(6):
        st.apply(_rep(r, 1, f"grown{r}", world=6, seq=1))
    assert sorted(job.ranks) == list(range(6)) and all(x.step == 1 for x in job.ranks.values())


def test_memory_under_overload_is_bounded_for_all_agents_together():
    """The writer stalls (a slow disk, a huge scrape) while 16 agents flood it: received frames
    wait in the intake, which never holds more than max_intake_bytes whatever the number of
    connections; the excess is dropped and counted (reason overload), and once the writer is back
    every frame kept is handled: handled + overload = every frame ZeroMQ delivered."""
    import threading

    cfg = loopback(max_message_bytes=1 << 20, max_intake_bytes=1 << 20, max_intake_frames=1_000_000, rcv_hwm=100_000)
    agg = Aggregator(cfg)
    stalled, handled = threading.Event(), [0]
    go = threading.Event()
    real_handle = agg.handle

    def slow_handle(frame, *sender):
        if not go.is_set():
            stalled.set()
            go.wait(60)
        handled[0] += 1
        real_handle(frame, *sender)

    agg.handle = slow_handle
    agg.start()
    ctx = zmq.Context()
    peers, socks, sent = [], [], 0
    try:
        for i in range(16):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 100_000)
            s.connect(agg.endpoint)
            socks.append(s)
            peers.append(Agent(s, f"flood{i}", 0, 1, ""))
        peers[0].heartbeat()
        assert stalled.wait(10), "the writer never took the first frame"
        peak = 0
        for _ in range(200):
            for p in peers:
                for _ in range(10):
                    p.heartbeat()  # ~150 bytes each: 16 x 2,000 x 150 = 4.8 MB offered
                    sent += 1
            peak = max(peak, agg.intake.bytes)
        wait_for(lambda: agg.intake.dropped > 0, what="frames dropped past the intake's budget")
        time.sleep(0.5)  # whatever ZeroMQ still buffers reaches the intake
        peak = max(peak, agg.intake.bytes)
        assert peak <= 1 << 20
        go.set()
        wait_for(lambda: handled[0] + agg.intake.dropped == sent + 1, 30, what="every frame handled or counted")
        wait_for(lambda: agg.state.rejected["overload"] == agg.intake.dropped and agg.state.received["heartbeat"] == handled[0],
                 what="overload counted by the writer")
        m = samples(requests.get(agg.metrics_url, timeout=5).text, "gradwatch_messages_rejected_total")
        assert m[(("reason", "overload"),)] == agg.intake.dropped > 0
        # and at most max_intake_frames wait: how far behind what /metrics shows may fall
        small = Intake(1 << 30, 4)
        small.put([(b"x", None)] * 5)  # past half, one sender holds its share: half, the rest for others
        assert (len(small.take(10)), small.dropped, small.bytes) == (2, 3, 0)
    finally:
        go.set()
        for s in socks:
            s.close(0)
        ctx.term()
        agg.stop()


def _frames(job: str, n: int, key: str = "") -> list:
    h = wire.Header(job, 0, 1, "b", 0, 0.0, key)
    return [(wire.encode(wire.Heartbeat(msgspec.structs.replace(h, seq=i), i, i, 0, 0)), None) for i in range(n)]


def test_a_job_flooding_the_intake_loses_its_own_frames_not_another_jobs():
    """The intake's room is shared among jobs once it is half full. A job sending ten
    times what fits keeps at most its share; jobs arriving after it, however full the intake, get
    theirs (the flooder's oldest frames make room), and so do frames without a readable header,
    in the queue of every frame of no admitted job (PENDING). The writer takes from the jobs in
    turn, each in order."""
    intake = Intake(1 << 30, 1000)
    intake.admit(frozenset((None, job) for job in [("flood", ""), ("quiet", ""), ("late", ""), ("flood", "other")]))
    intake.put(_frames("flood", 10_000))
    assert intake.held == {(None, ("flood", "")): 500} and intake.dropped == 9_500
    intake.put(_frames("quiet", 200))
    intake.put(_frames("late", 150))
    intake.put([(b"\xc1" * 10, None)] * 500)  # garbage: nobody's, and capped like a job
    intake.put(_frames("flood", 50, key="other"))  # the same id under another key is another job
    held = intake.held
    assert held[(None, ("quiet", ""))] == 200 and held[(None, ("late", ""))] == 150
    assert held[(None, ("flood", "other"))] == 50 and 0 < held[PENDING] < 500
    assert sum(held.values()) <= 1000 and held[(None, ("flood", ""))] < 500
    first = intake.take(10)
    assert len({wire.peek(f) for f, _ in first}) == 5  # the jobs in turn
    rest = intake.take(10**6)
    quiet = [wire.decode(f).header.seq for f, _ in first + rest if wire.peek(f) == ("quiet", "")]
    assert quiet == list(range(200))  # a job's frames in order
    assert intake.bytes == intake.frames == 0 and not intake.held and not intake.ready.is_set()
    assert intake.dropped + len(first + rest) == 10_000 + 200 + 150 + 500 + 50  # each frame taken or counted


def test_invented_job_ids_share_one_queue_of_the_intake_and_cannot_starve_an_admitted_job():
    """Every identity holding no slot (a job not admitted yet, an invented id, a frame without a
    readable header) shares the intake's PENDING queue: were each invented id a job of its own,
    10,000 ids each sending a frame would divide the intake into 10,001 shares, and an admitted
    job under overload would keep almost none of its frames (2 of 300 here). A job's frames that
    waited in PENDING move to its own queue, in order, once it is admitted."""
    intake = Intake(1 << 30, 1000)
    real = (None, ("real", ""))
    intake.put(_frames("real", 10))  # the job's first frames, before it holds a slot
    assert intake.held == {PENDING: 10}
    intake.admit(frozenset({real}))
    assert intake.held == {real: 10}
    intake.put([f for i in range(10_000) for f in _frames(f"sybil{i}", 1)])
    assert intake.held[PENDING] <= 500 and intake.dropped >= 9_500
    before = intake.dropped
    intake.put(_frames("real", 300)[10:])
    assert intake.dropped == before and intake.held[real] == 300  # within its share: nothing of its own lost
    taken = intake.take(10**6)
    seqs = [wire.decode(f).header.seq for f, _ in taken if wire.peek(f) == ("real", "")]
    assert seqs == list(range(300)) and all(len(item) == 2 for item in taken)
    # a job admitted while its frames wait beside others' in PENDING: its own move, in order
    intake.put(_frames("b", 5) + _frames("c", 5) + _frames("b", 8)[5:])
    intake.admit(frozenset({real, (None, ("b", ""))}))
    assert intake.held == {PENDING: 5, (None, ("b", "")): 8} and intake.bytes == sum(map(len, (f for f, _ in _frames("b", 8) + _frames("c", 5))))
    got = intake.take(100)
    assert [wire.decode(f).header.seq for f, _ in got if wire.peek(f) == ("b", "")] == list(range(8))
    assert intake.frames == intake.bytes == 0 and not intake.held


def test_the_daemon_tells_its_intake_which_jobs_hold_a_slot():
    """The writer hands the intake the admitted jobs (State.admitted) when one takes or leaves a
    slot: a job's frames then wait in a queue of their own, not in PENDING with invented ids'."""
    cfg = loopback()
    agg = Aggregator(cfg)
    agg.start()
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(agg.endpoint)
        a = Agent(s, "admitted", 0, 1, "")
        a.schema()
        a.report(0)
        wait_for(lambda: agg.intake.admitted == frozenset({(None, ("admitted", ""))}), what="the intake told of the slot")
        assert agg.state.admitted == agg.intake.admitted and agg.state.slots == 1
        s.close(0)
    finally:
        ctx.destroy(0)
        agg.stop()


WIDE_PARAMS = tuple((f"l{i}.weight", (4, 4), "float32") for i in range(300))
WIDE_SLOTS = tuple((f"l{i}", "", "Linear", "float32") for i in range(300))


def test_probe_reports_past_their_share_of_the_intake_keep_their_record_and_nothing_is_dropped():
    """A large job's probed step arrives as a burst of reports, most of their bytes
    arrays. Past BULK_SHARE of the job's share of the intake a probe report is shed: kept as its
    step's record alone (wire.shed), so every rank's step still shows and the records of the next
    step find room. Here 40 reports of 18 kB (740 kB) and the next step's records fit an intake
    of 400 kB without a single drop (dropped whole, half the reports and every later record would go).
    Schemas (resent by every rank, the same for all) past the share are dropped."""
    intake = Intake(400_000, 10_000)
    world = 40
    sent, schemas = [], []
    for r in range(world):
        a = Agent(None, "big", r, world, "", WIDE_PARAMS, WIDE_SLOTS)
        a.send = schemas.append
        a.schema()
        a.send = sent.append
        a.report(10, probe=True)
        a.report(11)
    frames = [(wire.encode(m), None) for m in sent]
    assert len(frames[0][0]) > 18_000
    intake.put(frames[0::2])  # the burst of reports, a burst of schema resends, the next step's records
    intake.put([(wire.encode(m), None) for m in schemas])
    intake.put(frames[1::2])
    assert intake.dropped == world and 0 < intake.shed < world and intake.bytes <= 200_000
    got = [wire.decode(f) for f, _ in intake.take(10**6)]
    assert [(m.header.rank, m.step) for m in got] == [(r, 10) for r in range(world)] + [(r, 11) for r in range(world)]
    full = [m for m in got if m.probe]
    assert len(full) + intake.shed == world and [m.header.rank for m in full] == list(range(len(full)))
    reports = frames[0::2]
    assert sum(len(f) for f, _ in reports[: len(full)]) <= BULK_SHARE * 400_000 / 2  # the arrays' share
    assert sum(len(f) for f, _ in reports[: len(full) + 1]) > BULK_SHARE * 400_000 / 2  # and no more
    for m, (f, _) in zip(got[len(full):world], reports[len(full):]):
        want = wire.decode(f)
        assert m.act is None and m.header == want.header and m.step_time == want.step_time


def test_an_aggregator_without_room_for_a_probed_steps_arrays_shows_every_ranks_step(caplog):
    """The same over TCP with the writer stalled during the burst: once it resumes, every rank's
    step shows without waiting for its next message, the shed reports count as received reports
    and in gradwatch_probes_shed_total, the round, lacking their arrays, closes incomplete, and
    the log says which intake settings would hold the job's probed step."""
    import logging
    import threading

    caplog.set_level(logging.WARNING, logger="gradwatch.aggregator")

    cfg = loopback(max_intake_bytes=1 << 20, max_message_bytes=1 << 20, rcv_hwm=100_000, round_grace_s=1.0)
    agg = Aggregator(cfg)
    ctx = zmq.Context()
    stalled, blocked, go = threading.Event(), threading.Event(), threading.Event()
    real_handle = agg.handle

    def handle(frame, *sender):
        if stalled.is_set():
            blocked.set()
            go.wait(60)
        real_handle(frame, *sender)

    agg.handle = handle
    agg.start()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(agg.endpoint)
        world = 64
        ranks = [Agent(sock, "big", r, world, "", WIDE_PARAMS, WIDE_SLOTS) for r in range(world)]
        ranks[0].schema()  # the ranks of a DDP job share one: its hash is all the others' reports name
        for a in ranks:
            a.report(0)
        wait_for(lambda: agg.state.jobs.get("big") is not None and len(agg.state.jobs["big"].ranks) == world
                 and all(r.step == 0 for r in agg.state.jobs["big"].ranks.values()), what="the job's first step")
        dropped = agg.intake.dropped
        assert dropped == 0
        stalled.set()
        ranks[0].heartbeat()  # the writer blocks on it
        assert blocked.wait(20), "the writer never took the heartbeat"
        for a in ranks:
            a.report(1, probe=True)  # 64 x 18 kB: past the intake's 1 MB
        wait_for(lambda: agg.intake.frames + agg.intake.dropped - dropped >= world, what="the burst in the intake")
        assert agg.intake.shed > world // 2 and agg.intake.dropped == dropped
        go.set()
        job = agg.state.jobs["big"]
        wait_for(lambda: all(r.step == 1 for r in job.ranks.values()), what="every rank's probed step")
        wait_for(lambda: job.rounds_incomplete == 1, what="the round closed without the shed arrays")
        assert agg.state.received["report"] == 2 * world and agg.state.rejected["overload"] == dropped
        m = samples(requests.get(agg.metrics_url, timeout=5).text, "gradwatch_probes_shed_total")
        assert m[()] == agg.intake.shed
        wait_for(lambda: any("job big (64 ranks) loses frames or probe arrays" in r.getMessage() for r in caplog.records),
                 what="the intake settings' warning")
    finally:
        go.set()
        ctx.destroy(0)
        agg.stop()


def test_an_intake_too_small_for_a_jobs_probed_step_says_which_settings_would_hold_it(caplog):
    """A probed step of a large job arrives as one burst of world reports, and while its
    round closes the next step's messages come in: more than one job's share of a small intake.
    When such a job loses frames to overload, the aggregator logs once which settings would hold
    it (8 x world frames, 2 x world x its report size in bytes); a job that fits, flooded the
    same way, is not named."""
    import logging
    import threading

    assert Intake(1 << 30, 2000).short_for(250, 10_000) is None
    assert Intake(1 << 20, 1000).short_for(300, 10_000) == (2400, 2 * 300 * 10_512)
    assert wire.probe_bytes(3, 3) == 3 * (6 + 2 + 2) * 4 + 3 * (3 * 4 + 2 * 8)

    cfg = loopback(max_intake_frames=200, rcv_hwm=100_000)
    agg = Aggregator(cfg)
    ctx = zmq.Context()
    stalled, go = threading.Event(), threading.Event()
    real_handle = agg.handle

    def handle(frame, *sender):
        if stalled.is_set():
            go.wait(60)
        real_handle(frame, *sender)

    agg.handle = handle
    caplog.set_level(logging.WARNING, logger="gradwatch.aggregator")
    agg.start()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(agg.endpoint)
        big = [Agent(sock, "big", r, 64, "") for r in range(64)]  # 8 x 64 frames > 200
        small = [Agent(sock, "small", r, 2, "") for r in range(2)]
        # one after the other: until a job holds a slot its frames share the intake's PENDING
        # queue with every other such job's, and big's start alone fills that share. The next
        # job starts once the intake gave the first its queue (after the batch that took its slot:
        # its later frames wait in PENDING until then; CI, loaded, saw small's schemas dropped
        # behind them) and holds no frame
        for jobs, name in ((big, "big"), (small, "small")):
            for a in jobs:
                a.schema()
                a.report(0)
            wait_for(lambda: any(job == name for _, (job, _) in agg.intake.admitted) and agg.intake.frames == 0,
                     what=f"job {name} given its queue, the intake drained")
        dropped_before, t_stall = agg.intake.dropped, agg.state.clock()
        stalled.set()
        for a in small:
            a.heartbeat()  # the writer blocks on one of these
        for _ in range(10):
            for a in big:
                a.heartbeat()
        for _ in range(150):  # far past its share too: dropped, but one probed step of it fits
            for a in small:
                a.heartbeat()
        # both jobs' heartbeats past their shares are dropped (the schemas' and reports' burst may
        # already have cost big some frames before the stall: waiting for a first drop was no wait)
        wait_for(lambda: agg.intake.dropped > dropped_before + 100, what="frames dropped past the intake's budget")
        go.set()
        # each drop names its job: both are marked overloaded (their silence checks muted)
        wait_for(lambda: all(agg.state.jobs[j].overloaded_at >= t_stall for j in ("big", "small")),
                 what="both jobs marked overloaded by their dropped frames")
        wait_for(lambda: agg.state.rejected["overload"] == agg.intake.dropped
                 and any("job big" in r.getMessage() for r in caplog.records), what="the warning")
        warned = [r.getMessage() for r in caplog.records if "loses frames or probe arrays to overload" in r.getMessage()]
        assert len(warned) == 1 and "job big (64 ranks)" in warned[0]
        assert "--max-intake-frames 512 " in warned[0] and "--max-intake-bytes" in warned[0]
        before = agg.intake.dropped
        go.clear()  # the writer blocks again: more drops of the same job, no second warning
        for a in big:
            for _ in range(5):
                a.heartbeat()
        wait_for(lambda: agg.intake.dropped > before, what="more frames of the job dropped")
        go.set()
        wait_for(lambda: agg.state.rejected["overload"] == agg.intake.dropped and agg.intake.frames == 0,
                 what="the intake drained and the drops counted")
        assert sum("loses frames or probe arrays to overload" in r.getMessage() for r in caplog.records) == 1
    finally:
        go.set()
        ctx.destroy(0)
        agg.stop()


def test_the_jobs_whose_frames_were_dropped_stay_bounded_under_a_flood_of_forged_ids():
    """The intake remembers which jobs lost frames (to mark them overloaded), by the
    identity peers' headers claim. A flood of frames under distinct invented job ids tracks at most
    MAX_DROPPED_JOBS of them until the writer takes them, and none claiming an id longer than a
    header may carry; every drop is still counted. Each entry names the sender's CURVE key."""
    intake = Intake(1 << 30, 100)
    n = 3 * MAX_DROPPED_JOBS
    intake.put([f for i in range(n) for f in _frames(f"forged{i}", 1)])
    assert intake.dropped + intake.frames == n and intake.dropped > MAX_DROPPED_JOBS
    assert len(intake.dropped_jobs) == MAX_DROPPED_JOBS
    intake.put(_frames("x" * 257, 200) + _frames("y", 200, key="k" * 65))  # no header carries these
    assert len(intake.dropped_jobs) == MAX_DROPPED_JOBS and intake.dropped + intake.frames == n + 400
    taken = intake.take_dropped()
    assert len(taken) == MAX_DROPPED_JOBS and all(user is None and ident[0].startswith("forged") for ident, user in taken)
    assert intake.dropped_jobs == set()
    intake.put(_frames("x" * 257, 200))
    assert intake.dropped_jobs == set()  # room again, but nobody's identity
    intake.put([(f, "KEY-A") for f, _ in _frames("late", 200)])
    assert intake.take_dropped() == {(("late", ""), "KEY-A")}  # tracked again once taken


GLIBC = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt and RUSAGE_THREAD")


def test_keep_freed_memory_is_a_no_op_where_the_c_library_has_no_mallopt(monkeypatch):
    """musl, macOS: no mallopt to call; the daemon says so and runs with the allocator as it is."""
    import ctypes

    from gradwatch.aggregator.daemon import keep_freed_memory

    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: object())  # a C library without mallopt
    assert keep_freed_memory() is False


@GLIBC
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "glibc-default"])
def test_the_daemon_reuses_freed_memory_without_faulting_it_in_again(keep):
    """keep_freed_memory (MALLOC_OPTIONS): a large array freed and allocated again, as every large
    round's arrays are, comes back from the process's heap without page faults; by glibc's default
    it is mapped afresh and faulted in again (2 MiB pages at best: 32 faults for 64 MiB). In a
    process of its own, on a thread started after the options, as the daemon's writer is."""
    import subprocess
    import sys

    code = f"""
import resource, threading
import numpy as np
from gradwatch.aggregator.daemon import keep_freed_memory
kept = keep_freed_memory() if {keep} else None
faults = []
def round_():
    np.ones(64 << 17)  # 64 MiB, twice glibc's largest threshold for a mapping of its own
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    np.ones(64 << 17)
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
t = threading.Thread(target=round_)
t.start(); t.join()
print(kept, faults[0])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    kept, faults = out.stdout.split()
    if keep:
        assert kept == "True"  # glibc took every option
        assert int(faults) <= 2
    else:
        assert int(faults) >= 16


@pytest.mark.ddp  # a process of its own
def test_the_daemon_process_takes_its_gc_thresholds_switch_interval_and_malloc_options():
    """serve_forever makes the process the daemon's: the garbage collector's thresholds
    (GC_THRESHOLDS), the interpreter's switch interval (SWITCH_INTERVAL_S: at CPython's 5 ms a
    busy writer starved the intake thread of the interpreter lock) and, on glibc, the C
    allocator's options (MALLOC_OPTIONS). In a process of its own: the settings are process-wide."""
    import ast
    import subprocess
    import sys

    code = """
import gc, sys, threading
from gradwatch.aggregator.config import load
from gradwatch.aggregator.daemon import Aggregator
from gradwatch.aggregator import daemon
agg = Aggregator(load(listen="tcp://127.0.0.1:0", metrics_host="127.0.0.1", metrics_port=0))
kept = []
keep = daemon.keep_freed_memory
daemon.keep_freed_memory = lambda: kept.append(keep()) or kept[-1]
seen = []
def look():
    while agg._intake_thread is None:
        threading.Event().wait(0.01)
    seen.append((sys.getswitchinterval(), gc.get_threshold()))
    agg._stop.set()
threading.Thread(target=look, daemon=True).start()
before = (sys.getswitchinterval(), gc.get_threshold())
agg.serve_forever()
print(repr((before, seen[0], kept)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    before, during, kept = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    from gradwatch.aggregator.daemon import GC_THRESHOLDS, SWITCH_INTERVAL_S

    assert before == (0.005, (700, 10, 10))  # CPython's own
    assert during == (pytest.approx(SWITCH_INTERVAL_S), GC_THRESHOLDS)
    assert kept == [platform.libc_ver()[0] == "glibc"]  # MALLOC_OPTIONS applied, once (glibc only)



def test_schemas_of_all_jobs_stay_within_max_schema_bytes_and_those_not_proven_within_a_sixteenth():
    """Schemas are counted as held (schemas.schema_cost): strangers' jobs, not proven, keep at most
    a sixteenth of max_schema_bytes together (WAITING_SHARE), evicting each other least recently
    heard first; a running job keeps its schema, a new real job still gets its own kept and
    proven, and a running job's changes of model drop its unused schemas to stay within the total."""
    from gradwatch.aggregator.schemas import WAITING_SHARE, schema_cost

    clock = Clock()
    limit = 4 << 20
    st = State(clock=clock, max_schema_bytes=limit)

    def schema(job, rank, n, world=2, tag=""):
        params = tuple((f"{tag}layer{i}.{'x' * 150}.weight", (64, 64), "float32") for i in range(n))
        return wire.Schema(wire.Header(job, rank, world, f"{job}{rank}", 0, 0.0, "k"), "node", 0, 1, params, SLOTS)

    def held(waiting=None):
        return sum(j.schema_bytes for j in st.jobs.values() if waiting is None or (j.admitted and j.proven) != waiting)

    def prove(job, sch):
        for r in range(2):
            st.apply(msgspec.structs.replace(sch, header=wire.Header(job, r, 2, f"{job}{r}", 0, 0.0, "k")))
            for step in range(3):
                st.apply(wire.Report(wire.Header(job, r, 2, f"{job}{r}", 1 + step, 0.0, "k"), sch.hash, step, 0.01, 1.0, 0))
        assert st.jobs[job].proven

    real = schema("real", 0, 100)
    prove("real", real)
    assert st.jobs["real"].schema_bytes == schema_cost(real) > 30_000
    for i in range(200):  # invented ids, each a ~80 kB schema
        clock.t += 0.01
        st.apply(schema(f"fake{i}", 0, 200))
        assert held(waiting=True) <= limit * WAITING_SHARE and held() <= limit
    assert st.jobs_evicted > 150 and st.jobs["real"].schemas == {real.hash: st.jobs["real"].schemas[real.hash]}
    late = schema("late", 0, 100, tag="late")
    prove("late", late)  # its schema evicted the least recently heard stranger
    assert st.jobs["late"].schema_bytes == schema_cost(late)
    for i in range(160):  # the running job changes its model again and again: its unused ones go
        st.apply(msgspec.structs.replace(schema("real", 0, 300, tag=f"v{i}"), header=wire.Header("real", 0, 2, "real0", 4 + i, 0.0, "k")))
        assert held() <= limit
    assert st.rejected["schema_limit"] == 0 and st.jobs["real"].ranks[0].schema in st.jobs["real"].schemas
    st.apply(schema("big", 0, 2000))  # one schema past the share of jobs not proven on its own: refused
    assert st.rejected["schema_limit"] == 1 and ("big" not in st.jobs or not st.jobs["big"].schemas)


def test_every_rejection_reason_is_declared_and_shown_from_the_start():
    """gradwatch_messages_rejected_total had no series until a first rejection (rate() and alerts
    saw nothing, not 0). Every reason is declared once (state.REJECT_REASONS), each shown at 0 from
    the start; every reason the code counts is among them, and an undeclared one is refused."""
    import re

    from prometheus_client import CollectorRegistry, generate_latest

    from gradwatch.aggregator.exporter import SnapshotCollector
    from gradwatch.aggregator.snapshot import snapshot
    from gradwatch.aggregator.state import REJECT_REASONS

    from .conftest import ROOT

    used = set()
    for path in (ROOT / "aggregator").rglob("*.py"):
        used.update(re.findall(r"reject\(\s*\"([a-z_]+)\"", path.read_text()))
    assert used and used <= set(REJECT_REASONS), used - set(REJECT_REASONS)
    assert len(set(REJECT_REASONS)) == len(REJECT_REASONS)
    st = State(clock=Clock())
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(lambda: snapshot(st, 1000.0)))
    shown = re.findall(r'^gradwatch_messages_rejected_total\{reason="([a-z_]+)"\} 0\.0$', generate_latest(reg).decode(), re.M)
    assert shown == list(REJECT_REASONS)
    with pytest.raises(ValueError, match="undeclared"):
        st.reject("made_up")
