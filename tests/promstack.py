"""A real Prometheus and Alertmanager for tests, started by ``gradwatch stack``'s own code
(:mod:`gradwatch.commands.stack`) from the shipped configuration, with a webhook receiver run here.

Only loopback addresses; free ports; data under the test's tmp_path. When the binaries are missing
the tests that need them are skipped, unless ``GRADWATCH_REQUIRE_PROMETHEUS=1`` (set by .ci/run,
which installs Debian's prometheus and prometheus-alertmanager) makes that a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
import yaml

from bench.harness import stop_process
from gradwatch.commands import stack

from .conftest import free_port

PROMTOOL, AMTOOL = "promtool", "amtool"


def require(*tools: str) -> None:
    """Skip (or, with GRADWATCH_REQUIRE_PROMETHEUS=1, fail) when a binary is missing."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        msg = f"{', '.join(missing)} not installed (Debian: apt-get install prometheus prometheus-alertmanager)"
        if os.environ.get("GRADWATCH_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


def require_servers() -> None:
    require("prometheus")
    if not (shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")):
        require("prometheus-alertmanager")


class Webhook:
    """An Alertmanager webhook receiver: every POSTed notification, with the path it came to."""

    def __init__(self):
        self.received: list[tuple[str, dict]] = []
        self._lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with hook._lock:
                    hook.received.append((self.path, json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, name="webhook", daemon=True).start()

    def notifications(self, path: str | None = None) -> list[dict]:
        with self._lock:
            return [n for p, n in self.received if path is None or p == path]

    def alerts(self, path: str | None = None) -> list[tuple[str, dict]]:
        """(receiver path, alert) for every alert of every notification received."""
        with self._lock:
            return [(p, a) for p, n in self.received if path is None or p == path for a in n["alerts"]]

    def clear(self) -> None:
        with self._lock:
            self.received.clear()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class PromStack:
    stack: stack.Stack
    webhook: Webhook

    @property
    def prometheus_url(self) -> str:
        return self.stack.prometheus_url

    @property
    def alertmanager_url(self) -> str:
        return self.stack.alertmanager_url

    def alerts(self) -> list[dict]:
        """Prometheus's active alerts (pending and firing): [{labels, annotations, state, value}]."""
        r = requests.get(self.prometheus_url + "/api/v1/alerts", timeout=5)
        r.raise_for_status()
        return r.json()["data"]["alerts"]

    def firing(self, name: str, **labels) -> list[dict]:
        return [
            a for a in self.alerts()
            if a["state"] == "firing" and a["labels"].get("alertname") == name
            and all(a["labels"].get(k) == v for k, v in labels.items())
        ]

    def query(self, promql: str) -> list[dict]:
        r = requests.get(self.prometheus_url + "/api/v1/query", params={"query": promql}, timeout=5)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def am_alerts(self) -> list[dict]:
        """Alertmanager's alerts, inhibited ones included: [{labels, status: {state, inhibitedBy}}]."""
        r = requests.get(self.alertmanager_url + "/api/v2/alerts", timeout=5)
        r.raise_for_status()
        return r.json()

    def post_alerts(self, alerts: list[dict]) -> None:
        """Send alerts to Alertmanager as Prometheus does ([{labels, annotations}])."""
        requests.post(self.alertmanager_url + "/api/v2/alerts", json=alerts, timeout=5).raise_for_status()

    def stop(self) -> None:
        self.stack.stop()
        self.webhook.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.stack.log_tail(n, 40)}" for n in self.stack.logs)


#: local-use settings for tests: 1 s scrapes and evaluations, `for:` x 0.02 (5m -> 6s), fast notifications
FAST = dict(scrape_interval="1s", evaluation_interval="1s", for_scale=0.02, group_wait="1s", group_interval="1s")


def start_promstack(workdir: Path, metrics_targets: list[str], **overrides) -> PromStack:
    """Prometheus scraping ``metrics_targets`` and Alertmanager on free loopback ports, with the
    shipped configuration rendered by :func:`gradwatch.commands.stack.render`, and a webhook receiver."""
    require_servers()
    webhook = Webhook()
    settings = stack.Settings(
        aggregator_metrics=tuple(metrics_targets), prometheus_port=free_port(), alertmanager_port=free_port(),
        webhook=webhook.url, **{**FAST, **overrides},
    )
    try:
        return PromStack(stack.start(workdir, settings), webhook)
    except Exception:
        webhook.stop()
        raise


class Prometheus:
    """One real Prometheus on a free loopback port, running ``config`` (a parsed configuration),
    data and log under ``workdir``; for the tests of the fleet configurations, which need no
    Alertmanager. :meth:`stop` ends it."""

    def __init__(self, workdir: Path, config: dict, timeout: float = 30.0):
        require("prometheus")
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = workdir / "prometheus.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [stack.find_binary(("prometheus",)), f"--config.file={workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address={self.url.split('//')[1]}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"prometheus not ready after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.2)

    @property
    def address(self) -> str:
        """HOST:PORT, as a scrape target."""
        return self.url.split("//", 1)[1]

    def query(self, promql: str) -> list[dict]:
        """The instant vector ``promql`` gives now: [{metric: labels, value: [t, "v"]}]."""
        r = requests.get(self.url + "/api/v1/query", params={"query": promql}, timeout=5)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def targets(self) -> dict:
        """/api/v1/targets: {activeTargets: [...], droppedTargets: [...]}."""
        r = requests.get(self.url + "/api/v1/targets", timeout=5)
        r.raise_for_status()
        return r.json()["data"]

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        stop_process(self.proc)
