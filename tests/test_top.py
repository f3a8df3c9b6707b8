"""``gradwatch top``: its data side on what a real aggregator serves, its terminal app driven
headless (textual's ``App.run_test``), its command line.

The aggregator runs in-process (:class:`Aggregator` started on loopback: its real ZeroMQ intake,
writer thread, checks and HTTP server); a toy job of two ranks, reduced to its wire messages
(:mod:`gradwatch.wire`, no torch), reports to it over a real DEALER socket. Its gradient norm
explodes at one step, rank 1's local norm the largest, so the ``explosion`` check raises a finding
naming rank 1, which resolves ``spike_window`` (3) clean steps later: within milliseconds, as on a
fast job.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import textwrap
import time

import pytest

from gradwatch.aggregator import Aggregator
from gradwatch.aggregator.exporter import METRICS
from gradwatch.commands.cli import main
from gradwatch.commands.top import DEFAULT_URL, NO_TEXTUAL, TopCommand, model

from .conftest import ROOT, free_port, loopback, wait_for
from .fakejob import TINY, FakeJob, Model, to_socket

MODEL = Model(TINY.params, TINY.slots[:1])  # one linear layer
JOB = "toy"
#: the toy job's loss at step s
LOSS = [2.0 - 0.01 * s for s in range(64)]
#: the aggregator's settings here. silent_after_s 60: the toy job pauses between phases without a
#: rank_silent finding; spike_window 3: the explosion resolves 3 clean steps after it
SETTINGS = dict(round_grace_s=0.3, checks={"spike_window": 3, "silent_after_s": 60.0})


class ToyJob(FakeJob):
    """Two ranks of one job reduced to their wire messages, sent over one real DEALER socket;
    each rank has sent its schema."""

    def __init__(self, sock, job: str = JOB, world: int = 2):
        super().__init__(to_socket(sock), job, world, MODEL, every=100, host="node-0")
        self.schema()

    def step(self, s: int, grad_norm: float = 1.0, local: tuple = (1.0, 1.1)) -> None:
        """Every rank reports step ``s``: 50 ms, ``grad_norm`` after all-reduce, ``local[rank]``
        before it, the loss :data:`LOSS` [s]."""
        for r in range(self.world):
            self.report(r, s, grad_norm, local_grad_norm=local[r], loss=LOSS[s])

    def explode_then_recover(self, first: int, last: int, at: int) -> None:
        """Steps ``first``..``last``, the global norm 5e3 at ``at`` with rank 1's local norm the largest."""
        for s in range(first, last + 1):
            self.step(s, *((5e3, (2.0, 1.5e4)) if s == at else ()))

    def finish(self) -> None:
        """Every rank says goodbye, as an agent does when training finished."""
        for r in range(self.world):
            self.goodbye(r, "finished")


@pytest.fixture
def aggregator(local_aggregator):
    return local_aggregator(**SETTINGS)


@pytest.fixture
def toy(aggregator, push):
    return ToyJob(push(aggregator.endpoint))


def url_of(agg: Aggregator) -> str:
    return f"http://127.0.0.1:{agg.metrics_port}"


def read(agg: Aggregator, recent_s: float = 600.0) -> tuple[model.Scrape, model.View]:
    scrape = model.fetch(url_of(agg))
    return scrape, model.view(scrape, recent_s)


def read_until(agg: Aggregator, predicate, what: str) -> tuple[model.Scrape, model.View]:
    """The first :func:`read` whose view satisfies ``predicate``."""
    return wait_for(lambda: (got := read(agg)) and predicate(got[1]) and got, 20, 0.05, what)


def toy_job(v: model.View) -> model.Job | None:
    return next((j for j in v.jobs if j.job_id == JOB), None)


def at_step(step: int):
    return lambda v: (j := toy_job(v)) is not None and len(j.ranks) == 2 and all(r.step == step for r in j.ranks)


# --- the data side on a real aggregator's /metrics and /api/findings ------------------------------


def test_every_metric_top_reads_is_one_the_aggregator_exports():
    exported = {d.name + ("_total" if d.kind == "counter" else "") for d in METRICS.values()}
    read_names = {*model.JOB_METRICS, *model.RANK_METRICS, *model.FINDING_METRICS}
    assert read_names <= exported, sorted(read_names - exported)


