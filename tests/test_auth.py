"""CURVE authentication: keys made by ``gradwatch keys``, a real aggregator with a CURVE
ROUTER socket and a ZAP handler, real agents and real DEALER peers with right, wrong and no keys.
Also the plain-TCP defaults: loopback binds, a warning for a wide bind without CURVE.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import time
from pathlib import Path

import pytest
import requests
import torch
import torch.nn as nn
import zmq

from gradwatch import agent, auth, wire
from gradwatch.commands import cli
from gradwatch.aggregator import Aggregator, AggregatorConfig, ConfigError, load

from .conftest import samples, wait_for
from .fakejob import Rank

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """``gradwatch keys DIR --client a --client b``: both clients admitted."""
    d = tmp_path_factory.mktemp("keys")
    assert cli.main(["keys", str(d), "--client", "a", "--client", "b"]) == 0
    return d


@pytest.fixture
def curve_aggregator(keys, local_aggregator):
    return local_aggregator(server_key=str(keys / "server.key_secret"), client_keys=str(keys / "clients"))


def scrape(agg: Aggregator) -> str:
    r = requests.get(agg.metrics_url, timeout=5)
    r.raise_for_status()
    return r.text


def metric(agg: Aggregator, name: str, **labels) -> float:
    """The sample's value, 0 when absent."""
    want = tuple(sorted(labels.items()))
    return samples(scrape(agg), name).get(want, 0.0)


