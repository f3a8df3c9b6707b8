"""Findings as Grafana annotations: a :class:`~.runner.Runner` sink that posts each raised finding.

With ``--grafana-url`` set, every finding the checks raise becomes one organisation annotation
(``POST <url>/api/annotations``, Grafana's HTTP API) at the time it was raised, tagged
``gradwatch``, ``job:<job_id>``, ``check:<check>``, ``rank:<rank>`` (when the finding names a
rank) and ``severity:<severity>``, with the finding's one-line summary as text. A finding updated
with where its rank is stuck (``details["stacks"]``, :mod:`.control`) becomes one more annotation,
its text the stuck rank's innermost frames beside the healthy rank's. The gradwatch dashboards
overlay the annotations tagged ``gradwatch`` and ``job:<their job>``.

The runner calls its sinks on the aggregator's single writer thread, which must never wait on a
network: :meth:`GrafanaAnnotations.__call__` only puts the event on a bounded queue (when full the
event is dropped and counted) and one daemon thread posts, with a timeout. A failed post is counted
and logged once; Grafana being slow or down never delays a report or a check. Only the standard
library is used, so the aggregator needs no Grafana client.
"""

from __future__ import annotations

import base64
import json
import logging
import queue
import threading
import urllib.request
from typing import Callable, Optional

from .runner import Event

log = logging.getLogger("gradwatch.aggregator")

_STOP = object()


#: frames of each stack an annotation shows, innermost first
TOP_FRAMES = 3


def annotation(e: Event) -> dict:
    """The ``PostAnnotationsCmd`` body for one raised finding, or one updated with its stacks
    (time in milliseconds since the epoch)."""
    tags = ["gradwatch", f"job:{e.job}", f"check:{e.check}"]
    if e.rank is not None:
        tags.append(f"rank:{e.rank}")
    tags.append(f"severity:{e.severity}")
    where = f" (layer {e.layer})" if e.layer else ""
    text = f"{e.check} [{e.severity}]{where}: {e.summary}"
    stacks = e.details.get("stacks") if e.event == "updated" else None
    if stacks:
        tags.append("stacks")
        text += "".join(f"\n{who} rank {s['rank']}: " + (" < ".join(
            f"{f['file'].rsplit('/', 1)[-1]}:{f['line']} {f['function']}" for f in s["frames"][::-1][:TOP_FRAMES])
            or s.get("error", "no stack")) for who, s in (("stuck", stacks.get("stuck")), ("healthy", stacks.get("healthy")))
            if s)
    return {"time": int(e.time * 1000), "tags": tags, "text": text}


def auth_header(token: str = "", basic_auth: str = "") -> Optional[str]:
    """``Authorization`` header value: a bearer token (service account) or ``USER:PASSWORD``."""
    if token:
        return f"Bearer {token}"
    if basic_auth:
        return "Basic " + base64.b64encode(basic_auth.encode()).decode()
    return None


class GrafanaAnnotations:
    """Posts raised findings to ``<url>/api/annotations`` from a background thread.

    Args:
        url: Grafana's base URL (``https://grafana.example``; a sub-path is kept).
        token: service account token, sent as ``Authorization: Bearer``.
        basic_auth: ``USER:PASSWORD`` for basic auth (instead of a token).
        timeout: seconds per request.
        max_queue: events waiting to be posted; beyond it new ones are dropped and counted.
        post: ``(url, body bytes, headers) -> None``, raising on failure (tests pass their own).

    Attributes ``posted``, ``failed`` and ``dropped`` count events.
    """

    def __init__(self, url: str, *, token: str = "", basic_auth: str = "", timeout: float = 5.0,
                 max_queue: int = 1000, post: Callable[[str, bytes, dict], None] | None = None):
        self.endpoint = url.rstrip("/") + "/api/annotations"
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        header = auth_header(token, basic_auth)
        if header:
            self.headers["Authorization"] = header
        self.timeout = timeout
        self._post = post or self._urlopen
        self._q: queue.Queue = queue.Queue(max_queue)
        self.posted = self.failed = self.dropped = 0
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="gradwatch-annotations", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, cfg) -> "GrafanaAnnotations":
        return cls(cfg.grafana_url, token=cfg.grafana_token, basic_auth=cfg.grafana_basic_auth)

    def __call__(self, e: Event) -> None:
        """The runner's sink: queue a raised finding, or one updated with its stacks; never block."""
        if e.event != "raised" and not (e.event == "updated" and e.details.get("stacks")):
            return
        try:
            self._q.put_nowait(e)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        """Post what is queued (for at most ``timeout`` seconds), then stop the thread."""
        try:
            self._q.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _urlopen(self, url: str, body: bytes, headers: dict) -> None:
        req = urllib.request.Request(url, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout) as r:  # raises HTTPError on 4xx/5xx
            r.read()

    def _run(self) -> None:
        while True:
            e = self._q.get()
            if e is _STOP:
                return
            try:
                self._post(self.endpoint, json.dumps(annotation(e)).encode(), dict(self.headers))
                self.posted += 1
            except Exception as err:  # Grafana down, refused, timed out: count, warn once, go on
                self.failed += 1
                if not self._warned:
                    self._warned = True
                    log.warning("gradwatch: posting a finding to %s failed (counted, later failures not "
                                "logged): %r", self.endpoint, err)
