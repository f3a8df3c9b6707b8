"""The check registry: a check is one file, declaring its own thresholds and the dashboard that shows
it; the aggregate thresholds model, the aggregator's ``checks`` setting, the catalog (docs/catalog.md) and the
Grafana generator all read the registry."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest
from pydantic import Field, ValidationError

from gradwatch.aggregator import checks as registry
from gradwatch.aggregator.checks import (
    CHECKS, DASHBOARDS, OWNERS, Check, Common, Thresholds, check_knock_ons, thresholds_model,
)
from gradwatch.aggregator.config import AggregatorConfig



def _read(source: str) -> set[str]:
    """Thresholds a check's code reads: ``self.t.NAME``, or ``x.NAME`` after ``x = self.t``."""
    owners = ["self\\.t", *(re.escape(a) for a in re.findall(r"\b(\w+) = self\.t$", source, re.M))]
    return {m for o in owners for m in re.findall(rf"(?<![\w.]){o}\.([a-z][a-z0-9_]*)\b", source)}


def _available(cls: type[Check]) -> set[str]:
    return set(cls.Thresholds.model_fields) | set(cls.uses) | set(Common.model_fields)


def test_every_threshold_a_check_reads_is_its_own_a_used_one_or_common():
    """A check file reads only thresholds its checks declare, name in ``uses``, or share (Common);
    code in a file also runs for the checks subclassing its classes (vanishing is explosion's
    machinery), so theirs count there too."""
    bad = {}
    for path in sorted(Path(registry.__file__).parent.glob("[!_]*.py")):
        module = sys.modules[f"{registry.__name__}.{path.stem}"]
        mine = [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__]
        allowed = set().union(*(_available(c) for c in CHECKS.values() if any(issubclass(c, m) for m in mine)))
        read = _read(path.read_text())
        if read - allowed:
            bad[path.name] = sorted(read - allowed)
    assert bad == {}, bad


def test_aggregate_model_is_every_checks_thresholds_with_owner_and_unique_names():
    declared = {n for c in CHECKS.values() for n in c.Thresholds.model_fields} | set(Common.model_fields)
    assert set(Thresholds.model_fields) == declared
    assert list(OWNERS) == list(Thresholds.model_fields)
    for name, owner in OWNERS.items():
        field = Thresholds.model_fields[name]
        src = CHECKS[owner].Thresholds if owner else Common
        assert field.default == src.model_fields[name].default and field.description
    assert OWNERS["skew_steps"] == "step_skew" and OWNERS["silent_after_s"] == "rank_silent"
    assert OWNERS["vanish_below"] == "vanishing" and OWNERS["explode_above"] == "explosion"
    assert OWNERS["max_layers"] == ""
    assert set(Thresholds.model_fields) >= set(CHECKS["vanishing"].Thresholds.model_fields)  # inherited once


def test_thresholds_keep_their_names_defaults_and_bounds_everywhere(monkeypatch):
    assert Thresholds().skew_steps == 5 and Thresholds(skew_steps=10).skew_steps == 10
    with pytest.raises(ValidationError, match="straggler_score"):
        Thresholds(straggler_score=1.5)
    with pytest.raises(ValidationError, match="no_such_threshold"):
        Thresholds(no_such_threshold=1)
    assert AggregatorConfig(checks={"skew_steps": 7}).checks.skew_steps == 7
    assert isinstance(AggregatorConfig().checks, Thresholds)
    monkeypatch.setenv("GRADWATCH_AGGREGATOR_CHECKS__SKEW_STEPS", "11")
    assert AggregatorConfig().checks.skew_steps == 11


def test_two_checks_declaring_one_threshold_or_using_an_undeclared_one_fail_naming_them():
    class A(Check):
        name = "a"
        dashboard = "rank_health"

        class Thresholds(Check.Thresholds):
            wait_s: float = Field(1.0, gt=0, description="A's wait.")

    class B(Check):
        name = "b"
        dashboard = "rank_health"

        class Thresholds(Check.Thresholds):
            wait_s: float = Field(2.0, gt=0, description="B's wait.")

    class C(Check):
        name = "c"
        dashboard = "rank_health"
        uses = ("wait_s", "nowhere_s")

    with pytest.raises(ValueError, match="check b declares threshold 'wait_s', already declared by a"):
        thresholds_model({"a": A, "b": B})
    with pytest.raises(ValueError, match="check c uses thresholds no check declares: nowhere_s"):
        thresholds_model({"a": A, "c": C})
    model = thresholds_model({"a": A})
    assert list(model.model_fields) == ["wait_s", *Common.model_fields] and model().wait_s == 1.0
    assert OWNERS["skew_steps"] == "step_skew"  # a model built from other checks leaves the registry's alone


