"""The aggregator's HTTP server: ``/metrics``, ``/api/findings``, ``/api/checks``, ``/healthz``,
and the control endpoints ``/api/stacks``, ``/api/probe``, ``/api/budget``.

:class:`Api` is the WSGI application; its server's threads only read the latest published
:class:`~.snapshot.Snapshot` (and the Prometheus registry collecting from it), never the state;
the control endpoints ask the control room (:class:`~.control.Control`) and wait for the agents'
answers. They need the bearer token the aggregator was started with (``--control-token``): without
one configured they answer 403, with a wrong one 401. :func:`serve` binds it.
"""

from __future__ import annotations

import errno
import hmac
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
from .control import ControlError
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
        control: the control room the control endpoints ask (None: they answer 404).
        token: the bearer token the control endpoints require ('' : they answer 403).
    """

    #: /api/findings' query parameters, and the values ``active`` takes (true, false)
    FINDINGS_QUERY = ("job_id", "check", "active")
    _ACTIVE = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False, "": False}
    #: the control endpoints: path -> (method, the JSON fields or query parameters they take)
    CONTROL = {"/api/stacks": ("GET", ("job_id", "rank", "wait_s", "source")),
               "/api/probe": ("POST", ("job_id", "steps", "layers", "wait_s")),
               "/api/budget": ("POST", ("job_id", "budget", "for_s", "wait_s"))}
    #: largest request body a control endpoint reads, bytes
    MAX_BODY = 8192

    def __init__(self, snapshot: Callable[[], Snapshot], registry: CollectorRegistry, alive: Callable[[], bool],
                 control=None, token: str = ""):
        self.snapshot, self.alive = snapshot, alive
        self._metrics = make_wsgi_app(registry)
        self.control = control
        self._token = token.encode()

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics(environ, start_response)
        if path in self.CONTROL and self.control is not None:
            return self._control(path, environ, start_response)
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
    def _json(start_response, obj, status: str = "200 OK", headers=()):
        body = json.dumps(obj, allow_nan=False).encode()
        start_response(status, [("Content-Type", "application/json"), *headers])
        return [body]

    _STATUS = {400: "400 Bad Request", 401: "401 Unauthorized", 403: "403 Forbidden", 404: "404 Not Found",
               405: "405 Method Not Allowed", 409: "409 Conflict", 413: "413 Payload Too Large",
               429: "429 Too Many Requests", 503: "503 Service Unavailable"}

    def _control(self, path: str, environ, start_response):
        """A control endpoint: the token, the method, the request, then the control room's answer
        (``{"error": ...}`` with the status that says why otherwise)."""
        def fail(code: int, msg: str, headers=()):
            return self._json(start_response, {"error": msg}, self._STATUS[code], headers)

        if not self._token:
            return fail(403, f"{path} is a control endpoint and this aggregator has no control token: start it with "
                             "--control-token TOKEN (or GRADWATCH_AGGREGATOR_CONTROL_TOKEN) and send "
                             "'Authorization: Bearer TOKEN' (gradwatch stacks --token, or GRADWATCH_CONTROL_TOKEN)")
        given = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._token):
            return fail(401, "a control endpoint needs 'Authorization: Bearer TOKEN' with the aggregator's "
                             "--control-token", [("WWW-Authenticate", 'Bearer realm="gradwatch"')])
        method, names = self.CONTROL[path]
        if environ.get("REQUEST_METHOD", "GET") != method:
            return fail(405, f"{path} takes {method}", [("Allow", method)])
        try:
            q = self._control_input(environ, method)
            unknown = sorted(set(q) - set(names))
            if unknown:
                raise ValueError(f"unknown parameter {unknown[0][:64]!r}: {path} takes {', '.join(names)}")
            job = q.get("job_id")
            if not isinstance(job, str) or not job:
                raise ValueError(f"{path} needs job_id")
            wait_s = float(q.get("wait_s", 3.0))
            if path == "/api/stacks":
                rank = q.get("rank")
                got = self.control.stacks(job, None if rank in (None, "") else int(rank), wait_s,
                                          source=self._ACTIVE.get(str(q.get("source", "")).lower(), False))
            elif path == "/api/probe":
                layers = q.get("layers") or ()
                if isinstance(layers, str) or not all(isinstance(x, str) for x in layers):
                    raise ValueError("layers: a list of fnmatch patterns of module paths")
                got = self.control.probe(job, int(q.get("steps", 0)), tuple(layers), wait_s)
            else:
                got = self.control.budget(job, float(q.get("budget", 0)), float(q.get("for_s", 0)), wait_s)
        except ControlError as e:
            return fail(e.status, str(e))
        except (ValueError, TypeError) as e:
            return fail(400, str(e)[:300])
        return self._json(start_response, json_safe(got))

    def _control_input(self, environ, method: str) -> dict:
        """A GET's query parameters, a POST's JSON object body (at most :data:`MAX_BODY` bytes).

        Raises:
            ValueError: a body that is too large or not a JSON object."""
        if method == "GET":
            return {k: v[-1] for k, v in parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True).items()}
        try:
            n = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            n = -1
        if not 0 <= n <= self.MAX_BODY:
            raise ValueError(f"the body must be a JSON object of at most {self.MAX_BODY} bytes")
        try:
            body = json.loads(environ["wsgi.input"].read(n) or b"{}")
        except (ValueError, UnicodeDecodeError):
            raise ValueError("the body is not JSON") from None
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        return body

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
