"""Alerting end to end on real servers: a real aggregator process, real 3-rank gloo DDP demo jobs,
and Prometheus and Alertmanager started by ``gradwatch stack``'s code with the shipped configuration
(1 s scrapes and evaluations, ``for:`` x 0.02, 1 s notification delays) on loopback, delivering to
a webhook receiver run here.

- A clean run fires nothing but the Watchdog, which Alertmanager delivers.
- A replica drift injected on rank 1 fires ReplicaDivergence in Prometheus's /api/v1/alerts, with
  job_id and rank, and Alertmanager delivers it to the critical receiver, grouped by job_id.
- Alertmanager holds back a warning while a critical alert of the same job and rank fires, not
  another job's nor another rank's (the shipped inhibit rule).
"""

from __future__ import annotations

import threading
import time

import pytest

from .conftest import run_demo, samples, start_aggregator, wait_for
from .promstack import require_servers, start_promstack

pytestmark = [pytest.mark.ddp, pytest.mark.stack]  # tiers: README, Tests


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    require_servers()
    tmp = tmp_path_factory.mktemp("alerting")
    agg = start_aggregator(tmp, "--round-grace-s", "3", "--publish-interval-s", "0.05")
    try:
        ps = start_promstack(tmp / "stack", [agg.metrics_url.split("://", 1)[1].rsplit("/", 1)[0]])
    except BaseException:
        agg.stop()
        raise
    try:
        wait_for(lambda: ps.query('up{job="gradwatch"} == 1'), 30, what="Prometheus scraping the aggregator")
        yield agg, ps
    finally:
        ps.stop()
        agg.stop()


def _settled(agg, ps, job: str, last_probe: int) -> None:
    """Wait until the job's last probed step is published and Prometheus has scraped it."""
    wait_for(lambda: samples(agg.scrape(), "gradwatch_job_probe_step").get((("job_id", job),)) == last_probe,
             20, what=f"probe step {last_probe} of {job} at /metrics")
    wait_for(lambda: ps.query(f'gradwatch_job_probe_step{{job_id="{job}"}} == {last_probe}'), 15,
             what=f"probe step {last_probe} of {job} in Prometheus")


class AlertSampler:
    """Polls Prometheus's active alerts (pending and firing) in the background, keeping every one seen."""

    def __init__(self, ps):
        self.ps, self.seen, self._stop = ps, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.5):
            try:
                self.seen.extend(self.ps.alerts())
            except Exception:  # one failed poll is not a finding
                pass

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(5)
        self.seen.extend(self.ps.alerts())
        return self.seen


def test_clean_run_fires_nothing_but_the_watchdog(env):
    agg, ps = env
    # the pipeline delivers: the Watchdog reaches its receiver ...
    wait_for(lambda: [a for _, a in ps.webhook.alerts("/watchdog") if a["labels"]["alertname"] == "Watchdog"], 30,
             what="the Watchdog at the webhook")
    # ... and start-up transients (no scrape yet: absent(up)) are over
    wait_for(lambda: {a["labels"]["alertname"] for a in ps.alerts()} == {"Watchdog"}, 30,
             what="only the Watchdog active")
    ps.webhook.clear()
    sampler = AlertSampler(ps)
    try:
        run_demo(agg.endpoint, ranks=3, steps=25, every=10, job="clean")
        _settled(agg, ps, "clean", 20)
        time.sleep(3)  # a few more scrapes and evaluations of the finished job
    finally:
        seen = sampler.stop()
    assert {a["labels"]["alertname"] for a in seen} == {"Watchdog"}, [a["labels"] for a in seen if a["labels"]["alertname"] != "Watchdog"]
    delivered = {a["labels"]["alertname"] for _, a in ps.webhook.alerts()}
    assert delivered <= {"Watchdog"}, ps.webhook.notifications()
    assert not ps.query('job_id:gradwatch_checks_in_finding:sum{job_id="clean"} > 0')