def test_register_names_a_check_without_a_dashboard():
    class D(Check):
        name = "d_without_dashboard"

    with pytest.raises(ValueError, match="check d_without_dashboard: dashboard must be one of"):
        registry.register(D)
    assert "d_without_dashboard" not in CHECKS
    assert {c.dashboard for c in CHECKS.values()} == set(DASHBOARDS)


def test_grafana_status_panels_list_the_registered_checks():
    from gradwatch.grafana import generate

    boards = generate.build()
    uid = {"gradient_flow": "gradwatch-gradient-flow", "consistency": "gradwatch-consistency",
           "rank_health": "gradwatch-rank-health"}
    for dashboard, names in ((d, sorted(n for n, c in CHECKS.items() if c.dashboard == d)) for d in DASHBOARDS):
        (panel,) = [p for p in boards[uid[dashboard]]["panels"] if p["title"] == "Check status"]
        shown = set(re.findall(r'check=~"([^"]+)"', panel["targets"][0]["expr"]))
        assert shown == {"|".join(names)}, dashboard


def test_exactly_the_checks_that_judge_silence_declare_it():
    """rank_silent, step_skew and training_stalled name ranks for what the aggregator did not hear:
    they, and no other check, are muted by the Runner while a job's frames are being dropped."""
    assert Check.judges_silence is False
    assert {n for n, c in CHECKS.items() if c.judges_silence} == {"rank_silent", "step_skew", "training_stalled"}
    for n in ("rank_silent", "step_skew", "training_stalled"):  # one declaration, no guard of its own
        assert "overloaded_at" not in inspect.getsource(CHECKS[n].on_tick), n


def test_runner_skips_on_tick_of_a_check_judging_silence_while_its_job_is_overloaded(monkeypatch):
    """The Runner honours ``judges_silence``: for ``silent_after_s`` after the intake dropped a job's
    frames, such a check's on_tick is not called, its status and findings stay; a check not
    declaring it is called as always, and so is the judging check for another job. A job's first
    event still gives every check a status (no data), muted or not."""
    from gradwatch import wire
    from gradwatch.aggregator.checks import Evaluation, Finding, Outcome
    from gradwatch.aggregator.runner import Runner
    from gradwatch.aggregator.jobs import JobState
    from gradwatch.aggregator.state import State

    calls = []

    class Judging(Check):
        name = "t_judging"
        dashboard = "rank_health"
        judges_silence = True

        def on_tick(self, job, now):
            calls.append((self.name, job.job))
            return Evaluation.found(Finding(self.name, job.job, -1, "rank 0 unheard", rank=0))

    class Plain(Judging):
        name = "t_plain"
        judges_silence = False

    monkeypatch.setitem(CHECKS, Judging.name, Judging)
    monkeypatch.setitem(CHECKS, Plain.name, Plain)
    now = [1000.0]
    runner = Runner([Judging.name, Plain.name], Thresholds(silent_after_s=5), wall=lambda: 0.0)
    st = State(clock=lambda: now[0], runner=runner, proof_steps=0)  # jobs judged as they come
    for job in ("j", "other"):
        st.apply(wire.Heartbeat(wire.Header(job, 0, 1, "b0", 0, 0.0), -1, 0, 0, 0))
    st.tick()
    assert sorted(calls) == sorted((n, j) for n in (Judging.name, Plain.name) for j in ("j", "other"))
    found = {k: dict(v) for k, v in runner.active.items()}
    assert set(found) == {(j, n) for j in ("j", "other") for n in (Judging.name, Plain.name)}

    calls.clear()
    st.overloaded({(("j", ""), None)})  # the intake dropped a frame of job j
    for _ in range(4):  # within silent_after_s of the drop
        now[0] += 1
        st.tick()
    assert (Judging.name, "j") not in calls and calls.count((Plain.name, "j")) == 4
    assert calls.count((Judging.name, "other")) == 4  # another job is judged as always
    assert runner.status[("j", Judging.name)] == Outcome.FINDING and runner.active == found
    assert [e.event for e in runner.events] == ["raised"] * 4  # nothing resolved or raised meanwhile

    calls.clear()
    now[0] += 2  # silent_after_s after the drop: judged again
    st.tick()
    assert (Judging.name, "j") in calls

    calls.clear()
    muted = JobState("fresh", 1, overloaded_at=now[0])  # muted on its very first event
    runner.dispatch("on_tick", muted, now[0])
    assert calls == [(Plain.name, "fresh")]
    assert runner.status[("fresh", Judging.name)] == Outcome.NO_DATA and runner.status[("fresh", Plain.name)] == Outcome.FINDING


