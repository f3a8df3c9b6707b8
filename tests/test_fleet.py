"""Beyond one job: one aggregator per job, found by Prometheus, and a fleet's view.

- ``--file-sd-path``: the aggregator writes its Prometheus target file atomically (0644, the port
  it bound), once it serves /metrics, and removes it when it stops, not another aggregator's; bad
  settings fail at start naming them.
- The shipped configurations (deploy/prometheus/file-sd.yml, kubernetes-sd.yml, federation.yml,
  remote-write.yml; deploy/kubernetes/per-job/; deploy/slurm/) pass promtool, keep the scrape job's
  name and limits, and agree with each other.
- End to end on real servers: two aggregator processes of two jobs, each fed by a real agent in a
  tiny training process, found by one real Prometheus running file-sd.yml through the target
  files they wrote; every series comes from its own job's target, the recording rules give one
  series per job, a second Prometheus running federation.yml sees both jobs through /federate,
  and stopping the aggregators takes their targets away.
- kubernetes-sd.yml's relabelings, applied by a real Prometheus to the labels pod discovery gives
  the per-job aggregator's pod (Debian's Prometheus is built without Kubernetes discovery, so
  they reach it through a target file).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml

from gradwatch.aggregator import Aggregator, ConfigError, load
from gradwatch.commands import stack

from .conftest import ROOT, free_port, start_aggregator, wait_for
from .promstack import PROMTOOL, Prometheus, require

PROM = ROOT / "deploy" / "prometheus"
PER_JOB = ROOT / "deploy" / "kubernetes" / "per-job"
SBATCH = ROOT / "deploy" / "slurm" / "gradwatch-job.sbatch"
#: the Prometheus configurations with a `gradwatch` scrape job
SCRAPING = ("prometheus.yml", "file-sd.yml", "kubernetes-sd.yml")
LIMITS = ("sample_limit", "label_limit", "label_value_length_limit")


def config(name: str) -> dict:
    return yaml.safe_load((PROM / name).read_text())


def scrape_job(cfg: dict) -> dict:
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == stack.SCRAPE_JOB]
    return job


def pod_template(path: Path = PER_JOB / "aggregator.yaml") -> dict:
    (deployment,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "Deployment"]
    return deployment["spec"]["template"]


# --- --file-sd-path -------------------------------------------------------------------------------


def _aggregator(**settings) -> Aggregator:
    return Aggregator(load(listen="tcp://127.0.0.1:0", metrics_port=0, **settings))


def test_target_file_names_the_bound_port_while_the_aggregator_serves(tmp_path):
    path = tmp_path / "job-a.json"
    agg = _aggregator(file_sd_path=str(path), file_sd_labels={"job_id": "job-a", "cluster": "c1"}).start()
    try:
        assert agg.metrics_port != 0
        assert json.loads(path.read_text()) == [
            {"targets": [f"127.0.0.1:{agg.metrics_port}"], "labels": {"job_id": "job-a", "cluster": "c1"}}]
        assert path.stat().st_mode & 0o777 == 0o644  # Prometheus runs as another user
        assert os.listdir(tmp_path) == ["job-a.json"]  # no temporary file left beside it
        (target,) = json.loads(path.read_text())[0]["targets"]
        assert requests.get(f"http://{target}/healthz", timeout=5).json() == {"ok": True}  # it names this aggregator
    finally:
        agg.stop()
    assert not path.exists()


def test_target_host_is_this_hosts_name_when_metrics_bind_every_interface():
    import socket

    from gradwatch.aggregator.discovery import target_host

    assert target_host("0.0.0.0") == target_host("::") == socket.gethostname()
    assert target_host("0.0.0.0", "node7.example") == "node7.example"
    assert (target_host("127.0.0.1"), target_host("::1"), target_host("0.0.0.0", "fd00::7")) == ("127.0.0.1", "[::1]", "[fd00::7]")


def test_file_sd_host_overrides_the_target_host(tmp_path):
    path = tmp_path / "t.yml"  # YAML too: Prometheus reads it by suffix, and JSON is YAML
    agg = _aggregator(file_sd_path=str(path), file_sd_host="node7.example").start()
    try:
        assert yaml.safe_load(path.read_text()) == [{"targets": [f"node7.example:{agg.metrics_port}"], "labels": {}}]
    finally:
        agg.stop()


def test_stop_leaves_a_target_file_another_aggregator_wrote_since(tmp_path):
    path = tmp_path / "job.json"
    first = _aggregator(file_sd_path=str(path)).start()
    second = _aggregator(file_sd_path=str(path)).start()  # e.g. the job requeued
    try:
        first.stop()
        assert json.loads(path.read_text())[0]["targets"] == [f"127.0.0.1:{second.metrics_port}"]
    finally:
        second.stop()
    assert not path.exists()


def test_unwritable_target_directory_fails_at_start_naming_the_setting_and_frees_the_ports(tmp_path):
    port = free_port()
    cfg = load(listen="tcp://127.0.0.1:0", metrics_port=port, file_sd_path=str(tmp_path / "missing" / "t.json"))
    with pytest.raises(ConfigError, match="file_sd_path"):
        Aggregator(cfg).start()
    Aggregator(load(listen="tcp://127.0.0.1:0", metrics_port=port)).start().stop()  # the HTTP port was released


@pytest.mark.parametrize("settings, match", [
    (dict(file_sd_path="targets/job.txt"), "file_sd_path"),  # Prometheus refuses other suffixes
    (dict(file_sd_labels={"job": "x"}), "file_sd_labels"),  # would move it out of the scrape job `gradwatch`
    (dict(file_sd_labels={"__address__": "x"}), "file_sd_labels"),
    (dict(file_sd_labels={"slurm-job": "1"}), "file_sd_labels"),
])
def test_invalid_file_sd_settings_fail_naming_them(settings, match):
    with pytest.raises(ConfigError, match=match):
        load(**settings)


def test_file_sd_labels_parse_from_the_command_line_and_the_environment(monkeypatch):
    from pydantic_settings import CliApp

    from gradwatch.aggregator import AggregatorConfig

    cfg = CliApp.run(AggregatorConfig, cli_args=["--file-sd-labels", "job_id=j1,slurm_job_id=42"])
    assert cfg.file_sd_labels == {"job_id": "j1", "slurm_job_id": "42"}
    monkeypatch.setenv("GRADWATCH_AGGREGATOR_FILE_SD_LABELS", '{"job_id": "j2"}')
    assert load().file_sd_labels == {"job_id": "j2"}


# --- the shipped configurations ---------------------------------------------------------------------


def test_every_gradwatch_scrape_job_keeps_the_name_and_limits_of_prometheus_yml():
    shipped = scrape_job(config("prometheus.yml"))
    for name in SCRAPING[1:]:
        job = scrape_job(config(name))
        assert {k: job[k] for k in LIMITS} == {k: shipped[k] for k in LIMITS}, name
        assert job["honor_labels"] is True, name  # else a target's job_id would rename the series' own to exported_job_id
        assert config(name)["rule_files"] == config("prometheus.yml")["rule_files"], name
        assert config(name)["global"]["external_labels"]["cluster"], name  # tells the clusters apart in federation.yml


def test_federation_and_remote_write_carry_the_recording_rules_up_and_alerts():
    records = {r["record"] for g in yaml.safe_load((PROM / "rules" / "gradwatch.rules.yml").read_text())["groups"]
               for r in g["rules"] if "record" in r}
    (fed,) = config("federation.yml")["scrape_configs"]
    assert fed["metrics_path"] == "/federate" and fed["honor_labels"] is True
    match = fed["params"]["match[]"]
    assert '{__name__=~"job_id:gradwatch_.+"}' in match and 'up{job="gradwatch"}' in match
    assert all(re.fullmatch("job_id:gradwatch_.+", r) for r in records)  # the match[] selects every one
    (rw,) = config("remote-write.yml")["remote_write"]
    keep = [r for r in rw["write_relabel_configs"] if r["action"] == "keep"]
    names = next(r["regex"] for r in keep if r["source_labels"] == ["__name__"])
    assert all(re.fullmatch(names, n) for n in (*records, "up", "ALERTS")) and not re.fullmatch(names, "gradwatch_layer_grad_norm")


@pytest.mark.stack
@pytest.mark.parametrize("name", ["file-sd.yml", "federation.yml", "remote-write.yml"])
def test_promtool_check_config(name):
    require(PROMTOOL)
    r = subprocess.run([PROMTOOL, "check", "config", str(PROM / name)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.stack
def test_promtool_check_config_kubernetes_sd_but_for_its_discovery(tmp_path):
    """All of kubernetes-sd.yml but ``kubernetes_sd_configs``, which Debian's promtool does not know."""
    require(PROMTOOL)
    cfg = config("kubernetes-sd.yml")
    job = scrape_job(cfg)
    assert [sd["role"] for sd in job.pop("kubernetes_sd_configs")] == ["pod"]
    job["file_sd_configs"] = [{"files": [str(tmp_path / "*.json")]}]
    cfg["rule_files"] = [str(PROM / f) for f in cfg["rule_files"]]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    r = subprocess.run([PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_per_job_kubernetes_pod_is_what_the_scrape_job_and_the_podmonitor_select():
    labels = pod_template()["metadata"]["labels"]
    (container,) = pod_template()["spec"]["containers"]
    assert "metrics" in {p["name"] for p in container["ports"]}
    from pydantic_settings import CliApp

    from gradwatch.aggregator import AggregatorConfig

    cfg = CliApp.run(AggregatorConfig, cli_args=container["args"][1:])
    assert cfg.metrics_port == next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")

    (pm,) = yaml.safe_load_all((PER_JOB / "podmonitor.yaml").read_text())
    spec = pm["spec"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert all(e["key"] in labels for e in spec["selector"]["matchExpressions"])
    assert labels[spec["jobLabel"]] == stack.SCRAPE_JOB  # the operator's job label
    shipped = scrape_job(config("prometheus.yml"))
    assert (spec["sampleLimit"], spec["labelLimit"], spec["labelValueLengthLimit"]) == tuple(shipped[k] for k in LIMITS)
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    to_job_id = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}["job_id"]
    relabels = scrape_job(config("kubernetes-sd.yml"))["relabel_configs"]
    assert to_job_id == next(r["source_labels"] for r in relabels if r.get("target_label") == "job_id")


def test_sbatch_starts_an_aggregator_that_announces_itself_where_the_ranks_report():
    """The script's aggregator command, its variables given values, parses as aggregator flags;
    the ranks' GRADWATCH_ENDPOINT names its port; it writes a target file per job and picks its port."""
    from pydantic_settings import CliApp

    from gradwatch.aggregator import AggregatorConfig

    text = SBATCH.read_text()
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    assert re.search(r"^#SBATCH --nodes=", text, re.M)
    joined = text.replace("\\\n", " ")
    (line,) = [ln for ln in joined.splitlines() if re.match(r'\s*"\$VENV/bin/gradwatch" aggregator ', ln)]
    env = {"VENV": "/v", "GRADWATCH_KEYS": "/k", "zmq_port": "21234", "SLURM_JOB_ID": "1234", "TARGETS_DIR": "/t",
           "GRADWATCH_JOB": "1234", "SLURM_SUBMIT_DIR": "/s", "head_node": "node1"}

    def expand(s: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], s)

    args = [expand(a) for a in shlex.split(line, comments=True)]
    assert args[:2] == ["/v/bin/gradwatch", "aggregator"] and args[-1] == "&"
    cfg = CliApp.run(AggregatorConfig, cli_args=args[2:-1])
    assert (cfg.file_sd_path, cfg.metrics_port, cfg.file_sd_labels["job_id"]) == ("/t/1234.json", 0, "1234")
    assert (cfg.server_key.get_secret_value(), cfg.client_keys) == ("/k/server.key_secret", "/k/clients")  # CURVE on
    endpoint = expand(re.search(r'^export GRADWATCH_ENDPOINT="(.+)"', text, re.M).group(1))
    assert endpoint == "tcp://node1:" + cfg.listen.rsplit(":", 1)[1]
    assert "trap 'kill -TERM \"$aggregator\"" in text  # stopped (so its file removed) when the job ends


# --- end to end ----------------------------------------------------------------------------------


#: a rank's whole training script, world 1: the agent finds the aggregator and the job id in
#: GRADWATCH_ENDPOINT and GRADWATCH_JOB, as under Slurm; it trains until the file argv[1] exists
TINY_JOB = """
import os, sys, time
import torch
import gradwatch.agent as gw

torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with gw.attach(model, opt, every=5, heartbeat_s=0.2):
    while not os.path.exists(sys.argv[1]):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)
"""
JOBS = ("job-a", "job-b")


def local(cfg: dict) -> dict:
    """A shipped configuration for this test: 1 s scrapes and evaluations, the shipped rule files by
    absolute path, no Alertmanager (none runs here)."""
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(PROM / f) for f in cfg.get("rule_files", [])]
    cfg.pop("alerting", None)
    return cfg


