"""``gradwatch demo``'s fault specs fail before any rank starts, naming what is wrong: a module or
parameter the model lacks, a step past the run, an option that is no number, an endpoint that is
none (each of these failed in a spawned rank with a traceback, or never fired)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from gradwatch.commands.demo.inject import check, parse
from gradwatch.commands.demo.model import GPT, GPTConfig


@pytest.fixture(scope="module")
def named():
    model = GPT(GPTConfig(context=16, width=16, layers=1, heads=2))
    return dict(model.named_modules()), dict(model.named_parameters())


@pytest.mark.parametrize("spec, steps, says", [
    ("nan@10:layer=nosuch", 20, "no module 'nosuch'"),
    ("desync@3:param=nope.weight", 20, "no parameter 'nope.weight'"),
    ("dead@3:layer=blocks.0.attn", 20, "has no bias"),
    ("nan@400", 20, "STEP must be in [0, 20)"),
    ("nan@20", 20, "never fire"),
])
def test_a_fault_the_model_or_the_run_cannot_take_is_refused(named, spec, steps, says):
    modules, params = named
    with pytest.raises(ValueError) as e:
        check(parse(spec, 2), spec, modules, params, steps)
    assert says in str(e.value) and spec in str(e.value)


@pytest.mark.parametrize("spec, says", [
    ("straggler@4:seconds=abc", "seconds must be a number"),
    ("drift@4:bit=1.5", "bit must be an integer"),
    ("drift@4:bit=-1", r"bit must be in \[0, 32\)"),
    ("drift@4:bit=40", r"bit must be in \[0, 32\)"),
    ("explode@4:scale=big", "scale must be a number"),
    ("straggler@4:seconds=-1", "seconds must be a finite number >= 0"),  # time.sleep raised in the rank
    ("hang@4:seconds=nan", "seconds must be a finite number >= 0"),
    ("straggler@4:factor=inf", "factor must be a finite number >= 0"),
    ("silent@4:seconds=0", "seconds must be > 0"),  # the SIGCONT could come before the stop
    ("straggler@4:before=backward", "before must be forward or step"),
    ("explode@4:before=step", "before applies to straggler and hang only"),
])
def test_an_option_that_is_no_number_is_refused_at_parse(spec, says):
    with pytest.raises(ValueError, match=says):
        parse(spec, 2)


def test_the_default_faults_fit_the_demos_model(named):
    modules, params = named
    for kind in ("explode", "nan", "desync", "drift", "straggler", "hang", "silent", "dead", "vanish", "shard"):
        check(parse(f"{kind}@5", 2), kind, modules, params, 20)  # raises nothing


@pytest.mark.parametrize("args, env, says", [
    (["--inject", "nan@10:layer=nosuch"], {}, "demo.inject: inject 'nan@10:layer=nosuch': no module"),
    (["--aggregator", "foo"], {}, "demo.aggregator"),
    # the agent's own settings, which each spawned rank would otherwise fail on
    ([], {"GRADWATCH_SERVER_KEY": "/nonexistent/server.key"}, "agent.client_key: needed with server_key (GRADWATCH_SERVER_KEY)"),
    ([], {"GRADWATCH_SERVER_KEY": "/nonexistent/server.key", "GRADWATCH_CLIENT_KEY": "/nonexistent/a.key_secret"},
     "agent.server_key (GRADWATCH_SERVER_KEY): '/nonexistent/server.key' names no file"),
])
def test_the_demo_command_exits_naming_the_setting_before_any_rank_starts(args, env, says, monkeypatch, capsys):
    """``gradwatch demo`` (the command's ``main``, in this process: nothing is spawned before the
    settings are checked) exits 2 with one line naming the setting."""
    from gradwatch.commands.cli import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    status = main(["demo", "--steps", "20", "--no-progress", *args])
    err = capsys.readouterr().err
    assert status == 2 and says in err, err
    assert "Traceback" not in err and "agent.endpoint" not in err


@pytest.mark.ddp
def test_a_demo_with_its_agents_switched_off_does_not_read_their_settings():
    """GRADWATCH_ENABLED=0 switches attach() off before it reads any other setting; the demo's own
    check of them (before the ranks start) must not refuse what the ranks would never read."""
    env = {**os.environ, "GRADWATCH_ENABLED": "0", "GRADWATCH_SERVER_KEY": "/nonexistent/server.key"}
    run = subprocess.run([sys.executable, "-m", "gradwatch.commands", "demo", "--steps", "5", "--no-progress",
                          "--metrics-port", "0", "--linger-s", "0", "--width", "16", "--layers", "1", "--heads", "2",
                          "--context", "16"], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and "trained 5 steps" in run.stdout, run.stderr[-2000:]
    assert "never connected" not in run.stdout


@pytest.mark.ddp
def test_stopping_the_demo_with_sigterm_stops_its_ranks():
    """A scheduler or a user stopping the demo (SIGTERM) stops its rank processes with it (none
    left training, orphaned), and the demo exits as killed by the signal would."""
    from .conftest import children, wait_for

    demo = subprocess.Popen([sys.executable, "-m", "gradwatch.commands", "demo", "--steps", "100000", "--no-progress",
                             "--metrics-port", "0", "--width", "16", "--layers", "1", "--heads", "2", "--context", "16"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    found: list = []
    try:
        def ranks():
            return [k for k, cmd in children(demo.pid).items() if b"spawn_main" in cmd]

        found[:] = wait_for(lambda: len(ranks()) == 2 and ranks(), 120, what="the demo's two ranks")
        time.sleep(2.0)  # training
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(60) == 128 + signal.SIGTERM

        def gone():
            for k in found:
                try:
                    os.kill(k, 0)
                except ProcessLookupError:
                    continue
                return False
            return True

        wait_for(gone, 20, what="the ranks stopped with the demo")
    finally:
        if demo.poll() is None:
            demo.kill()
        demo.wait()
        for k in found:  # whatever the outcome, no rank outlives the test
            try:
                os.kill(k, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _silent_rank(seconds: float) -> None:
    from gradwatch.commands.demo.inject import Injector

    Injector([parse(f"silent@3:rank=0:seconds={seconds}", 1)], 0).before_forward(3, None)


@pytest.mark.ddp
def test_a_silent_rank_stops_and_resumes_on_its_own_after_its_seconds():
    """``silent@STEP`` stops the rank (SIGSTOP) for ``seconds`` and it goes on by itself: a rank
    stopped for good would keep its peers waiting in all-reduce, and the demo would never end."""
    import multiprocessing as mp

    from .conftest import wait_for

    p = mp.get_context("spawn").Process(target=_silent_rank, args=(3.0,))
    p.start()
    try:
        def state():
            with open(f"/proc/{p.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]

        wait_for(lambda: state() == "T", 60, 0.01, what="the rank stopped")
        stopped = time.monotonic()
        p.join(60)
        # (the waker times the stop from when it saw it; this poll may see it late on a busy machine)
        assert p.exitcode == 0 and time.monotonic() - stopped >= 1.5
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
