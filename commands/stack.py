"""``gradwatch stack``: a local Prometheus and Alertmanager running the shipped configuration.

Renders the shipped ``prometheus/prometheus.yml``, its rule files and ``alertmanager/
alertmanager.yml`` (package data of ``gradwatch.deploy``: deploy/ in a checkout) for local use — loopback targets and ports, short scrape and evaluation
intervals, optionally shorter ``for:`` durations and notification delays, data in a temporary
directory — then runs both servers until Ctrl-C, so that a demo shows alerts firing::

    gradwatch aggregator --metrics-port 9400 &
    gradwatch stack --aggregator-metrics 127.0.0.1:9400 --for-scale 0.1
    gradwatch demo --aggregator tcp://127.0.0.1:5555 --ranks 3 --inject drift@49:rank=1

Prometheus (``prometheus``, Debian's package) and Alertmanager (``prometheus-alertmanager`` or
``alertmanager``) must be on the PATH, or given with ``--prometheus`` and ``--alertmanager``.
Everything the shipped files say is kept except what local use changes, so the tests that run this
stack (tests/test_alerting_stack.py) test the shipped rules, routes and inhibitions.

Errors: :class:`StackError` (a binary missing, a server that exits or never gets ready, a shipped
file missing), with the server's log in the message; ``gradwatch stack`` prints it as one line and
exits 1 (2 for an invalid flag). Needs PyYAML.
"""

from __future__ import annotations

import glob
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from gradwatch.errors import GradwatchError

# the shipped configuration: package data of gradwatch.deploy (deploy/ in a checkout), a real
# directory in both an editable and a wheel install (Prometheus reads rule files by path)
DEPLOY = Path(str(files("gradwatch.deploy")))
LOOPBACK = "127.0.0.1"
SCRAPE_JOB = "gradwatch"  # the rules' up{job="gradwatch"} relies on it


class StackError(GradwatchError, RuntimeError):
    """A server of the stack cannot start or stopped; the message carries its log's tail."""


def _yaml():
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML comes with the test extra
        raise StackError("gradwatch stack needs PyYAML: pip install pyyaml") from None
    return yaml


_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration (``1h30m``, ``15s``, ``500ms``, ``0s``).

    Raises:
        ValueError: not a duration.
    """
    parts = re.findall(r"(\d+)(ms|s|m|h|d|w|y)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * _UNITS[u] for n, u in parts)


def format_duration(seconds: float) -> str:
    """A Prometheus duration for ``seconds``, to the millisecond (``6s``, ``1500ms``)."""
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


@dataclass(frozen=True)
class Settings:
    """What local use changes in the shipped configuration.

    Attributes:
        aggregator_metrics: HOST:PORT of each aggregator's /metrics to scrape.
        prometheus_port, alertmanager_port: loopback ports the servers listen on.
        webhook: base URL the receivers' webhooks are moved to, keeping their paths
            (``http://127.0.0.1:8080`` makes ``http://127.0.0.1:5001/critical`` into
            ``http://127.0.0.1:8080/critical``); '' keeps the shipped ones.
        scrape_interval, evaluation_interval: Prometheus durations.
        for_scale: factor on every alert's ``for:`` (1 = as shipped; 0.02 turns 5m into 6s).
        group_wait, group_interval: Alertmanager's notification delays on every route ('' keeps
            the shipped ones).
        runbook_url: where the runbook (deploy/RUNBOOK.md) is served, each alert's
            ``runbook_url`` annotation keeping its ``#section``; '' keeps the shipped links.
    """

    aggregator_metrics: tuple[str, ...] = (f"{LOOPBACK}:9400",)
    prometheus_port: int = 9090
    alertmanager_port: int = 9093
    webhook: str = ""
    scrape_interval: str = "5s"
    evaluation_interval: str = "5s"
    for_scale: float = 1.0
    group_wait: str = "5s"
    group_interval: str = "30s"
    runbook_url: str = ""


def with_runbook(rules: dict, url: str) -> dict:
    """``rules`` (a parsed rule file) with each alert's ``runbook_url`` annotation moved to ``url``,
    its ``#section`` kept; ``url`` '' leaves them. Changes ``rules`` in place and returns it."""
    for group in rules.get("groups", []) if url else ():
        for rule in group.get("rules", []):
            notes = rule.get("annotations") or {}
            if "runbook_url" in notes:
                _, hash_, section = notes["runbook_url"].partition("#")
                notes["runbook_url"] = url + hash_ + section
    return rules