def by_job(result: list[dict]) -> dict[str, dict]:
    """{job_id: labels} of an instant vector with at most one series per job (asserted)."""
    out = {}
    for s in result:
        job = s["metric"].get("job_id")
        assert job not in out, result
        out[job] = s["metric"]
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two aggregator processes announcing themselves in TARGETS_DIR, a tiny training job reporting
    to each, and a Prometheus running file-sd.yml on TARGETS_DIR: ``(aggregators, prometheus,
    targets dir, tmp)``, aggregators by job id."""
    require("prometheus")
    tmp = tmp_path_factory.mktemp("fleet")
    targets = tmp / "targets"
    targets.mkdir()
    stop = tmp / "stop"
    aggs, jobs, proms = {}, [], []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    try:
        for job in JOBS:
            aggs[job] = start_aggregator(tmp, "--publish-interval-s", "0.05", "--file-sd-path", str(targets / f"{job}.json"),
                                         "--file-sd-labels", f"job_id={job}")
        for job in JOBS:
            jobs.append(subprocess.Popen(
                [sys.executable, "-c", TINY_JOB, str(stop)], stdout=(tmp / f"{job}.log").open("w"), stderr=subprocess.STDOUT,
                env={**env, "GRADWATCH_ENDPOINT": aggs[job].endpoint, "GRADWATCH_JOB": job}))
        cfg = local(config("file-sd.yml"))
        sd = scrape_job(cfg)["file_sd_configs"][0]
        sd["files"] = [str(targets / "*.json")]
        sd["refresh_interval"] = "1s"
        proms.append(Prometheus(tmp / "prometheus", cfg))
        yield aggs, proms[0], targets, tmp
    finally:
        stop.touch()
        for p in jobs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        for p in proms:
            p.stop()
        for a in aggs.values():
            a.stop()


def _logs(tmp: Path) -> str:
    """The training jobs' and aggregators' logs, for a failure message."""
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(tmp.glob("*.log")))


def _instance(agg) -> str:
    return agg.metrics_url.split("//", 1)[1].rsplit("/", 1)[0]


@pytest.mark.stack
@pytest.mark.ddp
def test_one_prometheus_scrapes_each_jobs_aggregator_found_through_its_target_file(fleet):
    aggs, prom, targets, tmp = fleet
    assert sorted(os.listdir(targets)) == ["job-a.json", "job-b.json"]
    up = wait_for(lambda: len(r := prom.query('up{job="gradwatch"} == 1')) == 2 and r, 30,
                  what=f"both aggregators up in Prometheus\n{prom.log_tail()}")
    # up carries the job_id of its target file: an AggregatorDown would be grouped with its job
    assert {j: m["instance"] for j, m in by_job(up).items()} == {j: _instance(a) for j, a in aggs.items()}
    active = prom.targets()["activeTargets"]
    assert sorted(t["discoveredLabels"]["__meta_filepath"] for t in active) == sorted(str(targets / f"{j}.json") for j in JOBS)

    # each job's series come from its own aggregator, and only from it
    steps = wait_for(lambda: len(r := prom.query("gradwatch_rank_steps_total > 0")) == 2 and r, 60,
                     what=f"both jobs' steps in Prometheus\n{prom.log_tail()}\n{_logs(tmp)}")
    # exactly these labels: without honor_labels the target's job_id would add exported_job_id
    assert by_job(steps) == {j: {"__name__": "gradwatch_rank_steps_total", "job": "gradwatch", "instance": _instance(a),
                                 "job_id": j, "rank": "0"} for j, a in aggs.items()}
    pairs = prom.query('count by (job_id, instance) ({job="gradwatch", job_id!="", __name__=~"gradwatch_.+"})')
    assert {(s["metric"]["job_id"], s["metric"]["instance"]) for s in pairs} == {(j, _instance(a)) for j, a in aggs.items()}
    # the aggregator's own series (no job_id of their own) get the target's
    received = by_job(prom.query('gradwatch_messages_received_total{kind="report"}'))
    assert {j: m["instance"] for j, m in received.items()} == {j: _instance(a) for j, a in aggs.items()}


@pytest.mark.stack
@pytest.mark.ddp
def test_a_shipped_recording_rule_gives_one_series_per_job(fleet):
    aggs, prom, _, _ = fleet
    rate = wait_for(lambda: len(r := prom.query("job_id:gradwatch_steps:rate1m > 0")) == 2 and r, 30,
                    what=f"job_id:gradwatch_steps:rate1m for both jobs\n{prom.log_tail()}")
    assert {j: m["instance"] for j, m in by_job(rate).items()} == {j: _instance(a) for j, a in aggs.items()}


@pytest.mark.stack
@pytest.mark.ddp
def test_a_global_prometheus_federates_both_jobs(fleet):
    aggs, prom, _, tmp = fleet
    cfg = local(config("federation.yml"))
    (job,) = cfg["scrape_configs"]
    job["static_configs"] = [{"targets": [prom.address]}]
    cluster = config("file-sd.yml")["global"]["external_labels"]["cluster"]
    wait_for(lambda: len(prom.query("job_id:gradwatch_steps:rate1m")) == 2, 30, what="the recording rule in the cluster Prometheus")
    fed = Prometheus(tmp / "global", cfg)
    try:
        rate = wait_for(lambda: len(r := fed.query("job_id:gradwatch_steps:rate1m")) == 2 and r, 30,
                        what=f"both jobs in the global Prometheus\n{fed.log_tail()}")
        assert {j: (m["instance"], m["job"], m["cluster"]) for j, m in by_job(rate).items()} == {
            j: (_instance(a), "gradwatch", cluster) for j, a in aggs.items()}
        assert set(by_job(fed.query('up{job="gradwatch"}'))) == set(JOBS)
        assert not fed.query("gradwatch_rank_steps_total")  # the per-rank series stay in the cluster
    finally:
        fed.stop()


def pod_discovery(pod: dict, namespace: str, name: str, phase: str, addresses: dict[str, str]) -> list[dict]:
    """The targets Prometheus' Kubernetes pod discovery (role: pod) makes of ``pod`` (a pod
    template: labels and containers): one per container port, with its documented meta labels;
    ``addresses`` gives each port name's HOST:PORT."""
    def sanitize(label: str) -> str:
        return re.sub(r"[^a-zA-Z0-9_]", "_", label)

    meta = {"__meta_kubernetes_namespace": namespace, "__meta_kubernetes_pod_name": name,
            "__meta_kubernetes_pod_phase": phase, "__meta_kubernetes_pod_ready": str(phase == "Running").lower()}
    for k, v in pod["metadata"]["labels"].items():
        meta[f"__meta_kubernetes_pod_label_{sanitize(k)}"] = v
        meta[f"__meta_kubernetes_pod_labelpresent_{sanitize(k)}"] = "true"
    return [
        {"targets": [addresses[port["name"]]],
         "labels": {**meta, "__meta_kubernetes_pod_container_name": c["name"],
                    "__meta_kubernetes_pod_container_port_name": port["name"],
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                    "__meta_kubernetes_pod_container_port_protocol": "TCP"}}
        for c in pod["spec"]["containers"] for port in c.get("ports", [])
    ]