def test_jobs_ranks_and_a_finding_from_a_real_aggregator_while_it_stands_and_after_it_resolved(aggregator, toy):
    t0 = time.time()
    toy.explode_then_recover(0, 6, at=6)  # the finding stands: 3 clean steps have not come yet
    scrape, v = read_until(aggregator, lambda v: at_step(6)(v) and toy_job(v).active, "the explosion's finding")
    (job,) = v.jobs
    assert (job.job_id, job.world, job.reporting, job.ended, job.restarts, job.steps) == (JOB, 2, 2, False, 0, (6, 6))
    assert job.active == (("explosion", 1),)
    r0, r1 = job.ranks
    assert (r0.rank, r1.rank) == (0, 1)
    assert "explosion" in r1.flagged and "explosion" not in r0.flagged
    assert (r1.grad_norm, r1.local_grad_norm, r0.local_grad_norm) == (5e3, 1.5e4, 2.0)
    assert job.grad_norm == 5e3
    assert model.rank_status(r1, job, v.now, 60, 600).startswith("explosion")
    (f,) = [f for f in v.findings if f.check == "explosion"]
    assert (f.active, f.rank, f.job_id, f.step, f.resolved_at, f.severity) == (True, 1, JOB, 6, None, "critical")
    assert t0 - 1 <= f.raised_at <= v.now + 1 and "rank 1" in f.summary

    toy.explode_then_recover(7, 12, at=-1)
    scrape, v = read_until(aggregator, lambda v: at_step(12)(v) and not toy_job(v).active, "the finding resolved")
    (job,) = v.jobs
    assert job.steps == (12, 12) and job.grad_norm == 1.0
    for r, local in zip(job.ranks, (1.0, 1.1)):
        assert (r.step, r.step_s, r.grad_norm, r.local_grad_norm, r.flagged) == (12, 0.05, 1.0, local, ())
        assert r.loss == pytest.approx(LOSS[12])
        assert t0 - 1 <= r.last_seen <= v.now + 1
    r0, r1 = job.ranks
    assert r0.named == () and [c for c, _ in r1.named] == ["explosion"]
    # resolved, the finding is still listed (the events), and rank 1's status says it was named
    (f,) = [f for f in v.findings if f.check == "explosion"]
    assert (f.active, f.rank, f.step) == (False, 1, 6) and f.raised_at <= f.resolved_at <= v.now + 1
    assert model.rank_status(r1, job, v.now, 60, 600).startswith("ok (was explosion, ")
    assert model.rank_status(r0, job, v.now, 60, 600) == "ok"
    assert model.rank_status(r1, job, v.now + 700, 800, 600) == "ok"  # past recent_s: no longer said

    toy.finish()
    _, v = read_until(aggregator, lambda v: toy_job(v).ended, "the job ended")
    job = toy_job(v)
    assert [model.rank_status(r, job, v.now, 60, 600).split(" ")[0] for r in job.ranks] == ["finished", "finished"]


def test_findings_from_real_events_when_the_ring_lost_the_raise_and_past_recent(aggregator, toy):
    toy.explode_then_recover(0, 12, at=6)
    scrape, v = read_until(aggregator, lambda v: any(not f.active for f in v.findings), "the finding resolved")
    kinds = [e["event"] for e in scrape.events if e["check"] == "explosion"]
    assert kinds == ["resolved", "raised"]  # newest first
    (f,) = model.findings(scrape.events, scrape.active, v.now, 600)
    raised_at, resolved_at = f.raised_at, f.resolved_at
    assert not f.active and raised_at <= resolved_at

    # the aggregator's event ring let the raised event go: the finding is still listed, raised at an unknown time
    resolved_only = [e for e in scrape.events if e["event"] != "raised"]
    (g,) = model.findings(resolved_only, scrape.active, v.now, 600)
    assert (g.active, g.raised_at, g.resolved_at, g.rank) == (False, None, resolved_at, 1)
    # recent_s counts from the resolution
    assert model.findings(scrape.events, scrape.active, resolved_at + 59, 60) == (f,)
    assert model.findings(scrape.events, scrape.active, resolved_at + 61, 60) == ()
    # active per /api/findings?active=1 while the events, fresher, say it resolved since: resolved
    raised_only = [e for e in scrape.events if e["event"] == "raised"]
    as_active = [dict(raised_only[0], since=raised_only[0]["time"])]
    assert model.findings(scrape.events, as_active, v.now, 600) == (f,)
    # active, and the events no longer hold it (raised long ago): active since /api/findings says
    (h,) = model.findings([], as_active, v.now + 1e6, 600)
    assert (h.active, h.raised_at, h.resolved_at) == (True, raised_at, None)
    # raised only: active
    (k,) = model.findings(raised_only, [], v.now, 600)
    assert (k.active, k.raised_at, k.resolved_at) == (True, raised_at, None)


