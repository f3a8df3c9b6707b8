"""What the benchmarks and the tests share to run gradwatch as processes: a free port on loopback, and
a real aggregator (``python -m gradwatch.aggregator``) on loopback in a process of its own.

Standard library only (the device check runs it where gradwatch is not installed).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

#: how an aggregator process is started, before its settings
COMMAND = (sys.executable, "-m", "gradwatch.aggregator")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s`` seconds; does nothing once it has exited."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class AggregatorProcess:
    """A real aggregator in a process of its own: ZeroMQ at ``endpoint``, HTTP (/metrics, /healthz,
    /api/...) at ``base_url``, both on 127.0.0.1; its output (stdout and stderr) in the file ``log``.
    Returned once /healthz answers ok.

    ``args``: more command-line settings (``"--round-grace-s", "3"``); ``port``: its ZeroMQ port
    (default a free one); ``command``: what starts it, before the settings (default
    :data:`COMMAND`); ``env``: more environment variables; ``popen``: more
    :class:`subprocess.Popen` arguments (``cwd``, ``preexec_fn``).

    Raises:
        RuntimeError: the process exited, or /healthz did not answer within ``timeout_s``
            seconds (the process is stopped; the message ends with its output's tail).
    """

    def __init__(self, *args: str, log, port: Optional[int] = None, command: Sequence[str] = COMMAND,
                 env: Optional[dict] = None, timeout_s: float = 60.0, **popen):
        zport, self.metrics_port = port or free_port(), free_port()
        self.endpoint = f"tcp://127.0.0.1:{zport}"
        self.base_url = f"http://127.0.0.1:{self.metrics_port}"
        self.metrics_url = self.base_url + "/metrics"
        self.log = Path(log)
        with open(self.log, "w") as out:  # the child keeps its own copy
            self.proc = subprocess.Popen(
                [*command, "--listen", self.endpoint, "--metrics-host", "127.0.0.1", "--metrics-port",
                 str(self.metrics_port), *args],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, **popen)
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the aggregator did not start (exit status {self.proc.returncode}): {self.tail()}")
            time.sleep(0.05)

    def get(self, path: str, timeout: float = 5.0) -> str:
        """The body of ``GET path`` (``/metrics``), or "" when the aggregator does not answer."""
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
                return r.read().decode()
        except (OSError, ValueError):
            return ""

    def healthy(self) -> bool:
        try:
            return bool(json.loads(self.get("/healthz", 1.0) or "{}").get("ok"))
        except ValueError:
            return False

    def tail(self, n: int = 3000) -> str:
        """The last ``n`` characters of its output."""
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s (:func:`stop_process`); does nothing once it has exited."""
        stop_process(self.proc)