def check_runbook_url(v: str) -> str:
    """``v`` if '' or an http(s) URL without a fragment (the alerts add their own ``#section``).

    Raises:
        ValueError: naming what is wrong with ``v``.
    """
    if v:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"runbook_url {v!r}: needs an http:// or https:// URL of the runbook")
        if parts.fragment or v.endswith("#"):
            raise ValueError(f"runbook_url {v!r}: no #fragment, each alert adds its own section")
    return v


@dataclass(frozen=True)
class Rendered:
    workdir: Path
    prometheus_config: Path
    rule_files: tuple[Path, ...]
    alertmanager_config: Path


def render(workdir: Path, settings: Settings = Settings(), deploy: Path = DEPLOY) -> Rendered:
    """Write the shipped configuration, adapted for local use by ``settings``, under ``workdir``."""
    yaml = _yaml()
    workdir = Path(workdir)
    (workdir / "rules").mkdir(parents=True, exist_ok=True)
    src = deploy / "prometheus" / "prometheus.yml"
    prom = yaml.safe_load(src.read_text())

    g = prom.setdefault("global", {})
    g["scrape_interval"] = settings.scrape_interval
    g["evaluation_interval"] = settings.evaluation_interval
    timeout = min(parse_duration(g.get("scrape_timeout", "10s")), parse_duration(settings.scrape_interval))
    g["scrape_timeout"] = format_duration(timeout)

    rule_files = []
    for pattern in prom.get("rule_files", []):
        for path in sorted(glob.glob(str(src.parent / pattern))):
            rules = with_runbook(yaml.safe_load(Path(path).read_text()), settings.runbook_url)
            for group in rules.get("groups", []):
                for rule in group.get("rules", []):
                    if "for" in rule and settings.for_scale != 1:
                        rule["for"] = format_duration(parse_duration(rule["for"]) * settings.for_scale)
            out = workdir / "rules" / Path(path).name
            out.write_text(yaml.safe_dump(rules, sort_keys=False))
            rule_files.append(out)
    prom["rule_files"] = [str(p) for p in rule_files]

    for am in prom.get("alerting", {}).get("alertmanagers", []):
        am["static_configs"] = [{"targets": [f"{LOOPBACK}:{settings.alertmanager_port}"]}]
    jobs = [j for j in prom.get("scrape_configs", []) if j.get("job_name") == SCRAPE_JOB]
    if len(jobs) != 1:
        raise StackError(f"{src}: expected one scrape job named {SCRAPE_JOB!r}")
    jobs[0]["static_configs"] = [{"targets": list(settings.aggregator_metrics)}]
    for key in ("scrape_interval", "scrape_timeout"):
        jobs[0].pop(key, None)  # the global, local ones apply
    prom_out = workdir / "prometheus.yml"
    prom_out.write_text(yaml.safe_dump(prom, sort_keys=False))

    am = yaml.safe_load((deploy / "alertmanager" / "alertmanager.yml").read_text())

    def routes(route):
        yield route
        for r in route.get("routes", []):
            yield from routes(r)

    for r in routes(am["route"]):
        for key in ("group_wait", "group_interval"):
            value = getattr(settings, key)
            if value and (r is am["route"] or key in r):
                r[key] = value
    if settings.webhook:
        base = settings.webhook.rstrip("/")
        for receiver in am.get("receivers", []):
            for hook in receiver.get("webhook_configs", []):
                parts = urlsplit(hook["url"])
                hook["url"] = base + parts.path + (f"?{parts.query}" if parts.query else "")
    am_out = workdir / "alertmanager.yml"
    am_out.write_text(yaml.safe_dump(am, sort_keys=False))
    return Rendered(workdir, prom_out, tuple(rule_files), am_out)


def prometheusrule(deploy: Path = DEPLOY, runbook: str = "") -> str:
    """The shipped rules as a Prometheus Operator ``PrometheusRule`` manifest
    (deploy/kubernetes/prometheusrule.yaml is this output; a test keeps them equal), the runbook
    links moved to ``runbook`` unless it is ''."""
    yaml = _yaml()
    rules = with_runbook(yaml.safe_load((deploy / "prometheus" / "rules" / "gradwatch.rules.yml").read_text()), runbook)
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "gradwatch", "labels": {"app.kubernetes.io/name": "gradwatch", "role": "alert-rules"}},
        "spec": {"groups": rules["groups"]},
    }
    head = ("# Generated from deploy/prometheus/rules/gradwatch.rules.yml by\n"
            "#   gradwatch stack --print-prometheusrule > deploy/kubernetes/prometheusrule.yaml\n"
            "# Do not edit: edit the rules file and regenerate (tests/test_alerting_rules.py checks it).\n")
    return head + yaml.safe_dump(doc, sort_keys=False, width=120)