def test_fetch_says_why_in_one_line_when_the_aggregator_cannot_be_read(aggregator):
    port = free_port()
    with pytest.raises(model.FetchError, match=rf"^cannot reach http://127.0.0.1:{port}/metrics: .*refused"):
        model.fetch(f"http://127.0.0.1:{port}")
    # an HTTP server that is no aggregator there (the aggregator's own 404 for a path it does not serve)
    with pytest.raises(model.FetchError, match=r"answered 404 .*is this a gradwatch aggregator"):
        model.fetch(url_of(aggregator) + "/elsewhere")
    with pytest.raises(model.FetchError, match="not a gradwatch aggregator's: no gradwatch_ metrics"):
        model.view(model.Scrape("# HELP up x\n# TYPE up gauge\nup 1\n", [], [], 0.0), 60)


def test_an_aggregator_without_jobs_reads_as_no_jobs(aggregator):
    scrape, v = read(aggregator)
    assert (v.jobs, v.findings) == ((), ())
    assert abs(v.now - time.time()) < 5


# --- pure functions ---------------------------------------------------------------------------------


def test_base_url_takes_a_base_or_a_metrics_url_and_refuses_others():
    assert model.base_url("http://h:9400") == "http://h:9400"
    assert model.base_url("http://h:9400/metrics") == "http://h:9400"
    assert model.base_url(" https://h/prefix/ ") == "https://h/prefix"
    for bad in ("h:9400", "ftp://h:1", "http://", "http://h:99999"):
        with pytest.raises(ValueError):
            model.base_url(bad)


def test_the_clock_offset_corrects_only_skews_beyond_the_date_headers_second():
    local = 1_700_000_000.4
    assert model.clock_offset("Tue, 14 Nov 2023 22:13:21 GMT", local) == 0.0  # 0.6 s: within the slack
    assert model.clock_offset("Tue, 14 Nov 2023 22:14:20 GMT", local) == pytest.approx(59.6)
    assert model.clock_offset(None, local) == 0.0 and model.clock_offset("garbage", local) == 0.0


def test_rank_status_in_order_of_what_matters():
    now = 1000.0
    job, ended = model.Job(JOB, world=2), model.Job(JOB, world=2, ended=True)
    assert model.rank_status(model.Rank(0, last_seen=now - 1), job, now, 2.5, 600) == "ok"
    assert model.rank_status(model.Rank(0, last_seen=now - 3), job, now, 2.5, 600) == "silent"
    assert model.rank_status(model.Rank(0, last_seen=now - 3), ended, now, 2.5, 600) == "finished"
    flagged = model.Rank(0, last_seen=now - 3, flagged=("rank_silent", "straggler"), named=(("straggler", now - 5),))
    assert model.rank_status(flagged, ended, now, 2.5, 600) == "rank_silent, straggler"
    was = model.Rank(0, last_seen=now, named=(("explosion", now - 75), ("straggler", now - 700)))
    assert model.rank_status(was, job, now, 2.5, 600) == "ok (was explosion, 1m15s ago)"


