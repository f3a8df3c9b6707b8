"""The shipped alerting configuration, checked by the real tools and against the aggregator's
registries: promtool check config / check rules / test rules, amtool check-config and routes;
every metric and check the rules name exists; every alert has labels, annotations, a runbook
section and firing and not-firing unit tests; the thresholds are stated once; the Kubernetes,
systemd and local (``gradwatch stack``) forms agree with the shipped files."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from gradwatch.commands import cli, stack
from gradwatch.aggregator.checks import CHECKS, load_all
from gradwatch.aggregator.exporter import METRICS

from .conftest import ROOT
from .promstack import AMTOOL, PROMTOOL, require

DEPLOY = ROOT / "deploy"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
RULES = DEPLOY / "prometheus" / "rules" / "gradwatch.rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "tests" / "gradwatch.test.yml"
AM_CONFIG = DEPLOY / "alertmanager" / "alertmanager.yml"
RUNBOOK = DEPLOY / "RUNBOOK.md"

#: the alerts the issue asks for, by the check (or pipeline part) they cover
REQUIRED = {
    "GradientExplosion", "GradientVanishing", "NonFiniteValues", "GradientDesync", "ReplicaDivergence",
    "OutlierRank", "DeadUnits", "StragglerRank", "RankSilent", "TrainingStalled",
    "AggregatorDown", "AgentDroppingReports", "IncompleteRounds", "Watchdog",
}
#: registered checks that never raise a finding (a dashboard value only), hence no alert
NO_FINDINGS = {"noise_scale"}
#: series Prometheus itself writes
PROMETHEUS_SERIES = {"up", "scrape_samples_scraped"}
#: a series name (recording rules' names hold colons)
SERIES = re.compile(r"(?<![\w:])([a-zA-Z_][a-zA-Z0-9_:]*)")


def run(*cmd: str) -> subprocess.CompletedProcess:
    require(cmd[0])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def alerts() -> dict[str, dict]:
    return {r["alert"]: r for r in rules() if "alert" in r}


def exported_names() -> set[str]:
    """Every series name the aggregator can export, as Prometheus sees it."""
    load_all()
    out = {"gradwatch_decode_seconds", "gradwatch_decode_seconds_count", "gradwatch_decode_seconds_sum"}
    for d in METRICS.values():
        name = d.name if not d.unit or d.name.endswith("_" + d.unit) else f"{d.name}_{d.unit}"
        out.add(name + ("_total" if d.kind == "counter" else ""))
    return out


# --- the real tools ------------------------------------------------------------------------------


@pytest.mark.stack
@pytest.mark.parametrize("cmd, says", [
    ((PROMTOOL, "check", "config", str(PROM_CONFIG)), ""),
    ((PROMTOOL, "check", "rules", str(RULES)), ""),
    # every alert firing and not firing, NaN/Inf included (deploy/prometheus/tests/)
    ((PROMTOOL, "test", "rules", str(RULE_TESTS)), "SUCCESS"),
    ((AMTOOL, "check-config", str(AM_CONFIG)), ""),
], ids=["promtool-config", "promtool-rules", "promtool-unit-tests", "amtool-config"])
def test_the_shipped_configuration_passes_the_real_tools(cmd, says):
    r = run(*cmd)
    assert r.returncode == 0 and says in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("labels, receiver", [
    ("alertname=ReplicaDivergence severity=critical job_id=j", "gradwatch-critical"),
    ("alertname=StragglerRank severity=warning job_id=j", "gradwatch-warning"),
    ("alertname=X severity=info job_id=j", "gradwatch-info"),
    ("alertname=Watchdog severity=info", "gradwatch-watchdog"),
    ("alertname=Unlabelled", "gradwatch-warning"),
])
@pytest.mark.stack
def test_alertmanager_routes_by_severity(labels, receiver):
    r = run(AMTOOL, "config", "routes", "test", f"--config.file={AM_CONFIG}", *labels.split())
    assert r.returncode == 0 and r.stdout.strip() == receiver, r.stdout + r.stderr


def test_alertmanager_groups_by_job_and_inhibits_warnings_under_a_critical_of_the_same_rank():
    am = yaml.safe_load(AM_CONFIG.read_text())
    assert am["route"]["group_by"] == ["job_id"]
    (rule,) = am["inhibit_rules"]
    assert rule["source_matchers"] == ['severity="critical"'] and rule["equal"] == ["job_id", "rank"]
    assert 'severity=~"warning|info"' in rule["target_matchers"] and 'alertname!="Watchdog"' in rule["target_matchers"]
    hooks = [h["url"] for r in am["receivers"] for h in r.get("webhook_configs", [])]
    assert hooks and all(h.startswith("http://127.0.0.1:") for h in hooks)


# --- the rules against the aggregator's registries ------------------------------------------------


def test_every_required_alert_is_shipped():
    assert REQUIRED <= set(alerts()), REQUIRED - set(alerts())


def test_every_metric_the_rules_use_is_exported():
    known = exported_names() | PROMETHEUS_SERIES | {r["record"] for r in rules() if "record" in r}
    used = set()
    for r in rules():
        for name in SERIES.findall(r["expr"]):
            if name.startswith(("gradwatch_", "job_id:")) or name in PROMETHEUS_SERIES:
                assert name in known, f"{r.get('alert') or r.get('record')}: {name} is not exported"
                used.add(name)
    assert {"gradwatch_check_rank_flagged", "gradwatch_rank_nonfinite_steps_total", "up"} <= used


def test_every_check_the_rules_name_exists_and_every_check_has_an_alert():
    load_all()
    named = {c for r in alerts().values() for c in re.findall(r'check="([^"]+)"', r["expr"])}
    assert named <= set(CHECKS), named - set(CHECKS)
    assert set(CHECKS) - NO_FINDINGS <= named, (set(CHECKS) - NO_FINDINGS) - named


def test_alert_severity_matches_the_checks_severity():
    for name, r in alerts().items():
        for check in set(re.findall(r'check="([^"]+)"', r["expr"])):
            assert r["labels"]["severity"] == CHECKS[check].severity, (name, check)


def test_every_alert_has_severity_annotations_and_a_runbook_section():
    runbook = RUNBOOK.read_text()
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", runbook, re.M | re.S))
    for name, r in alerts().items():
        assert r["labels"]["severity"] in ("critical", "warning", "info"), name
        ann = r["annotations"]
        assert {"summary", "description", "runbook_url"} <= set(ann), name
        assert ann["runbook_url"].endswith(f"deploy/RUNBOOK.md#{name.lower()}"), name
        assert name in sections, f"RUNBOOK.md has no section for {name}"
        body = sections[name]
        assert "**Means.**" in body and ("**Do.**" in body or "**Confirm / do.**" in body), name
        # the job and, where the alert has one, the rank or layer reach the people paged
        text = ann["summary"] + ann["description"]
        # (the aggregator's own series, gradwatch_series_left_out, carry no job_id)
        if re.search(r"\bgradwatch_(?!series_left_out)|\bjob_id:", r["expr"]):
            assert "$labels.job_id" in text, name
        if "rank_flagged" in r["expr"] or "gradwatch_rank_" in r["expr"] or "gradwatch_agent_" in r["expr"]:
            assert "$labels.rank" in text, name
        if "layer_flagged" in r["expr"]:
            assert "$labels.layer" in text, name
    assert set(sections) - {"Thresholds"} == set(alerts()), set(sections) ^ set(alerts())


def test_every_alert_has_firing_and_not_firing_unit_tests():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing, quiet = set(), set()
    for t in tests:
        for case in t.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert set(alerts()) <= firing, set(alerts()) - firing
    assert set(alerts()) - {"Watchdog"} <= quiet, set(alerts()) - {"Watchdog"} - quiet


def test_nonfinite_alert_counts_instead_of_comparing_values_C36():
    expr = alerts()["NonFiniteValues"]["expr"]
    assert "increase(gradwatch_rank_nonfinite_steps_total[" in expr
    assert "grad_norm" not in expr  # NaN > x is false: a threshold on the norm would never fire
    cases = RULE_TESTS.read_text()
    assert "NaN" in cases and "Inf" in cases


def test_metrics_named_in_the_runbook_exist():
    known = exported_names() | {r["record"] for r in rules() if "record" in r}
    for name in set(SERIES.findall(RUNBOOK.read_text())):
        if name.startswith("gradwatch_"):  # a name ending in _ is a family prefix (gradwatch_layer_activation_*)
            assert name in known or name.endswith("_") and any(k.startswith(name) for k in known), name


# --- thresholds, stated once ------------------------------------------------------------------------


def _table(rows: list[tuple[str, str, str]]) -> dict[str, tuple[str, str]]:
    return {a: (s, f) for a, s, f in rows}


def test_thresholds_in_runbook_and_rules_header_match_the_rules():
    want = {n: (r["labels"]["severity"], r.get("for", "-")) for n, r in alerts().items()}
    runbook = _table(re.findall(r"^\| (\w+) \| (critical|warning|info) \| (\S+) \|", RUNBOOK.read_text(), re.M))
    header = _table(re.findall(r"^#   (\w+)\s+(critical|warning|info)\s+(\S+)\s", RULES.read_text(), re.M))
    assert runbook == want
    assert header == want


def test_series_near_limit_threshold_is_80_percent_of_sample_limit():
    (job,) = yaml.safe_load(PROM_CONFIG.read_text())["scrape_configs"]
    assert job["job_name"] == stack.SCRAPE_JOB
    assert f"> {int(job['sample_limit'] * 0.8)}" in alerts()["AggregatorSeriesNearLimit"]["expr"]
    assert f'up{{job="{stack.SCRAPE_JOB}"}}' in alerts()["AggregatorDown"]["expr"]


# --- the other forms of the configuration -----------------------------------------------------------


def test_kubernetes_manifests_parse_and_agree_with_the_shipped_files():
    docs = [d for f in sorted((DEPLOY / "kubernetes").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert {"Deployment", "Service", "ServiceMonitor", "PrometheusRule"} <= set(kinds)
    shipped = yaml.safe_load(RULES.read_text())["groups"]
    assert kinds["PrometheusRule"]["spec"]["groups"] == shipped, "regenerate: gradwatch stack --print-prometheusrule"
    (job,) = yaml.safe_load(PROM_CONFIG.read_text())["scrape_configs"]
    assert kinds["ServiceMonitor"]["spec"]["sampleLimit"] == job["sample_limit"]
    assert kinds["Service"]["metadata"]["name"] == stack.SCRAPE_JOB  # the operator's job label
    (container,) = kinds["Deployment"]["spec"]["template"]["spec"]["containers"]
    _parses_as_aggregator_flags(container["args"][1:])


def test_the_cluster_wide_and_per_job_aggregators_each_select_only_their_own():
    """In one namespace the cluster-wide Service selects no per-job pod (agents would spread over
    every aggregator, a job's ranks split), and its ServiceMonitor no per-job Service (scraped
    twice, beside their PodMonitor)."""

    def kinds(path):
        return {d["kind"]: d for d in yaml.safe_load_all(path.read_text()) if d}

    cluster, per_job = kinds(DEPLOY / "kubernetes" / "aggregator.yaml"), kinds(DEPLOY / "kubernetes" / "per-job" / "aggregator.yaml")
    podmonitor = kinds(DEPLOY / "kubernetes" / "per-job" / "podmonitor.yaml")["PodMonitor"]["spec"]["selector"]

    def selects(selector: dict, labels: dict) -> bool:
        exists = [e["key"] for e in selector.get("matchExpressions", ()) if e["operator"] == "Exists"]
        return all(labels.get(k) == v for k, v in selector.get("matchLabels", selector).items()
                   if k != "matchExpressions") and all(k in labels for k in exists)

    pods = {name: k["Deployment"]["spec"]["template"]["metadata"]["labels"] for name, k in (("cluster", cluster), ("per-job", per_job))}
    services = {name: k["Service"]["metadata"]["labels"] for name, k in (("cluster", cluster), ("per-job", per_job))}
    for name, k in (("cluster", cluster), ("per-job", per_job)):
        for other in ("cluster", "per-job"):
            mine = other == name
            assert selects(k["Service"]["spec"]["selector"], pods[other]) is mine, (name, "Service", other)
            assert selects(k["Deployment"]["spec"]["selector"], pods[other]) is mine, (name, "Deployment", other)
    assert selects(cluster["ServiceMonitor"]["spec"]["selector"], services["cluster"])
    assert not selects(cluster["ServiceMonitor"]["spec"]["selector"], services["per-job"])
    assert selects(podmonitor, pods["per-job"]) and not selects(podmonitor, pods["cluster"])


def test_systemd_unit_is_well_formed():
    import configparser

    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string((DEPLOY / "systemd" / "gradwatch-aggregator.service").read_text())
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    exec_start = unit["Service"]["ExecStart"].replace("\\\n", " ").split()
    assert exec_start[1] == "aggregator"
    _parses_as_aggregator_flags(exec_start[2:])


def _parses_as_aggregator_flags(args: list[str]) -> None:
    from pydantic_settings import CliApp

    from gradwatch.aggregator import AggregatorConfig

    CliApp.run(AggregatorConfig, cli_args=args)  # raises on an unknown or invalid flag


@pytest.mark.stack
def test_stack_renders_the_shipped_configuration_for_local_use(tmp_path):
    settings = stack.Settings(aggregator_metrics=("127.0.0.1:19400",), prometheus_port=19090, alertmanager_port=19093,
                              webhook="http://127.0.0.1:18080", scrape_interval="1s", evaluation_interval="1s",
                              for_scale=0.02, group_wait="1s", group_interval="1s")
    r = stack.render(tmp_path, settings)
    prom = yaml.safe_load(r.prometheus_config.read_text())
    (job,) = prom["scrape_configs"]
    assert job["static_configs"] == [{"targets": ["127.0.0.1:19400"]}] and job["sample_limit"] == 20000
    assert prom["global"]["scrape_timeout"] == "1s"
    assert prom["alerting"]["alertmanagers"][0]["static_configs"] == [{"targets": ["127.0.0.1:19093"]}]
    local = {x["alert"]: x for g in yaml.safe_load(r.rule_files[0].read_text())["groups"] for x in g["rules"] if "alert" in x}
    assert local["AggregatorDown"]["for"] == "6s" and local["ReplicaDivergence"]["for"] == "0s"
    assert {n: (x["expr"], x["labels"], x["annotations"]) for n, x in local.items()} == {
        n: (x["expr"], x["labels"], x["annotations"]) for n, x in alerts().items()
    }
    am = yaml.safe_load(r.alertmanager_config.read_text())
    assert am["route"]["group_wait"] == "1s" and am["route"]["routes"][0]["group_interval"] == "1s"
    urls = {h["url"] for x in am["receivers"] for h in x["webhook_configs"]}
    assert urls == {f"http://127.0.0.1:18080/{p}" for p in ("critical", "warning", "info", "watchdog")}
    assert am["inhibit_rules"] == yaml.safe_load(AM_CONFIG.read_text())["inhibit_rules"]
    c = run(PROMTOOL, "check", "config", str(r.prometheus_config))
    assert c.returncode == 0, c.stdout + c.stderr
    c = run(AMTOOL, "check-config", str(r.alertmanager_config))
    assert c.returncode == 0, c.stdout + c.stderr


def test_stack_command_is_a_gradwatch_subcommand(tmp_path):
    out = subprocess.run([sys.executable, "-m", "gradwatch.commands", "--help"], capture_output=True, text=True, timeout=60)
    assert "stack" in out.stdout
    run_ = subprocess.run(
        [sys.executable, "-m", "gradwatch.commands", "stack", "--render-only", "--workdir", str(tmp_path),
         "--aggregator-metrics", "127.0.0.1:9500"],
        capture_output=True, text=True, timeout=60,
    )
    assert run_.returncode == 0, run_.stderr
    assert "127.0.0.1:9500" in (tmp_path / "prometheus.yml").read_text()


def test_runbook_links_can_point_at_your_own_copy_of_the_runbook(tmp_path, capsys):
    """The shipped links name a public repository; a team may serve its own RUNBOOK.md:
    --runbook-url moves every alert's link there, in the rendered rules and the
    PrometheusRule alike, each keeping its section; a URL that is not http(s), or brings its own
    #fragment, is refused naming the setting."""
    base = "https://wiki.example.com/ml/gradwatch/RUNBOOK.md"
    shipped = {n: x["annotations"]["runbook_url"] for n, x in alerts().items()}
    assert all("#" in u for u in shipped.values())
    r = stack.render(tmp_path, stack.Settings(runbook_url=base))
    rendered = {x["alert"]: x["annotations"]["runbook_url"]
                for g in yaml.safe_load(r.rule_files[0].read_text())["groups"] for x in g["rules"] if "alert" in x}
    want = {n: base + "#" + u.split("#", 1)[1] for n, u in shipped.items()}
    assert rendered == want
    c = run(PROMTOOL, "check", "rules", str(r.rule_files[0]))
    assert c.returncode == 0, c.stdout + c.stderr
    cmd = ["stack", "--print-prometheusrule"]  # the gradwatch command, its main in this process
    status, out = cli.main([*cmd, "--runbook-url", base]), capsys.readouterr()
    operator = {x["alert"]: x["annotations"]["runbook_url"]
                for g in yaml.safe_load(out.out)["spec"]["groups"] for x in g["rules"] if "alert" in x}
    assert status == 0 and operator == want, out.err
    for bad, says in (("ftp://wiki.example.com/r.md", "needs an http"), (base + "#top", "no #fragment"),
                      ("RUNBOOK.md", "needs an http")):
        status, out = cli.main([*cmd, "--runbook-url", bad]), capsys.readouterr()
        assert status == 2 and "stack.runbook_url" in out.err and says in out.err, out.err
        assert "Traceback" not in out.err