def test_replica_drift_fires_in_prometheus_and_reaches_the_webhook(env):
    agg, ps = env
    run_demo(agg.endpoint, ranks=3, steps=25, every=10, inject=["drift@9:rank=1"], job="drift")

    (alert,) = wait_for(lambda: ps.firing("ReplicaDivergence", job_id="drift"), 30,
                        what=f"ReplicaDivergence firing in Prometheus\n{ps.logs()}")
    labels = alert["labels"]
    assert (labels["rank"], labels["severity"], labels["check"], labels["job"]) == ("1", "critical", "replica_drift", "gradwatch")
    assert alert["annotations"]["runbook_url"].endswith("RUNBOOK.md#replicadivergence")
    assert "Rank 1" in alert["annotations"]["description"]

    def delivered():
        return [
            (n, a) for n in ps.webhook.notifications("/critical") for a in n["alerts"]
            if a["labels"].get("alertname") == "ReplicaDivergence" and a["labels"].get("job_id") == "drift"
        ]

    (note, got), *_ = wait_for(delivered, 30, what=f"ReplicaDivergence at the webhook\n{ps.logs()}")
    assert got["status"] == "firing" and got["labels"]["rank"] == "1" and got["labels"]["severity"] == "critical"
    assert note["receiver"] == "gradwatch-critical" and note["groupLabels"] == {"job_id": "drift"}
    # the links a notification carries reach this stack (they named the host: http://HOSTNAME:port)
    assert got["generatorURL"].startswith(ps.prometheus_url + "/"), got["generatorURL"]
    assert note["externalURL"] == ps.alertmanager_url, note["externalURL"]


def test_alertmanager_holds_back_warnings_under_a_critical_of_the_same_job_and_rank(env):
    _, ps = env

    def alert(name, severity, job, rank=None):
        labels = {"alertname": name, "severity": severity, "job_id": job, **({"rank": rank} if rank else {})}
        return {"labels": labels, "annotations": {"summary": name}}

    # a job-level critical holds back the job's job-level warning; a critical naming rank 1 holds
    # back rank 1's warning, not rank 2's (another fault: a straggler beside an explosion)
    ps.post_alerts([alert("TestCritical", "critical", "inhibited"), alert("TestWarning", "warning", "inhibited"),
                    alert("TestWarning", "warning", "free"),
                    alert("TestCritical", "critical", "ranked", "1"), alert("TestWarning", "warning", "ranked", "1"),
                    alert("TestWarning", "warning", "ranked", "2")])

    def got(path, name):
        return {(a["labels"]["job_id"], a["labels"].get("rank")) for _, a in ps.webhook.alerts(path)
                if a["labels"]["alertname"] == name}

    wait_for(lambda: got("/critical", "TestCritical") == {("inhibited", None), ("ranked", "1")}, 20,
             what="the critical test alerts delivered")
    wait_for(lambda: {("free", None), ("ranked", "2")} <= got("/warning", "TestWarning"), 20,
             what="the other job's warning and the other rank's delivered")

    def state(job, rank=None):
        (a,) = [a for a in ps.am_alerts() if a["labels"]["alertname"] == "TestWarning" and a["labels"]["job_id"] == job
                and a["labels"].get("rank") == rank]
        return a["status"]

    for job, rank in (("inhibited", None), ("ranked", "1")):
        assert state(job, rank)["state"] == "suppressed" and state(job, rank)["inhibitedBy"], (job, rank)
    assert state("free")["state"] == "active" and state("ranked", "2")["state"] == "active"
    time.sleep(2)  # more than group_wait and group_interval: the inhibited warnings would be out by now
    assert got("/warning", "TestWarning") == {("free", None), ("ranked", "2")}


def test_a_spike_pages_naming_its_rank_even_if_no_scrape_saw_it_flagged(env):
    """An explosion finding lasts spike_window steps, often less than a scrape interval: its rank's
    check_rank_flagged may never be scraped, and GradientExplosion would page for the job alone,
    without its rank. gradwatch_rank_finding_raised_timestamp_seconds keeps the
    rank: one alert, naming rank 2, whether or not a scrape caught the flag."""
    agg, ps = env
    run_demo(agg.endpoint, ranks=3, steps=25, every=10, inject=["explode@20:rank=2"], job="spike")
    wait_for(lambda: ps.query('gradwatch_rank_finding_raised_timestamp_seconds{job_id="spike",check="explosion",rank="2"}'),
             30, what=f"rank 2's explosion finding's time in Prometheus\n{ps.logs()}")
    (alert,) = wait_for(lambda: ps.firing("GradientExplosion", job_id="spike"), 30,
                        what=f"GradientExplosion firing in Prometheus\n{ps.logs()}")
    assert (alert["labels"]["rank"], alert["labels"]["severity"]) == ("2", "critical"), alert["labels"]
    assert "rank 2 (the likely source)" in alert["annotations"]["description"], alert["annotations"]
    time.sleep(3)  # more evaluations: still the one alert, no job-level twin beside it
    assert [a["labels"].get("rank") for a in ps.firing("GradientExplosion", job_id="spike")] == ["2"]