def test_rank_rows_list_every_rank_by_rank_or_those_needing_a_look_first():
    now = 1000.0
    ranks = tuple(model.Rank(k, last_seen=now) for k in range(6))
    ranks = ranks[:2] + (model.Rank(2, last_seen=now - 30), model.Rank(3, last_seen=now, flagged=("straggler",)),
                         model.Rank(4, last_seen=now, named=(("explosion", now - 5),))) + ranks[5:]
    job = model.Job(JOB, world=6, reporting=6, ranks=ranks[::-1])
    rows, hidden = model.rank_rows(job, now, 2.5, 600, most=6)
    assert [(r.rank, s) for r, s in rows] == [(0, "ok"), (1, "ok"), (2, "silent"), (3, "straggler"),
                                               (4, "ok (was explosion, 5.0s ago)"), (5, "ok")] and hidden == 0
    rows, hidden = model.rank_rows(job, now, 2.5, 600, most=4)
    assert [r.rank for r, _ in rows] == [2, 3, 4, 0] and hidden == 2


def test_age_reads_in_a_few_characters():
    assert [model.age(s) for s in (0.04, 9.96, 12.5, 185, 7440, math.nan, -1)] == [
        "0.0s", "10.0s", "12s", "3m05s", "2h04m", "-", "0.0s"]


def test_norm_history_keeps_one_point_per_new_step_and_starts_over_on_a_restart():
    def job(step, norm, job_id=JOB):
        return model.Job(job_id, ranks=(model.Rank(0, step=step, grad_norm=norm),), steps=(step, step))

    h = model.NormHistory(size=3)
    for step, norm in ((-1, math.nan), (1, 1.0), (1, 9.0), (2, 100.0), (3, math.inf), (4, 0.01)):
        h.add([job(step, norm), job(step, 1.0, "other")])
    assert h.points(JOB) == [(2, 100.0), (3, math.inf), (4, 0.01)]  # size 3; the repeated step 1 is one point
    h.add([job(-1, math.nan)])  # a job's ranks before their first step report step -1: nothing to draw
    assert h.sparkline(JOB) == [2.0, -2.0]  # log10, the non-finite left out
    h.add([job(1, 5.0)])  # restarted from an earlier step; "other" is gone
    assert h.points(JOB) == [(1, 5.0)] and h.points("other") == []


# --- the terminal app, headless -------------------------------------------------------------------


def _text(app) -> str:
    from textual.widgets import Static

    return str(app.query_one("#status", Static).content)


def _rows(table) -> list[list[str]]:
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


async def _until(pilot, predicate, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        await pilot.pause(0.05)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}; status line: {_text(pilot.app)!r}")


def test_the_app_shows_the_job_its_ranks_and_a_finding_that_came_and_went(aggregator, toy):
    from textual.widgets import DataTable

    from gradwatch.commands.top.app import TopApp

    async def run():
        app = TopApp(url_of(aggregator), refresh_s=0.2)
        async with app.run_test(size=(180, 50)) as pilot:
            toy.explode_then_recover(0, 3, at=-1)
            panel = await _until(pilot, lambda: app._panels.get(JOB), "the job's panel")
            await _until(pilot, lambda: [r[:2] for r in _rows(panel.ranks)] == [["0", "3"], ["1", "3"]], "steps 3")
            assert "world 2" in str(panel.title.content) and "running" in str(panel.title.content)
            # a refresh updates the same ranks in place: the row the user moved to stays selected
            panel.ranks.move_cursor(row=1)
            toy.step(4)
            await _until(pilot, lambda: [r[:2] for r in _rows(panel.ranks)] == [["0", "4"], ["1", "4"]], "steps 4")
            assert panel.ranks.cursor_row == 1
            assert str(panel.border_title) == f"job {JOB}"

            # raised and resolved within milliseconds, between two refreshes; then the job ends
            toy.explode_then_recover(5, 12, at=6)
            toy.finish()
            findings = app.query_one("#findings", DataTable)
            rows = await _until(pilot, lambda: (rows := _rows(findings)) and rows, "a finding listed")
            assert len(rows) == 1
            state, check, severity, job, rank, layer, step, raised, resolved, summary = rows[0]
            assert (state, check, severity, job, rank, layer, step) == ("resolved", "explosion", "critical", JOB, "1", "-", "6")
            assert raised.endswith(" ago") and resolved.endswith(" ago") and "rank 1" in summary
            ranks = await _until(pilot, lambda: (r := _rows(panel.ranks)) and r[0][-1].startswith("finished") and r,
                                 "the job finished")
            assert [r[:4] for r in ranks] == [["0", "12", "50ms", "1"], ["1", "12", "50ms", "1"]]
            assert ranks[0][-1] == "finished" and ranks[1][-1].startswith("finished (was explosion, ")
            assert "ended" in str(panel.title.content)
            assert "1 job" in _text(app) and "0 active findings, 1 resolved" in _text(app)
            assert panel.spark.data and "grad norm 1" in str(panel.spark_label.content)

            # the aggregator goes away: the status line says so, the last view stays
            aggregator.stop()
            await _until(pilot, lambda: "cannot reach" in _text(app), "the status line saying so")
            assert "retrying every 0.2 s" in _text(app) and "showing the view of" in _text(app)
            assert app._panels[JOB].is_mounted and _rows(findings)[0][1] == "explosion"

    asyncio.run(run())