class Peer(Rank):
    """A rank reduced to its wire messages (:class:`~tests.fakejob.Rank`) on a raw DEALER socket,
    with the given CURVE keys (or none)."""

    def __init__(self, endpoint: str, keys: auth.ClientKeys | None, job: str, rank: int = 0, world: int = 1):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        if keys is not None:
            keys.apply(self.sock)
        self.sock.connect(endpoint)
        super().__init__(self._send, job, rank, world)

    def _send(self, msg) -> None:
        try:
            self.sock.send(wire.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # a refused handshake can leave the socket no pipe to queue on: nothing sent
            pass

    def heartbeat(self) -> None:
        super().heartbeat(-1)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def client(keys_dir, name: str, server: bytes | None = None) -> auth.ClientKeys:
    public, secret = auth.load_pair(str(keys_dir / f"{name}.key_secret"))
    return auth.ClientKeys(server or auth.load_public(str(keys_dir / "server.key")), public, secret)


def small_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


# --- gradwatch keys ---------------------------------------------------------------------------------


def test_keys_command_writes_loadable_pairs_with_0600_secrets(tmp_path, capsys):
    d = tmp_path / "k"
    assert cli.main(["keys", str(d)]) == 0
    out = capsys.readouterr().out
    assert "--server-key" in out and "GRADWATCH_CLIENT_KEY" in out
    files = {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()}
    assert files == {"server.key", "server.key_secret", "clients/client.key", "client.key_secret"}
    for name in files:
        mode = stat.S_IMODE((d / name).stat().st_mode)
        assert mode == (0o600 if name.endswith("key_secret") else 0o644), (name, oct(mode))
    assert stat.S_IMODE(d.stat().st_mode) == 0o711  # a service user reaches clients/, lists nothing
    server_pub, server_sec = auth.load_pair(str(d / "server.key_secret"))
    assert auth.load_public(str(d / "server.key")) == server_pub and zmq.curve_public(server_sec) == server_pub
    client_pub, _ = auth.load_pair(str(d / "client.key_secret"))
    assert auth.load_allowed(str(d / "clients")) == {client_pub}
    # the public file holds no secret: it cannot stand in for the pair
    with pytest.raises(auth.KeyMaterialError, match="only a public key"):
        auth.load_pair(str(d / "server.key"))
    # existing keys are kept unless --force
    before = (d / "server.key_secret").read_bytes()
    assert cli.main(["keys", str(d)]) == 2
    assert "exists" in capsys.readouterr().err and (d / "server.key_secret").read_bytes() == before
    assert cli.main(["keys", str(d), "--force"]) == 0
    assert (d / "server.key_secret").read_bytes() != before


def test_keys_command_is_registered_in_the_cli(tmp_path):


    assert cli.main(["keys", str(tmp_path / "k"), "--client", "team-1"]) == 0
    assert (tmp_path / "k" / "clients" / "team-1.key").is_file() and (tmp_path / "k" / "team-1.key_secret").is_file()


# --- CURVE end to end ---------------------------------------------------------------------------------


def test_curve_agent_reports_reach_metrics_and_unauthenticated_peers_are_refused(keys, curve_aggregator, monkeypatch):
    agg = curve_aggregator
    # the agent takes Z85 values from the environment as well as files
    server_pub = auth.load_public(str(keys / "server.key"))
    _, secret_a = auth.load_pair(str(keys / "a.key_secret"))
    monkeypatch.setenv("GRADWATCH_SERVER_KEY", server_pub.decode())
    monkeypatch.setenv("GRADWATCH_CLIENT_KEY", secret_a.decode())
    model, opt = small_model()
    monitor = agent.attach(model, opt, endpoint=agg.endpoint, every=1, job="good", heartbeat_s=0.05)
    assert isinstance(monitor, agent.Monitor)
    try:
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        wait_for(lambda: metric(agg, "gradwatch_messages_received_total", kind="report") >= 5, what="agent reports")
    finally:
        monitor.close()
    assert metric(agg, "gradwatch_job_ranks_reporting", job_id="good") == 1

    stranger_pub, stranger_sec = zmq.curve_keypair()
    intruders = {
        "no keys": (None, "intruder-plain"),
        "key not admitted": (auth.ClientKeys(server_pub, stranger_pub, stranger_sec), "intruder-key"),
        "wrong server key": (client(keys, "a", server=zmq.curve_keypair()[0]), "intruder-server"),
    }
    for kind, (peer_keys, job) in intruders.items():
        # each kind of refusal is counted (one per connection attempt; peers retry)
        before = metric(agg, "gradwatch_messages_rejected_total", reason="unauthenticated")
        p = Peer(agg.endpoint, peer_keys, job)
        try:
            for _ in range(5):
                p.heartbeat()
            wait_for(lambda: metric(agg, "gradwatch_messages_rejected_total", reason="unauthenticated") > before,
                     what=f"refusal counted: {kind}")
            time.sleep(0.3)
        finally:
            p.close()
    text = scrape(agg)
    assert "intruder" not in text
    assert set(agg.state.jobs) == {"good"}


def test_a_job_is_bound_to_the_key_that_created_it(keys, curve_aggregator):
    agg = curve_aggregator
    a = Peer(agg.endpoint, client(keys, "a"), "owned", rank=0, world=2)
    b = Peer(agg.endpoint, client(keys, "b"), "owned", rank=1, world=2)
    b_own = Peer(agg.endpoint, client(keys, "b"), "b-job")
    try:
        a.heartbeat()
        wait_for(lambda: "owned" in agg.state.jobs and set(agg.state.jobs["owned"].ranks) == {0}, what="job created by a")
        for _ in range(3):
            b.heartbeat()
        b_own.heartbeat()
        wait_for(lambda: metric(agg, "gradwatch_messages_rejected_total", reason="wrong_key") == 3, what="b refused")
        wait_for(lambda: "b-job" in agg.state.jobs and agg.state.jobs["b-job"].peer_key is not None, what="b's own job")
        a.heartbeat()  # the creator keeps writing
        wait_for(lambda: agg.state.jobs["owned"].ranks[0].received == 2, what="a's second heartbeat")
    finally:
        for p in (a, b, b_own):
            p.close()
    assert set(agg.state.jobs["owned"].ranks) == {0}
    assert agg.state.job_keys["owned"] != agg.state.job_keys["b-job"]
    assert 'job_id="owned"' not in scrape(agg)  # heartbeats alone prove no job: nothing exported


def test_binding_is_per_job_and_dropped_with_a_forgotten_job():
    from gradwatch.aggregator.state import State

    now = [0.0]
    st = State(rank_ttl_s=10, clock=lambda: now[0])
    hb = lambda job, boot="b0": wire.Heartbeat(wire.Header(job, 0, 1, boot, 0, 0.0), -1, 0, 0, 0)
    st.apply(hb("j"), peer_key="KEY-A")
    st.apply(hb("j", "b1"), peer_key="KEY-B")
    assert st.rejected["wrong_key"] == 1 and st.jobs["j"].ranks[0].boot == "b0"
    st.apply(hb("j"))  # without CURVE there is no key to check
    now[0] = 100.0
    st.tick()  # the job goes silent and is forgotten: its id is free again
    assert "j" not in st.jobs
    st.apply(hb("j", "b2"), peer_key="KEY-B")
    st.apply(hb("j", "b2"), peer_key="KEY-A")
    assert st.rejected["wrong_key"] == 2 and st.jobs["j"].ranks[0].boot == "b2" and st.job_keys == {"j": "KEY-B"}


def test_only_the_jobs_own_key_marks_it_overloaded():
    """With CURVE on, a job is bound to the key that created it, and so is its overload mark: frames
    of another client claiming the job's id, dropped by the intake, do not mute the job's silence
    checks (rank_silent still names its silent rank); drops of frames of the job's own key do.
    Without CURVE (no user id) a drop marks the job it claims."""
    from gradwatch.aggregator.checks import Thresholds
    from gradwatch.aggregator.runner import Runner
    from gradwatch.aggregator.intake import Intake
    from gradwatch.aggregator.state import State

    now = [1000.0]
    runner = Runner(["rank_silent"], Thresholds(silent_after_s=2))
    st = State(clock=lambda: now[0], runner=runner, proof_steps=0)  # judged as it comes
    hb = lambda job, rank, seq=0: wire.Heartbeat(wire.Header(job, rank, 2, f"b{rank}", seq, 0.0), -1, seq, 0, 0)
    for rank in (0, 1):
        st.apply(hb("owned", rank), peer_key="KEY-A")
    st.apply(hb("plain", 0))  # a job made without CURVE: bound to no key
    intake = Intake(1 << 30, 4)

    def flood(job, user):  # frames past the intake's room, all claiming ``job``
        intake.put([(wire.encode(hb(job, 0, seq)), user) for seq in range(1, 11)])
        intake.take(10**6)
        st.overloaded(intake.take_dropped())

    for _ in range(4):  # rank 1 falls silent while another client floods frames claiming the job
        now[0] += 1
        flood("owned", "KEY-B")
        st.apply(hb("owned", 0, int(now[0])), peer_key="KEY-A")
        st.tick()
    assert st.jobs["owned"].overloaded_at == -math.inf
    assert [f.rank for f in runner.active[("owned", "rank_silent")].values()] == [1]
    flood("owned", "KEY-A")  # the job's own frames dropped: its silence proves nothing now
    flood("plain", None)
    assert st.jobs["owned"].overloaded_at == st.jobs["plain"].overloaded_at == now[0]


# --- settings errors ------------------------------------------------------------------------------------


def test_agent_missing_key_file_fails_at_attach_naming_the_setting(keys, tmp_path, monkeypatch):
    model, opt = small_model()
    good = dict(server_key=str(keys / "server.key"), client_key=str(keys / "a.key_secret"))
    with pytest.raises(agent.ConfigError, match=r"agent\.server_key: .*missing\.key"):
        agent.attach(model, opt, **{**good, "server_key": str(tmp_path / "missing.key")})
    with pytest.raises(agent.ConfigError, match=r"agent\.client_key: .*holds only a public key"):
        agent.attach(model, opt, **{**good, "client_key": str(keys / "clients" / "a.key")})
    with pytest.raises(agent.ConfigError, match=r"agent\.client_key: needed with server_key .*set GRADWATCH_CLIENT_KEY"):
        agent.attach(model, opt, server_key=good["server_key"])
    with pytest.raises(agent.ConfigError, match=r"missing\.key' names no file"):  # it read "neither a certificate file nor ..."
        agent.attach(model, opt, **{**good, "server_key": str(tmp_path / "missing.key")})
    # a mistyped secret is named by its variable but never echoed
    bad_secret = "x" * 39
    monkeypatch.setenv("GRADWATCH_CLIENT_KEY", bad_secret)
    with pytest.raises(agent.ConfigError, match=r"agent\.client_key \(GRADWATCH_CLIENT_KEY\): ") as e:
        agent.attach(model, opt, server_key=good["server_key"])
    assert bad_secret not in str(e.value)
    # "/" is a Z85 character (in ~38 % of keys): such a secret, cut short, must not show as a path
    while b"/" not in (pair := zmq.curve_keypair())[1]:
        pass
    key = pair[1].decode()
    cert = (keys / "a.key_secret").read_text()
    for wrong in (key[:39], key[:24], f'"{key}"', f"{key} # client", f"GRADWATCH_CLIENT_KEY={key}", cert, "x" * 300):
        # cut, quoted (an --env-file), commented, pasted with its name, a certificate's text, too long for a path
        monkeypatch.setenv("GRADWATCH_CLIENT_KEY", wrong)
        with pytest.raises(agent.ConfigError, match=r"agent\.client_key \(GRADWATCH_CLIENT_KEY\): the value given") as e:
            agent.attach(model, opt, server_key=good["server_key"])
        assert key[:20] not in str(e.value) and "secret-key" not in str(e.value), wrong
    # a path to a secret's file is shown: it is no secret, and a typo in it must be seen
    monkeypatch.setenv("GRADWATCH_CLIENT_KEY", str(keys / "typo.key_secret"))
    with pytest.raises(agent.ConfigError, match="typo.key_secret"):
        agent.attach(model, opt, server_key=good["server_key"])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # nothing attached


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a check as another user")
def test_a_service_user_reaches_the_client_keys_and_is_told_when_it_cannot():
    """A service user (the systemd unit's DynamicUser) reads DIR/clients of a root-made
    `gradwatch keys DIR`: DIR is 0711, searchable by others; a directory on the way that it may not
    search is named as such (not as a path that "names no file")."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="gw-keys-"))
    try:
        os.chmod(base, 0o755)
        auth.make_keys(base / "keys")
        def as_nobody() -> str:
            """load_allowed(DIR/clients) in a forked child that became uid 65534 (no exec: the
            interpreter may sit where that user cannot read)."""
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: never returns into pytest
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    try:
                        out = str(len(auth.load_allowed(str(base / "keys" / "clients"))))
                    except auth.KeyMaterialError as e:
                        out = str(e)
                    os.write(w, out.encode())
                finally:
                    os._exit(0)
            os.close(w)
            with os.fdopen(r) as f:
                out = f.read()
            os.waitpid(pid, 0)
            return out

        assert as_nobody() == "1"
        os.chmod(base / "keys", 0o700)  # not searchable by others
        said = as_nobody()
        assert "permission denied to this process (uid 65534)" in said and "0711" in said, said
    finally:
        shutil.rmtree(base)


def test_a_key_with_whitespace_around_it_is_the_key(keys):
    """A secret store's value often ends in a newline: the key is read without it."""
    from gradwatch import auth

    public, secret = zmq.curve_keypair()
    assert auth.load_pair(f" {secret.decode()}\n") == (public, secret)
    assert auth.load_public(public.decode() + "\n") == public
    assert auth.load_allowed(f"{keys / 'clients'}\n") == auth.load_allowed(str(keys / "clients"))


def test_aggregator_key_errors_fail_at_start_naming_the_setting(keys, tmp_path):
    base = dict(listen="tcp://127.0.0.1:0", metrics_port=0)
    cases = [
        (dict(server_key=str(tmp_path / "nope.key_secret"), client_keys=str(keys / "clients")), r"aggregator\.server_key: .*nope"),
        (dict(server_key=str(keys / "server.key_secret"), client_keys=str(tmp_path)), r"aggregator\.client_keys: .*no \.key file"),
        (dict(server_key=str(keys / "server.key_secret")), r"aggregator\.client_keys: needed with server_key .*--client-keys"),
        # one secret file as the admitted key: accepted, it would admit the server's own pair
        (dict(server_key=str(keys / "server.key_secret"), client_keys=str(keys / "server.key_secret")),
         r"aggregator\.client_keys: .*holds a secret key: give the client's public \.key file"),
        # gradwatch keys' own directory: its server.key would be the one client admitted
        (dict(server_key=str(keys / "server.key_secret"), client_keys=str(keys)), r"aggregator\.client_keys: .*secret keys.*DIR/clients"),
    ]
    for settings, match in cases:
        with pytest.raises(ConfigError, match=match):
            Aggregator(load(**base, **settings)).start()


def test_aggregator_command_exits_naming_the_key_setting(keys, tmp_path):
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "gradwatch.aggregator", "--listen", "tcp://127.0.0.1:0", "--metrics-port", "0",
         "--server-key", str(tmp_path / "gone.key_secret"), "--client-keys", str(keys / "clients")],
        capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 2 and "aggregator.server_key" in run.stderr and "Traceback" not in run.stderr


