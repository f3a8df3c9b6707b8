"""The dashboards against real data: a fault-injected 3-rank demo -> a real aggregator process ->
the alerting tests' real Prometheus (tests/promstack.py: the shipped configuration, 1 s scrapes)
-> every panel's query, variables substituted, returns data; and the same aggregator, started
with ``--grafana-url``, posts its findings as annotations to the Grafana contract server.

The demo injects what the panels are about: a bit flip in rank 1's replica (replica_drift
names rank 1: consistency panels, annotations), a straggling rank 2 (rank health), and a few
malformed frames (the rejected-input panel). Panels are queried as Grafana would: range queries
over the run for time series, instant queries where the target is instant; a panel "has data"
when some series has a finite value. Only panels without PromQL (the alert list) are exempt.
"""

from __future__ import annotations

import math
import time

import pytest
import requests
import zmq

from gradwatch.grafana import generate

from .conftest import run_demo, start_aggregator, wait_for
from .grafana_contract import ContractServer
from .promstack import start_promstack
from .test_grafana_dashboards import label_values_queries, panel_queries

pytestmark = [pytest.mark.ddp, pytest.mark.stack]  # tiers: README, Tests

JOB, EVERY, STEPS = "grafana", 5, 40


class Prometheus:
    """Queries against the alerting tests' Prometheus (tests/promstack.py: the shipped config, 1 s scrapes)."""

    def __init__(self, url: str):
        self.url = url

    def api(self, path: str, **params) -> list:
        r = requests.get(self.url + "/api/v1/" + path, params=params, timeout=10)
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]["result"] if isinstance(body["data"], dict) else body["data"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grafana-stack")
    with ContractServer(token="glsa_annotations") as grafana:
        agg = start_aggregator(tmp, "--round-grace-s", "5", "--publish-interval-s", "0.05",
                               "--grafana-url", grafana.url, "--grafana-token", "glsa_annotations")
        try:
            stack = start_promstack(tmp / "stack", [agg.metrics_url.split("/")[2]])
        except BaseException:
            agg.stop()
            raise
        prom = Prometheus(stack.prometheus_url)
        try:
            wait_for(lambda: prom.api("query", query='up{job="gradwatch"} == 1'), 30, what="a first scrape")
            start = time.time()
            ctx = zmq.Context()
            push = ctx.socket(zmq.DEALER)
            push.setsockopt(zmq.LINGER, 2000)
            push.connect(agg.endpoint)
            for junk in (b"\x00not msgpack", b"\x81\xa1v\x63"):  # rejected input: malformed, unknown version
                push.send(junk)
            push.close()
            ctx.term()
            run_demo(agg.endpoint, ranks=3, steps=STEPS, every=EVERY, job=JOB,
                     inject=["drift@9:rank=1", "straggler@5:rank=2:seconds=0.05"])
            yield prom, agg, grafana, start
        finally:
            stack.stop()
            agg.stop()


def _finite(series: list) -> bool:
    for s in series:
        values = s.get("values") or [s["value"]]
        if any(math.isfinite(float(v)) for _, v in values):
            return True
    return False


def _substitute(expr: str, start: float) -> str:
    span = f"{int(time.time() - start) + 10}s"
    return (expr.replace("$job_id", JOB).replace("$rank", ".*").replace("$layer", ".*")
            .replace("$__rate_interval", "10s").replace("$__interval", "2s").replace("$__range", span))


def _empty_panels(prom: Prometheus, start: float) -> list[str]:
    empty = []
    for uid, d in generate.build().items():
        for p, t in panel_queries(d):
            expr = _substitute(t["expr"], start)
            if t.get("instant"):
                data = prom.api("query", query=expr)
            else:
                data = prom.api("query_range", query=expr, start=start, end=time.time(), step=1)
            if not _finite(data):
                empty.append(f"{uid} / {p['title']} / {t['refId']}: {expr}")
    return empty


def test_every_panel_query_returns_data_after_a_fault_injected_demo(stack):
    prom, agg, grafana, start = stack
    # the aggregator publishes within 0.05 s and Prometheus scrapes every second: allow a few scrapes
    deadline = time.monotonic() + 30
    while (empty := _empty_panels(prom, start)) and time.monotonic() < deadline:
        time.sleep(2)
    assert empty == [], "panels without data:\n" + "\n".join(empty)


def test_every_template_variable_has_values(stack):
    prom, agg, grafana, start = stack
    for uid, d in generate.build().items():
        for name, selector, label in label_values_queries(d):
            values = prom.api(f"label/{label}/values", **{"match[]": _substitute(selector, start)},
                              start=start, end=time.time())
            assert values, (uid, name)
            if name == "job_id":
                assert JOB in values


def test_findings_are_posted_to_grafana_as_annotations(stack):
    prom, agg, grafana, start = stack

    def drift_annotation():
        return [a for a in grafana.state.annotations if "check:replica_drift" in a["tags"]]

    (a,) = wait_for(drift_annotation, 20, what="the replica_drift finding as an annotation")
    assert a["tags"][:4] == ["gradwatch", f"job:{JOB}", "check:replica_drift", "rank:1"]
    assert "severity:critical" in a["tags"] and "replica_drift" in a["text"]
    raised = [e for e in agg.findings(JOB) if e["event"] == "raised"]
    # one annotation per raised finding (posted from a background thread: allow it a moment)
    wait_for(lambda: len(grafana.state.annotations) == len(raised), 10, what="one annotation per finding")
    assert abs(a["time"] / 1000 - next(e["time"] for e in raised if e["check"] == "replica_drift")) < 1
    posts = grafana.calls("POST", "/annotations")
    assert posts and all(r.authorization == "Bearer glsa_annotations" and r.status == 200 for r in posts)
    assert grafana.violations == []