def find_binary(names: tuple[str, ...], given: str = "") -> str:
    for name in ((given,) if given else names):
        path = shutil.which(name)
        if path:
            return path
    raise StackError(f"none of {', '.join((given,) if given else names)} found on the PATH "
                     "(Debian: apt-get install prometheus prometheus-alertmanager)")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


class Stack:
    """Prometheus and Alertmanager on the rendered configuration: :meth:`start` runs them, :meth:`stop`
    ends both."""

    def __init__(self, rendered: Rendered, settings: Settings, prometheus: str = "", alertmanager: str = ""):
        self.rendered, self.settings = rendered, settings
        self.prometheus_url = f"http://{LOOPBACK}:{settings.prometheus_port}"
        self.alertmanager_url = f"http://{LOOPBACK}:{settings.alertmanager_port}"
        w = rendered.workdir
        self.logs = {"prometheus": w / "prometheus.log", "alertmanager": w / "alertmanager.log"}
        self.procs: dict[str, subprocess.Popen] = {}
        self._cmds = {
            "alertmanager": [
                find_binary(("prometheus-alertmanager", "alertmanager"), alertmanager),
                f"--config.file={rendered.alertmanager_config}", f"--storage.path={w / 'data' / 'alertmanager'}",
                f"--web.listen-address={LOOPBACK}:{settings.alertmanager_port}",
                f"--web.external-url={self.alertmanager_url}",  # links in notifications: not the host's name
                "--cluster.listen-address=",  # no gossip port: one local instance
            ],
            "prometheus": [
                find_binary(("prometheus",), prometheus),
                f"--config.file={rendered.prometheus_config}", f"--storage.tsdb.path={w / 'data' / 'prometheus'}",
                f"--web.listen-address={LOOPBACK}:{settings.prometheus_port}",
                # alerts' generatorURL: the address it serves, not http://HOSTNAME:port (unreachable)
                f"--web.external-url={self.prometheus_url}",
                # resend firing alerts every evaluation, not every minute: Alertmanager is found a few
                # seconds after start-up, and the first sends would otherwise wait a minute
                f"--rules.alert.resend-delay={settings.evaluation_interval}",
            ],
        }
        self._urls = {"alertmanager": self.alertmanager_url, "prometheus": self.prometheus_url}

    def _spawn(self, name: str) -> None:
        try:
            with self.logs[name].open("w") as log:
                self.procs[name] = subprocess.Popen(self._cmds[name], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        except OSError as e:
            self.stop()
            raise StackError(f"cannot start {name}: {e}") from None

    def log_tail(self, name: str, lines: int = 20) -> str:
        try:
            return "\n".join(self.logs[name].read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise StackError(f"{name} exited with {p.returncode}:\n{self.log_tail(name)}")

    def start(self, timeout: float = 60.0) -> "Stack":
        """Start Alertmanager, then (once it is ready, so that no first notification is lost until
        Prometheus's resend delay) Prometheus; wait until both are ready."""
        deadline = time.monotonic() + timeout
        try:
            for name in ("alertmanager", "prometheus"):
                self._spawn(name)
                while not _ready(self._urls[name] + "/-/ready"):
                    self.check_alive()
                    if time.monotonic() > deadline:
                        raise StackError(f"{name} not ready after {timeout:.0f} s:\n{self.log_tail(name)}")
                    time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start(workdir: Path, settings: Settings = Settings(), *, prometheus: str = "", alertmanager: str = "",
          deploy: Path = DEPLOY, timeout: float = 60.0) -> Stack:
    """Render the configuration under ``workdir``, start both servers and wait until they are ready."""
    return Stack(render(workdir, settings, deploy), settings, prometheus, alertmanager).start(timeout)


def _duration(v: str) -> str:
    parse_duration(v)  # raises ValueError naming the text
    return v


Duration = Annotated[str, AfterValidator(_duration)]


class StackCommand(BaseModel):
    """Run a local Prometheus and Alertmanager with gradwatch's shipped configuration against an
    aggregator (loopback only), until Ctrl-C."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    aggregator_metrics: list[str] = Field(
        default_factory=list, description="Aggregator /metrics to scrape, HOST:PORT (repeatable; default 127.0.0.1:9400).")
    prometheus_port: int = Field(9090, ge=1, le=65535, description="Loopback port Prometheus listens on.")
    alertmanager_port: int = Field(9093, ge=1, le=65535, description="Loopback port Alertmanager listens on.")
    webhook: str = Field("", description="Base URL for the receivers' webhooks (default: the shipped example, 127.0.0.1:5001).")
    scrape_interval: Duration = Field("5s", description="Prometheus scrape interval.")
    evaluation_interval: Duration = Field("5s", description="Prometheus rule evaluation interval.")
    for_scale: float = Field(1.0, ge=0, description="Factor on every alert's for: duration (e.g. 0.1 for a demo; 1: as shipped).")
    group_wait: Duration = Field("5s", description="Alertmanager group_wait on every route.")
    group_interval: Duration = Field("30s", description="Alertmanager group_interval on every route.")
    runbook_url: Annotated[str, AfterValidator(check_runbook_url)] = Field(
        "", description="URL of your copy of deploy/RUNBOOK.md: each alert's runbook_url link goes there, keeping its #section (default: the shipped links). Also with --print-prometheusrule.")
    workdir: str = Field("", description="Where to write configuration and data (default: a temporary directory, removed at exit).")
    deploy_dir: str = Field("", description="The configuration to run (default: the one shipped in the package, gradwatch.deploy).")
    prometheus: str = Field("", description="Prometheus binary (default: prometheus on the PATH).")
    alertmanager: str = Field("", description="Alertmanager binary (default: prometheus-alertmanager or alertmanager on the PATH).")
    render_only: bool = Field(False, description="Write the configuration, print where, and exit.")
    print_prometheusrule: bool = Field(False, description="Print the shipped rules as a Kubernetes PrometheusRule manifest and exit.")

    @property
    def settings(self) -> Settings:
        return Settings(
            tuple(self.aggregator_metrics or (f"{LOOPBACK}:9400",)), self.prometheus_port, self.alertmanager_port,
            self.webhook, self.scrape_interval, self.evaluation_interval, self.for_scale, self.group_wait,
            self.group_interval, self.runbook_url,
        )

    def cli_cmd(self) -> None:
        """Run the stack until SIGINT or SIGTERM.

        Raises:
            StackError: a server cannot start or stopped; a shipped file cannot be read.
        """
        deploy = Path(self.deploy_dir) if self.deploy_dir else DEPLOY
        try:
            if self.print_prometheusrule:
                sys.stdout.write(prometheusrule(deploy, self.runbook_url))
                return
            settings = self.settings
            workdir = Path(self.workdir) if self.workdir else Path(tempfile.mkdtemp(prefix="gradwatch-stack-"))
            try:
                if self.render_only:
                    r = render(workdir, settings, deploy)
                    print(f"prometheus config: {r.prometheus_config}\nrules: {', '.join(map(str, r.rule_files))}\n"
                          f"alertmanager config: {r.alertmanager_config}")
                    return
                stop = []
                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, lambda *_: stop.append(1))
                with start(workdir, settings, prometheus=self.prometheus, alertmanager=self.alertmanager, deploy=deploy) as stack:
                    print(f"gradwatch stack: scraping {', '.join(settings.aggregator_metrics)} every {settings.scrape_interval}\n"
                          f"  Prometheus    {stack.prometheus_url}/alerts\n"
                          f"  Alertmanager  {stack.alertmanager_url}\n"
                          f"  configuration {workdir}\nCtrl-C stops both.", flush=True)
                    while not stop:
                        stack.check_alive()
                        time.sleep(0.5)
            finally:
                if not self.workdir:
                    shutil.rmtree(workdir, ignore_errors=True)
        except (ValueError, OSError) as e:  # a shipped file missing or malformed
            raise StackError(str(e)) from None


def main(argv=None) -> int:
    """``gradwatch stack [FLAGS]`` (flags: the fields of :class:`StackCommand`); the exit status."""
    from gradwatch.commands.cli import main as gradwatch

    return gradwatch(["stack", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