def test_aggregator_cli_takes_keys_from_flags_and_environment(keys, monkeypatch):
    from pydantic_settings import CliApp

    monkeypatch.setenv("GRADWATCH_AGGREGATOR_SERVER_KEY", str(keys / "server.key_secret"))
    cfg = CliApp.run(AggregatorConfig, cli_args=["--client-keys", str(keys / "clients")])
    k = cfg.curve_keys()
    assert k.public == auth.load_public(str(keys / "server.key")) and len(k.clients) == 2
    assert str(keys) not in repr(cfg.server_key)  # a secret setting does not print


# --- plain TCP ------------------------------------------------------------------------------------------


def test_plain_defaults_bind_loopback_only():
    cfg = AggregatorConfig()
    assert cfg.listen == "tcp://127.0.0.1:5555" and cfg.metrics_host == "127.0.0.1" and cfg.listen_is_local
    assert cfg.curve_keys() is None
    agg = Aggregator(load(listen=cfg.listen.rpartition(":")[0] + ":0", metrics_port=0)).start()
    try:
        assert agg.endpoint.startswith("tcp://127.0.0.1:")
        assert agg._http.server_address[0] == "127.0.0.1"
    finally:
        agg.stop()


@pytest.mark.parametrize("listen, wide", [
    ("tcp://0.0.0.0:0", True), ("tcp://*:0", True), ("tcp://127.0.0.1:0", False), ("tcp://[::1]:0", False),
    ("ipc:///tmp/gw-{}.sock", False),
])
def test_wide_bind_without_curve_refuses_to_start_unless_insecure_plaintext(listen, wide, caplog):
    """Beyond loopback without keys anyone who reaches the port writes to the aggregator's state:
    it does not start (naming the setting and `gradwatch keys`) unless --insecure-plaintext says
    so, and then warns."""
    cfg = load(listen=listen.format(os.getpid()), metrics_host="127.0.0.1", metrics_port=0)
    assert cfg.listen_is_local is not wide
    if "[::1]" in listen:
        cfg = cfg.model_copy(update={"listen": "tcp://127.0.0.1:0"})  # the host may lack IPv6
    if wide:
        with pytest.raises(ConfigError, match=r"^aggregator\.listen: .*`gradwatch keys DIR`.*--insecure-plaintext"):
            Aggregator(cfg).start()
        cfg = cfg.model_copy(update={"insecure_plaintext": True})
    with caplog.at_level(logging.WARNING, logger="gradwatch.aggregator"):
        Aggregator(cfg).start().stop()
    warned = [r for r in caplog.records if "no CURVE" in r.getMessage()]
    assert bool(warned) is wide