def test_durations_round_trip():
    assert stack.parse_duration("1h30m") == 5400 and stack.parse_duration("500ms") == 0.5
    assert stack.format_duration(6) == "6s" and stack.format_duration(1.5) == "1500ms"
    with pytest.raises(ValueError):
        stack.parse_duration("5 minutes")


def test_vanishing_and_explosion_alerts_key_on_their_own_checks():
    """Vanishing is a check of its own, so its alert needs no copy of the aggregator's threshold."""
    assert 'check="vanishing"' in alerts()["GradientVanishing"]["expr"]
    assert 'check="vanishing"' not in alerts()["GradientExplosion"]["expr"]


def test_every_check_has_an_alert_a_runbook_section_and_promtool_cases():
    """What a new check still lacks, by name: the alert rule naming it (``check="NAME"``), the runbook
    section of that alert, and promtool cases where the alert fires and where it does not."""
    load_all()
    runbook = set(re.findall(r"^## (\w+)\n", RUNBOOK.read_text(), re.M))
    firing, quiet = set(), set()
    for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in t.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    lacks = {}
    for check in sorted(set(CHECKS) - NO_FINDINGS):
        names = [a for a, r in alerts().items() if f'check="{check}"' in r["expr"]]
        missing = [] if names else [f"an alert rule with check=\"{check}\" in {RULES.relative_to(ROOT)}"]
        for a in names:
            missing += [f"a '## {a}' section in {RUNBOOK.relative_to(ROOT)}"] if a not in runbook else []
            missing += [f"a promtool case where {a} fires in {RULE_TESTS.relative_to(ROOT)}"] if a not in firing else []
            missing += [f"a promtool case where {a} stays quiet in {RULE_TESTS.relative_to(ROOT)}"] if a not in quiet else []
        if missing:
            lacks[check] = missing
    assert lacks == {}, "\n".join(f"check {c} lacks: " + "; ".join(m) for c, m in lacks.items())