@pytest.mark.stack
@pytest.mark.ddp
def test_kubernetes_sd_relabelings_keep_the_per_job_aggregator_pod_and_name_its_job(fleet):
    """The per-job pod (at job-a's aggregator's address) is kept, with job_id from its
    gradwatch.io/job label; its ZeroMQ port, a finished earlier pod and a training pod are not."""
    aggs, _, _, tmp = fleet
    pod = pod_template()
    job_label = pod["metadata"]["labels"]["gradwatch.io/job"]
    metrics, zmq = _instance(aggs["job-a"]), aggs["job-a"].endpoint.split("//", 1)[1]
    trainer = {"metadata": {"labels": {"app.kubernetes.io/name": "trainer", "gradwatch.io/job": job_label}},
               "spec": {"containers": [{"name": "train", "ports": [{"name": "metrics", "containerPort": 8000}]}]}}
    discovered = [
        *pod_discovery(pod, "ml", "gradwatch-run-1", "Running", {"metrics": metrics, "zmq": zmq}),
        *pod_discovery(pod, "ml", "gradwatch-run-0", "Succeeded", {"metrics": "127.0.0.1:9", "zmq": "127.0.0.1:9"}),
        *pod_discovery(trainer, "ml", "trainer-0", "Running", {"metrics": "127.0.0.1:9"}),
    ]
    sd_file = tmp / "pods.json"
    sd_file.write_text(json.dumps(discovered))
    cfg = local(config("kubernetes-sd.yml"))
    job = scrape_job(cfg)
    job.pop("kubernetes_sd_configs")
    job["file_sd_configs"] = [{"files": [str(sd_file)]}]
    prom = Prometheus(tmp / "k8s", cfg)
    try:
        (up,) = wait_for(lambda: prom.query('up{job="gradwatch"} == 1'), 30, what=f"the pod scraped\n{prom.log_tail()}")
        assert up["metric"] == {"__name__": "up", "job": "gradwatch", "instance": metrics, "job_id": job_label,
                                "namespace": "ml", "pod": "gradwatch-run-1"}
        targets = prom.targets()
        assert len(targets["activeTargets"]) == 1
        assert len(targets["droppedTargets"]) == len(discovered) - 1  # its zmq port, the finished pod, the trainer
    finally:
        prom.stop()


@pytest.mark.stack
@pytest.mark.ddp
def test_stopped_aggregators_remove_their_target_files_and_prometheus_drops_them(fleet):
    """Last in the module: it stops the fleet's aggregators."""
    aggs, prom, targets, _ = fleet
    wait_for(lambda: len(prom.targets()["activeTargets"]) == 2, 30, what="both targets active")
    for agg in aggs.values():
        agg.stop()  # SIGTERM, as at the end of a Slurm job
        assert agg.proc.wait(10) == 0
    assert os.listdir(targets) == []
    wait_for(lambda: not prom.targets()["activeTargets"], 20, what="Prometheus dropping both targets")