def test_knock_on_of_names_only_registered_checks_one_level_deep():
    """Every check's ``knock_on_of`` (the checks whose finding explains its own, folded by the
    Runner) names registered checks, never itself nor another knock-on."""
    knock = {n: c.knock_on_of for n, c in CHECKS.items() if c.knock_on_of}
    assert knock == {"training_stalled": ("rank_silent",), "replica_drift": ("grad_agreement",)}
    for name, causes in knock.items():
        for cause in causes:
            assert cause in CHECKS and cause != name and not CHECKS[cause].knock_on_of, (name, cause)
    check_knock_ons()  # the registry as loaded


def test_a_knock_on_of_an_unknown_or_knock_on_check_is_refused_naming_the_check(monkeypatch):
    from gradwatch.aggregator.runner import Runner

    class Typo(Check):
        name = "t_typo"
        dashboard = "rank_health"
        knock_on_of = ("rank_silnet",)

    monkeypatch.setitem(CHECKS, Typo.name, Typo)
    with pytest.raises(ValueError, match=r"check t_typo: knock_on_of names 'rank_silnet', not a registered check"):
        Runner([Typo.name], Thresholds())
    Typo.knock_on_of = ("training_stalled",)  # itself explained by rank_silent
    with pytest.raises(ValueError, match=r"t_typo: knock_on_of names 'training_stalled', itself a knock-on of rank_silent"):
        check_knock_ons()
    Typo.knock_on_of = ("t_typo",)
    with pytest.raises(ValueError, match="t_typo: knock_on_of names the check itself"):
        check_knock_ons({Typo.name: Typo})


def test_every_check_reads_a_job_through_its_view_and_keeps_its_per_job_state_in_one_place():
    """A real State and Runner with every check: each check event gets the job's read-only view
    (never the aggregator's job state); each check keeps what it keeps per job through
    ``Check.state`` (none has a store of its own to forget), and the runner forgetting the job
    leaves nothing of it in any check."""
    from gradwatch.aggregator.checks.view import JobView

    from .test_checks_gradients import JOB, Job, probe

    job = Job(list(CHECKS), world=3)
    got: dict[str, set] = {}
    for name, c in job.runner.checks.items():
        for method in ("on_steps", "on_heartbeat", "on_round", "on_tick"):
            if getattr(type(c), method) is not getattr(Check, method):
                def spy(j, *args, _f=getattr(c, method), _n=name):
                    got.setdefault(_n, set()).add(type(j))
                    return _f(j, *args)
                setattr(c, method, spy)
    for s in range(40):
        job.step(s, 1.0, locals=[1.0, 1.1, 0.9], arrays=probe() if s % 10 == 0 else None)
        job.tick(0.05)
    assert not job.runner.errors
    assert set(got) == set(CHECKS)  # every check handled some event of the job
    assert all(types == {JobView} for types in got.values()), got
    keeping = {n for n, c in job.runner.checks.items() if c.kept(JOB) is not None}
    assert keeping == {n for n, c in CHECKS.items() if c.per_job is not None or c.new_state is not Check.new_state}
    for cls in CHECKS.values():
        assert (cls.forget, cls.state, cls.kept) == (Check.forget, Check.state, Check.kept), cls.name
    job.state.registry.drop(job.state.jobs[JOB])
    assert [n for n, c in job.runner.checks.items() if c.kept(JOB) is not None] == []


def test_check_modules_import_of_the_aggregator_only_the_checks_package_and_the_reductions():
    """What a check reads of a job is the view's interface (checks/view.py, which alone reaches the
    reconciliation and the shards); the numeric reductions are the one other aggregator module a
    check may use."""
    import ast

    from gradwatch.aggregator import checks as pkg

    allowed = ("gradwatch.aggregator.checks", "gradwatch.aggregator.reductions")
    for path in sorted(Path(pkg.__file__).parent.glob("*.py")):
        if path.name == "view.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ["gradwatch", "aggregator", "checks"][: 4 - node.level]
                mod = ".".join(base + ([node.module] if node.module else []))
                assert mod.startswith(allowed), (path.name, mod)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not [n for n in names if n.startswith("gradwatch.aggregator") and not n.startswith(allowed)], path.name