@pytest.mark.ddp  # an interpreter of its own
def test_the_aggregator_command_exits_2_on_a_wide_listen_without_keys(tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "gradwatch.aggregator", "--listen", "tcp://0.0.0.0:0", "--metrics-port", "0"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "aggregator.listen" in run.stderr and "gradwatch keys" in run.stderr and "--insecure-plaintext" in run.stderr


def test_wide_bind_with_curve_does_not_warn(keys, caplog):
    cfg = load(listen="tcp://0.0.0.0:0", metrics_host="127.0.0.1", metrics_port=0,
               server_key=str(keys / "server.key_secret"), client_keys=str(keys / "clients"))
    with caplog.at_level(logging.WARNING, logger="gradwatch.aggregator"):
        Aggregator(cfg).start().stop()
    assert not [r for r in caplog.records if "no CURVE" in r.getMessage()]


def test_a_refused_agent_says_so_once_and_at_close(keys, curve_aggregator, caplog):
    """An agent whose client key the aggregator does not admit is told so by the handshake: it
    counts the refusals, logs one warning naming the settings to check, and warns again at close
    (instead of the silent "never connected"); training is unaffected."""
    agg = curve_aggregator
    stranger_pub, stranger_sec = zmq.curve_keypair()
    server_pub = auth.load_public(str(keys / "server.key"))
    model, opt = small_model()
    caplog.set_level("WARNING", logger="gradwatch.agent")
    monitor = agent.attach(model, opt, endpoint=agg.endpoint, every=1, job="refused", heartbeat_s=0.05,
                           server_key=server_pub.decode(), client_key=stranger_sec.decode())
    assert isinstance(monitor, agent.Monitor)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    wait_for(lambda: monitor.sender.refused >= 1, what="the refused handshake counted")
    # the sender thread counts the refusal, then logs: the log line may come a moment after the count
    said = wait_for(lambda: [r for r in caplog.records if "refused this agent's CURVE handshake" in r.getMessage()],
                    what="the warning")
    assert len(said) == 1 and "GRADWATCH_SERVER_KEY" in said[0].getMessage()
    # a refused key is final: the agent opens no new socket to knock again (ZeroMQ does not retry
    # it, nor does the agent: a job with a wrong key never floods the aggregator's key check)
    from gradwatch.agent.transport import REOPEN_AFTER_S

    time.sleep(REOPEN_AFTER_S + 1.0)
    assert monitor.sender.link.reopened == 0 and monitor.sender.refused == 1
    with pytest.warns(RuntimeWarning, match="refused this agent's CURVE handshake"):
        monitor.close()
    assert monitor.step == 5 and "refused" not in agg.state.jobs


@pytest.mark.parametrize("where", ["curve", "http"])
def test_an_agent_whose_handshake_never_completes_says_so(where, curve_aggregator, caplog, monkeypatch):
    """A keyless agent pointed at an aggregator with CURVE on, or at its HTTP port: TCP connects,
    no ZMTP handshake completes, nothing arrives. A TCP connection is no handshake: the agent
    counts the failed handshakes, warns once they have lasted HANDSHAKE_WARN_S (0.5 s here) naming
    the settings to check, and again at close. (A plain-TCP handshake times out after 1 s here.)"""
    from gradwatch.agent import transport

    monkeypatch.setattr(transport, "HANDSHAKE_WARN_S", 0.5)
    monkeypatch.setattr(transport, "HANDSHAKE_TIMEOUT_MS", 1000)
    agg = curve_aggregator
    endpoint = agg.endpoint if where == "curve" else f"tcp://127.0.0.1:{agg.metrics_port}"
    model, opt = small_model()
    caplog.set_level("WARNING", logger="gradwatch.agent")
    monitor = agent.attach(model, opt, endpoint=endpoint, every=1, job="keyless", heartbeat_s=0.05)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    wait_for(lambda: monitor.sender.refused >= 1, what="the failed handshake counted")
    said = wait_for(lambda: [r.getMessage() for r in caplog.records if "handshake with" in r.getMessage()],
                    timeout=30, what="the warning, once the failures lasted 2 s")
    assert len(said) == 1 and "GRADWATCH_SERVER_KEY" in said[0] and "ZeroMQ --listen port" in said[0]
    assert not monitor.sender.connected
    with pytest.warns(RuntimeWarning, match="handshake with .* failed"):
        monitor.close()
    assert monitor.step == 5 and "keyless" not in agg.state.jobs
