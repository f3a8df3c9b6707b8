"""``gradwatch grafana push`` and the aggregator's annotation poster against the Grafana contract
server (tests/grafana_contract.py): every request is checked against Grafana's HTTP API spec, and
the server keeps state, so pushing twice is shown to create nothing twice."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time

import pytest
import requests

from gradwatch.aggregator.runner import Event
from gradwatch.commands.cli import main as cli
from gradwatch.grafana import generate

from .conftest import free_port, wait_for
from .grafana_contract import ContractServer, Spec

TOKEN, USER, PASSWORD = "glsa_push", "admin", "s3cret"


@pytest.fixture(scope="module")
def spec():
    return Spec()


@pytest.fixture
def grafana(spec):
    with ContractServer(token=TOKEN, basic=(USER, PASSWORD), spec=spec) as srv:
        yield srv


def push(srv, *args: str) -> int:
    return cli(["grafana", "push", "--url", srv.url, *args])


def _counts(srv) -> tuple[int, int, int]:
    return len(srv.state.folders), len(srv.state.datasources), len(srv.state.dashboards)


def test_pushing_twice_creates_once_and_then_updates_in_place(grafana, capsys):
    assert push(grafana, "--token", TOKEN, "--prometheus-url", "http://prometheus:9090") == 0
    assert _counts(grafana) == (1, 1, 5)
    assert grafana.dashboards_in("gradwatch") == sorted(generate.build())
    assert {d["version"] for d in grafana.state.dashboards.values()} == {1}

    assert push(grafana, "--token", TOKEN, "--prometheus-url", "http://prometheus:9090") == 0
    assert _counts(grafana) == (1, 1, 5)  # nothing duplicated
    assert grafana.dashboards_in("gradwatch") == sorted(generate.build())  # still in their folder
    assert {d["version"] for d in grafana.state.dashboards.values()} == {2}  # updated in place
    assert len(grafana.calls("POST", "/folders")) == 1 and len(grafana.calls("POST", "/datasources")) == 1
    assert not grafana.calls("PUT", "/datasources/uid/{uid}")  # unchanged datasource left alone
    assert not [r for r in grafana.requests if r.method == "DELETE"]
    assert grafana.violations == []

    (folder,) = grafana.state.folders.values()
    assert (folder["uid"], folder["title"]) == (generate.FOLDER_UID, generate.FOLDER_TITLE)
    (ds,) = grafana.state.datasources.values()
    assert (ds["uid"], ds["type"], ds["url"], ds["access"]) == (generate.DATASOURCE_UID, "prometheus", "http://prometheus:9090", "proxy")
    for uid, want in generate.build().items():  # what Grafana holds is the committed dashboard
        got = dict(grafana.state.dashboards[uid]["dashboard"])
        assert {k: v for k, v in got.items() if k not in ("id", "version")} == want
        assert json.loads((generate.DASHBOARD_DIR / f"{uid}.json").read_text()) == want
    out = capsys.readouterr().out
    assert "folder gradwatch: created" in out and "folder gradwatch: unchanged" in out


def test_token_and_basic_auth_reach_grafana_as_the_authorization_header(grafana):
    assert push(grafana, "--token", TOKEN) == 0
    n = len(grafana.requests)
    assert {r.authorization for r in grafana.requests} == {f"Bearer {TOKEN}"}
    assert push(grafana, "--basic-auth", f"{USER}:{PASSWORD}") == 0
    basic = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    assert {r.authorization for r in grafana.requests[n:]} == {basic}
    assert _counts(grafana) == (1, 1, 5) and grafana.violations == []


def test_wrong_credentials_fail_in_one_line_and_change_nothing(grafana, capsys):
    assert push(grafana, "--token", "wrong") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "look up folder gradwatch" in err and "Unauthorized" in err
    assert _counts(grafana) == (0, 0, 0)


def test_unreachable_grafana_fails_in_one_line(capsys):
    assert cli(["grafana", "push", "--url", f"http://127.0.0.1:{free_port()}", "--token", "t", "--timeout", "2"]) == 1
    assert "cannot reach Grafana" in capsys.readouterr().err


def test_a_dashboard_someone_moved_stays_in_its_new_folder(grafana):
    assert push(grafana, "--token", TOKEN) == 0
    h = {"Authorization": f"Bearer {TOKEN}"}
    requests.post(grafana.url + "/api/folders", json={"uid": "team", "title": "Team"}, headers=h).raise_for_status()
    moved = grafana.state.dashboards["gradwatch-self"]["dashboard"]
    requests.post(grafana.url + "/api/dashboards/db", headers=h,
                  json={"dashboard": moved, "folderUid": "team", "overwrite": True}).raise_for_status()
    assert push(grafana, "--token", TOKEN) == 0
    assert grafana.dashboards_in("team") == ["gradwatch-self"]
    assert len(grafana.dashboards_in("gradwatch")) == 4 and grafana.violations == []


def test_a_changed_prometheus_url_updates_the_one_datasource(grafana):
    assert push(grafana, "--token", TOKEN, "--prometheus-url", "http://a:9090") == 0
    assert push(grafana, "--token", TOKEN, "--prometheus-url", "http://b:9090") == 0
    (ds,) = grafana.state.datasources.values()
    assert (ds["url"], ds["version"]) == ("http://b:9090", 2)
    assert push(grafana, "--token", TOKEN, "--skip-datasource", "--prometheus-url", "http://c:9090") == 0
    assert ds["url"] == "http://b:9090" and grafana.violations == []


def test_the_entry_point_runs_push_in_a_fresh_interpreter(grafana):
    run = subprocess.run([sys.executable, "-m", "gradwatch.commands", "grafana", "push", "--url", grafana.url + "/"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "GRAFANA_TOKEN": TOKEN})
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("created") == 7 and _counts(grafana) == (1, 1, 5)


def test_push_needs_credentials(grafana, monkeypatch, capsys):
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    assert push(grafana) == 2 and grafana.requests == []
    assert "give --token" in capsys.readouterr().err


# --- the contract server itself -------------------------------------------------------------------


def test_contract_server_models_a_save_without_folder_landing_in_general(grafana):
    """Why push names the folder on every update: Grafana moves a dashboard saved without one."""
    assert push(grafana, "--token", TOKEN) == 0
    d = grafana.state.dashboards["gradwatch-overview"]["dashboard"]
    r = requests.post(grafana.url + "/api/dashboards/db", json={"dashboard": d, "overwrite": True},
                      headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and grafana.dashboards_in("") == ["gradwatch-overview"]


@pytest.mark.parametrize("method, path, kwargs, status", [
    ("GET", "/api/nope", {}, 404),
    ("DELETE", "/api/search", {}, 405),
    ("GET", "/api/search", {"params": {"folderUid": "x"}}, 400),  # the spec's name is folderUIDs
    ("GET", "/api/search", {"params": {"type": "dashboard"}}, 400),  # not in its enum
    ("POST", "/api/folders", {"json": {"title": "x", "parentUID": "y"}}, 400),  # misspelt: parentUid
    ("POST", "/api/annotations", {"json": {"tags": ["a"]}}, 400),  # text is required
    ("POST", "/api/annotations", {"json": {"text": "a", "panelId": None}}, 400),  # null is no int64
    ("POST", "/api/annotations", {"data": "text=a", "headers": {"Content-Type": "text/plain"}}, 415),
])
def test_contract_server_rejects_what_the_spec_does_not_allow(grafana, method, path, kwargs, status):
    headers = {"Authorization": f"Bearer {TOKEN}", **kwargs.pop("headers", {})}
    r = requests.request(method, grafana.url + path, headers=headers, timeout=5, **kwargs)
    assert r.status_code == status, r.text
    assert "message" in r.json() and len(grafana.violations) == 1


def test_contract_server_wants_credentials(grafana):
    r = requests.get(grafana.url + "/api/search", timeout=5)
    assert r.status_code == 401 and grafana.violations == []


# --- findings as annotations -----------------------------------------------------------------------


def _event(kind="raised", rank=1, check="replica_drift"):
    return Event(kind, 1_700_000_000.25, check, "critical", "job-a", 10, rank, None, "rank 1 drifted", {})


def test_annotation_poster_posts_raised_findings_with_job_check_rank_tags(grafana):
    from gradwatch.aggregator.annotations import GrafanaAnnotations

    poster = GrafanaAnnotations(grafana.url, basic_auth=f"{USER}:{PASSWORD}")
    poster(_event())
    poster(_event("resolved"))  # only raised findings become annotations
    poster(_event(rank=None, check="training_stalled"))
    poster.close()
    assert (poster.posted, poster.failed, poster.dropped) == (2, 0, 0)
    first, second = grafana.state.annotations
    assert first["tags"] == ["gradwatch", "job:job-a", "check:replica_drift", "rank:1", "severity:critical"]
    assert first["time"] == 1_700_000_000_250 and "rank 1 drifted" in first["text"]
    assert "rank:" not in " ".join(second["tags"])
    assert grafana.violations == [] and all(r.authorization.startswith("Basic ") for r in grafana.requests)
    got = requests.get(grafana.url + "/api/annotations", params={"tags": ["job:job-a", "check:replica_drift"]},
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5).json()
    assert [a["id"] for a in got] == [first["id"]] and grafana.violations == []


def test_annotation_poster_never_blocks_the_caller_when_grafana_is_down():
    from gradwatch.aggregator.annotations import GrafanaAnnotations

    poster = GrafanaAnnotations(f"http://127.0.0.1:{free_port()}", token="t", timeout=1, max_queue=2)
    t0 = time.perf_counter()
    for _ in range(50):
        poster(_event())
    assert time.perf_counter() - t0 < 0.5  # the writer thread only queues
    poster.close(timeout=5)
    assert poster.posted == 0 and poster.failed >= 1 and poster.failed + poster.dropped == 50


def test_aggregator_posts_through_its_config(grafana):
    from gradwatch.aggregator import Aggregator, ConfigError, load

    with pytest.raises(ConfigError, match="grafana_url"):
        load(grafana_url="grafana.example")
    cfg = load(listen="tcp://127.0.0.1:0", metrics_host="127.0.0.1", metrics_port=0,
               grafana_url=grafana.url, grafana_token=TOKEN)
    agg = Aggregator(cfg)
    assert agg.annotations is not None and agg.annotations in agg.runner._sinks
    agg.annotations(_event())
    wait_for(lambda: grafana.state.annotations, 10, what="the annotation")
    agg.stop()
    assert grafana.calls("POST", "/annotations")[0].authorization == f"Bearer {TOKEN}"
    assert Aggregator(load(listen="tcp://127.0.0.1:0", metrics_port=0)).annotations is None