def test_the_app_waits_for_an_unreachable_aggregator_and_shows_it_once_it_answers():
    from gradwatch.commands.top.app import TopApp

    port = free_port()

    async def run():
        app = TopApp(f"http://127.0.0.1:{port}", refresh_s=0.2)
        async with app.run_test(size=(120, 30)) as pilot:
            await _until(pilot, lambda: "cannot reach" in _text(app), "the status line")
            assert _text(app).startswith(f"cannot reach http://127.0.0.1:{port}/metrics: ")
            assert "retrying every 0.2 s" in _text(app) and app.view is None
            await pilot.pause(0.5)  # more refreshes fail the same way, and the app keeps running
            assert "cannot reach" in _text(app) and app.is_running
            agg = Aggregator(loopback(metrics_port=port, **SETTINGS)).start()
            try:
                await _until(pilot, lambda: "0 jobs" in _text(app), "the aggregator read")
                assert app.error is None and app.query_one("#no-jobs")
            finally:
                agg.stop()
            await pilot.press("ctrl+c")  # quits, as q does
            await _until(pilot, lambda: not app.is_running, "the app to quit")
        assert app.return_code == 0

    asyncio.run(run())


# --- the command line -------------------------------------------------------------------------------


def test_the_command_validates_its_flags_naming_them(capsys):
    assert TopCommand().url == DEFAULT_URL == "http://127.0.0.1:9400"
    assert TopCommand(url="http://h:1/metrics").url == "http://h:1"
    assert main(["top", "--url", "h:9400"]) == 2
    assert "top.url" in capsys.readouterr().err
    assert main(["top", "--refresh-s", "0"]) == 2
    assert "top.refresh_s" in capsys.readouterr().err


def test_without_textual_the_command_says_what_to_install_in_one_line():
    """In a fresh interpreter: importing the command line loads no textual; with textual not
    importable, ``gradwatch top`` exits 1 with one line naming the extra."""
    code = textwrap.dedent(
        """
        import sys
        from gradwatch.commands.cli import main
        assert not [m for m in sys.modules if m.split(".")[0] == "textual"], "textual imported"
        sys.modules["textual"] = None  # not installed
        sys.exit(main(["top", "--url", "http://127.0.0.1:9"]))
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 1, run.stderr
    assert run.stderr == f"gradwatch top: {NO_TEXTUAL}\n" and "pip install 'gradwatch[top]'" in NO_TEXTUAL


def test_jobs_still_training_come_first_and_a_pattern_picks_jobs():
    """The live job is not lost among ended ones listed by id: training jobs first, the most
    recently stepping first; ``--job`` keeps only the jobs its pattern matches."""
    from gradwatch.commands.top import model

    done = model.Job("a-done", ended=True, step_age_s=300.0)
    stale, live, new = model.Job("b-stale", step_age_s=40.0), model.Job("z-live", step_age_s=0.5), model.Job("c-new")
    assert [j.job_id for j in model.arrange((done, stale, live, new))] == ["z-live", "b-stale", "c-new", "a-done"]
    assert [j.job_id for j in model.arrange((done, stale, live, new), job="*-l*")] == ["z-live"]
