"""The aggregator's HTTP server: ``/metrics``, ``/api/findings``, ``/api/checks``, ``/healthz``.

:class:`Api` is the WSGI application; its server's threads only read the latest published
:class:`~.snapshot.Snapshot` (and the Prometheus registry collecting from it), never the state.
:func:`serve` binds it.
"""

from __future__ import annotations

import errno
import json
import logging
from dataclasses import asdict
from socketserver import ThreadingMixIn
from typing import Callable
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from gradwatch.errors import ConfigError

from .checks import CHECKS
from .runner import json_safe
from .snapshot import Snapshot

log = logging.getLogger("gradwatch.aggregator")


class HTTPServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # scrapes every few seconds would flood the log
        log.debug("http: " + format, *args)


class Api:
    """The WSGI application.

    Args:
        snapshot: returns the latest published snapshot.
        registry: the Prometheus registry ``/metrics`` serves.
        alive: whether the aggregator's threads are alive (``/healthz``: 503 when not, so a
            liveness probe restarts it).
    """

    #: /api/findings' query parameters, and the values ``active`` takes (true, false)
    FINDINGS_QUERY = ("job_id", "check", "active")
    _ACTIVE = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False, "": False}

    def __init__(self, snapshot: Callable[[], Snapshot], registry: CollectorRegistry, alive: Callable[[], bool]):
        self.snapshot, self.alive = snapshot, alive
        self._metrics = make_wsgi_app(registry)

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics(environ, start_response)
        if path == "/api/findings":
            try:
                return self._json(start_response, self.findings(environ))
            except ValueError as e:  # a query it cannot answer: said, not ignored
                return self._json(start_response, {"error": str(e)}, "400 Bad Request")
        if path == "/api/checks":
            view = self.snapshot().checks
            status = [dict(job_id=j, check=c, status=o) for j, c, o in (view.status if view else ())]
            return self._json(start_response, {"checks": status})
        if path == "/healthz":
            ok = self.alive()
            body = json.dumps({"ok": ok}).encode()
            # 503 when the writer or the intake thread died, so a liveness probe restarts the aggregator
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
            return [body]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /metrics\n"]

    @staticmethod
    def _json(start_response, obj, status: str = "200 OK"):
        body = json.dumps(obj, allow_nan=False).encode()
        start_response(status, [("Content-Type", "application/json")])
        return [body]

    def findings(self, environ) -> dict:
        """``/api/findings[?job_id=J][&check=C][&active=1]``: events newest first, or active findings
        (each with ``since``, the wall-clock time it was raised, None once the event ring has let
        its raised event go); every item also carries its job as ``job_id``.

        Raises:
            ValueError: a parameter not in :data:`FINDINGS_QUERY`, an ``active`` that is no
                yes or no, or a ``check`` that names no check (a typo would read as "no findings").
        """
        q = {k: v[-1] for k, v in parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True).items()}
        unknown = sorted(set(q) - set(self.FINDINGS_QUERY))
        if unknown:
            raise ValueError(f"unknown parameter {unknown[0]!r}: /api/findings takes {', '.join(self.FINDINGS_QUERY)}")
        active = self._ACTIVE.get(q.get("active", "").lower())
        if active is None:
            raise ValueError(f"active={q['active']!r}: give 1 (active findings only) or 0")
        if "check" in q and q["check"] not in CHECKS:
            raise ValueError(f"check={q['check'][:64]!r} names no check: {', '.join(sorted(CHECKS))}")
        view = self.snapshot().checks
        if view is None:
            return {"findings": []}
        if active:
            # since: when it was raised (its latest raised event, while the event ring holds it)
            since = {(e.check, e.job, e.rank, e.layer): e.time for e in view.events if e.event == "raised"}
            items = [dict(asdict(f), severity=view.severity.get(f.check, ""),
                          since=since.get((f.check, f.job, f.rank, f.layer))) for f in view.active]
        else:
            items = [asdict(e) for e in reversed(view.events)]
        items = [
            dict(i, job_id=i["job"]) for i in items  # job_id as the query and the metrics' label say it
            if q.get("job_id", i["job"]) == i["job"] and q.get("check", i["check"]) == i["check"]
        ]
        return {"findings": json_safe(items)}


def serve(host: str, port: int, app: Api) -> HTTPServer:
    """An HTTP server for ``app`` bound at ``host:port`` (0: any free port), not yet serving.

    Raises:
        ConfigError: the port is taken or privileged (naming ``metrics_port``), or the address is
            not one of this host (naming ``metrics_host``).
    """
    try:
        return make_server(host, port, app, HTTPServer, handler_class=QuietHandler)
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EACCES):  # the port is taken, or privileged
            setting, hint = "metrics_port", "pick another with --metrics-port"
        else:  # no such address here, or no address at all
            setting, hint = "metrics_host", "give an address of this host with --metrics-host"
        raise ConfigError(f"aggregator.{setting}: cannot serve HTTP on {host}:{port}: {e} ({hint})") from None
