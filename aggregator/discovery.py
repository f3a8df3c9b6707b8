"""Prometheus file-based discovery: the aggregator announces its own ``/metrics`` in a target file.

With ``--file-sd-path PATH`` the aggregator writes, once its HTTP port is bound,
``[{"targets": ["HOST:PORT"], "labels": {...}}]`` (Prometheus' ``file_sd_configs`` format) and
removes it when it shuts down cleanly (SIGTERM, SIGINT), so a Prometheus reading that directory
scrapes each job's aggregator for as long as it runs: one aggregator per Slurm job, on a port
picked at start (``--metrics-port 0``). deploy/prometheus/file-sd.yml is the matching scrape job.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

#: the formats Prometheus' file discovery reads, by file name suffix (JSON is also YAML)
SUFFIXES = (".json", ".yml", ".yaml")
_WILDCARDS = ("", "0.0.0.0", "::")


def target_host(metrics_host: str, override: str = "") -> str:
    """The host Prometheus should scrape: ``override``, else ``metrics_host``, else (when that binds
    every interface) this host's name; IPv6 addresses in brackets, as a target's HOST:PORT needs."""
    host = override or (socket.gethostname() if metrics_host in _WILDCARDS else metrics_host)
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class TargetFile:
    """One aggregator's file_sd target file.

    Args:
        path: where to write it (its directory must exist; Prometheus globs it, e.g. ``DIR/*.json``).
        target: ``HOST:PORT`` of ``/metrics``.
        labels: target labels Prometheus attaches to every series of the target.
    """

    def __init__(self, path: str | os.PathLike, target: str, labels: dict[str, str]):
        self.path = Path(path)
        self.content = json.dumps([{"targets": [target], "labels": dict(labels)}], indent=2) + "\n"

    def write(self) -> None:
        """Write atomically: Prometheus re-reads the file whenever it changes and must never see
        half of it.

        Raises:
            OSError: the directory is missing or not writable.
        """
        # the temporary name ends in neither suffix, so a DIR/*.json glob never matches it
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.content)
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600; Prometheus runs as another user
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def remove(self) -> None:
        """Remove the file, unless it no longer holds this target (another aggregator, e.g. of a
        requeued job, wrote the same path since): removing that one would hide it from Prometheus."""
        try:
            if self.path.read_text() == self.content:
                self.path.unlink()
        except OSError:  # already gone, or unreadable: nothing of ours to remove
            pass
