"""A stand-in for Grafana's HTTP API that holds every request to Grafana's own API spec.

A real Grafana cannot be installed on the test machines, so ``gradwatch grafana push`` and the
aggregator's annotation poster talk to :class:`ContractServer`: a real HTTP server on 127.0.0.1
that, for each request,

1. finds the path template and method in the Swagger 2.0 spec Grafana publishes
   (``public/api-merged.json``, vendored under ``tests/vendor/grafana/``; basePath ``/api``);
   an unknown path is 404, a known path with another method 405;
2. checks authentication (the spec's ``basic`` or ``api_key`` security): 401 without the right
   ``Authorization`` header;
3. checks every query parameter is declared for the operation and parses as its type and enum,
   required path and query parameters are present, and a body is JSON (``Content-Type:
   application/json``, the spec's ``consumes``) that validates against the operation's body
   schema, ``$ref`` s resolved; 400 otherwise. Stricter than Grafana in one way: an object schema
   that lists ``properties`` accepts no other keys (Grafana's Go decoder would ignore a
   misspelt field silently; here it fails the test);
4. answers from a small model of Grafana's behaviour that keeps state — folders, datasources,
   dashboards by uid with versions and folders, annotations — including the behaviours a client
   must cope with: 404 for an unknown uid, 409 for a duplicate folder or datasource, 412 for a
   stale dashboard version or a title taken in the folder, and a saved dashboard landing in
   General when the request names no folder;
5. validates its own successful answers against the operation's response schema, so a client
   that reads a field reads one the spec promises. (The spec's ``Dashboard`` model is an outdated
   Go struct — ``panels`` an object — whereas Grafana returns the stored JSON; it is treated as an
   open object.)

Operations the spec has but the model does not are answered 501. Everything a request did wrong
is kept in :attr:`ContractServer.violations`, every request in :attr:`ContractServer.requests`.
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import jsonschema

VENDOR = Path(__file__).resolve().parent / "vendor" / "grafana"  # committed copy; see its README.txt
SPEC_PATH = VENDOR / "grafana_http_api.swagger2.api-merged.json"


class Reject(Exception):
    """An error answer: HTTP ``code`` and an ``ErrorResponseBody`` (message, optional status)."""

    def __init__(self, code: int, message: str, **extra):
        super().__init__(message)
        self.code, self.body = code, {"message": message, **extra}


def _strict(node):
    """Copy of a schema where objects that list properties allow no others (see the module doc)."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out and "allOf" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@dataclass
class Operation:
    method: str
    template: str
    op: dict
    params: list[dict]

    @property
    def body_schema(self):
        return next((p["schema"] for p in self.params if p["in"] == "body"), None)


class Spec:
    """Grafana's Swagger 2.0 spec: route matching and request/response validation."""

    def __init__(self, path: Path = SPEC_PATH):
        self.doc = json.loads(Path(path).read_text())
        assert self.doc["swagger"] == "2.0" and self.doc["basePath"] == "/api"
        defs = _strict(self.doc["definitions"])
        defs["Dashboard"] = {"type": "object"}  # outdated in the spec; see the module docstring
        self.definitions = defs
        routes = []
        for template, item in self.doc["paths"].items():
            segs = template.strip("/").split("/")
            rx = "^/" + "/".join("([^/]+)" if s.startswith("{") else re.escape(s) for s in segs) + "$"
            names = [s[1:-1] for s in segs if s.startswith("{")]
            literal = sum(not s.startswith("{") for s in segs)
            routes.append((-literal, len(segs), template, re.compile(rx), names, item))
        routes.sort(key=lambda r: (r[0], r[1], r[2]))  # literal segments win over parameters
        self.routes = [(t, rx, names, item) for _, _, t, rx, names, item in routes]

    def match(self, method: str, path: str) -> tuple[Operation, dict[str, str]]:
        allowed = None
        for template, rx, names, item in self.routes:
            m = rx.match(path)
            if not m:
                continue
            op = item.get(method.lower())
            if op is None:
                allowed = allowed or sorted(k.upper() for k in item if k != "parameters")
                continue
            params = [*item.get("parameters", []), *op.get("parameters", [])]
            return Operation(method, template, op, params), dict(zip(names, map(unquote, m.groups())))
        if allowed:
            raise Reject(405, f"method {method} not allowed on {path}; the spec has {', '.join(allowed)}")
        raise Reject(404, f"no path {path} in Grafana's HTTP API spec")

    def _validator(self, schema):
        return jsonschema.Draft4Validator({**schema, "definitions": self.definitions})

    @staticmethod
    def _scalar(p: dict, raw: str):
        t = p.get("type", "string")
        try:
            v = {"integer": int, "number": float, "boolean": lambda s: {"true": True, "false": False}[s.lower()],
                 "string": str}[t](raw)
        except (ValueError, KeyError):
            raise Reject(400, f"parameter {p['name']}: {raw!r} is not a {t}") from None
        if "enum" in p and v not in p["enum"]:
            raise Reject(400, f"parameter {p['name']}: {raw!r} is not one of {p['enum']}")
        return v

    def request(self, op: Operation, path_params: dict, query: dict[str, list[str]], headers, body: bytes):
        """Validate one request; return ``(query values, parsed body)``.

        Raises:
            Reject: 400 (or 415) naming what the spec does not allow.
        """
        declared = {p["name"]: p for p in op.params if p["in"] == "query"}
        for name in query:
            if name not in declared:
                raise Reject(400, f"query parameter {name!r} is not in the spec of {op.method} {op.template}")
        values = {}
        for name, p in declared.items():
            raw = query.get(name)
            if raw is None:
                if p.get("required"):
                    raise Reject(400, f"query parameter {name!r} is required")
                continue
            if p.get("type") == "array":
                items = raw if p.get("collectionFormat") == "multi" else [x for r in raw for x in r.split(",")]
                values[name] = [self._scalar({**p["items"], "name": name}, x) for x in items]
            elif len(raw) > 1:
                raise Reject(400, f"query parameter {name!r} given {len(raw)} times")
            else:
                values[name] = self._scalar(p, raw[0])
        for p in op.params:
            if p["in"] == "path":
                self._scalar(p, path_params[p["name"]])
        schema = op.body_schema
        if schema is None:
            if body:
                raise Reject(400, f"{op.method} {op.template} takes no body")
            return values, None
        ctype = headers.get("Content-Type", "").split(";")[0].strip()
        if ctype != "application/json":
            raise Reject(415, f"body must be application/json (the spec's consumes), got {ctype!r}")
        try:
            parsed = json.loads(body or b"null")
        except ValueError as e:
            raise Reject(400, f"body is not JSON: {e}") from None
        errors = sorted(self._validator(schema).iter_errors(parsed), key=lambda e: list(e.absolute_path))
        if errors:
            e = errors[0]
            where = "/".join(map(str, e.absolute_path)) or "(body)"
            raise Reject(400, f"body does not match {schema.get('$ref', 'the schema')} at {where}: {e.message}")
        return values, parsed

    def response_problems(self, op: Operation, status: int, body) -> list[str]:
        """Why a successful answer of ours would not match the spec (empty when it does)."""
        resp = op.op["responses"].get(str(status))
        if resp is None:
            return [f"{op.method} {op.template}: status {status} not in the spec"]
        if "$ref" in resp:
            resp = self.doc["responses"][resp["$ref"].rsplit("/", 1)[1]]
        schema = resp.get("schema")
        if schema is None:
            return []
        return [f"{op.method} {op.template} -> {status}: {e.message} at {list(e.absolute_path)}"
                for e in self._validator(schema).iter_errors(body)]


@dataclass
class Request:
    method: str
    path: str
    template: str
    query: dict
    body: object
    authorization: str
    status: int = 0


def _now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


@dataclass
class State:
    """What the fake Grafana holds (one organisation)."""

    folders: dict = field(default_factory=dict)  # uid -> {id, uid, title, version, parentUid}
    datasources: dict = field(default_factory=dict)  # uid -> DataSource fields
    dashboards: dict = field(default_factory=dict)  # uid -> {id, version, folderUid, dashboard}
    annotations: list = field(default_factory=list)
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))


class Grafana:
    """The behaviour model: one method per modeled operation, keyed by (method, path template)."""

    def __init__(self, state: State):
        self.s = state
        self.routes = {
            ("GET", "/folders"): self.list_folders,
            ("POST", "/folders"): self.create_folder,
            ("GET", "/folders/{folder_uid}"): self.get_folder,
            ("PUT", "/folders/{folder_uid}"): self.update_folder,
            ("GET", "/datasources"): self.list_datasources,
            ("POST", "/datasources"): self.create_datasource,
            ("GET", "/datasources/uid/{uid}"): self.get_datasource,
            ("PUT", "/datasources/uid/{uid}"): self.update_datasource,
            ("POST", "/dashboards/db"): self.save_dashboard,
            ("GET", "/dashboards/uid/{uid}"): self.get_dashboard,
            ("GET", "/search"): self.search,
            ("POST", "/annotations"): self.create_annotation,
            ("GET", "/annotations"): self.list_annotations,
        }

    # folders
    def _folder_view(self, f: dict) -> dict:
        out = {"id": f["id"], "uid": f["uid"], "title": f["title"], "url": f"/dashboards/f/{f['uid']}/{_slug(f['title'])}",
               "version": f["version"], "orgId": 1, "hasAcl": False, "canSave": True, "canEdit": True,
               "canAdmin": True, "canDelete": True, "created": f["created"], "updated": f["updated"],
               "createdBy": "admin", "updatedBy": "admin"}
        if f.get("parentUid"):
            out["parentUid"] = f["parentUid"]
        return out

    def _title_taken(self, title: str, parent: str, uid: str) -> bool:
        return any(f["title"] == title and f.get("parentUid", "") == parent and u != uid for u, f in self.s.folders.items())

    def list_folders(self, q, body, **_):
        parent = q.get("parentUid", "")
        hits = [{"id": f["id"], "uid": f["uid"], "title": f["title"]} for f in self.s.folders.values()
                if f.get("parentUid", "") == parent]
        return 200, hits[: q.get("limit", 1000)]

    def create_folder(self, q, body, **_):
        title = (body.get("title") or "").strip()
        if not title:
            raise Reject(400, "folder title cannot be empty")
        uid = body.get("uid") or f"f{next(self.s.ids)}"
        parent = body.get("parentUid", "")
        if parent and parent not in self.s.folders:
            raise Reject(404, "parent folder not found")
        if uid in self.s.folders:
            raise Reject(409, "a folder with the same uid already exists")
        if self._title_taken(title, parent, uid):
            raise Reject(409, "a folder with the same name already exists in the current location")
        now = _now_iso()
        f = {"id": next(self.s.ids), "uid": uid, "title": title, "version": 1, "parentUid": parent,
             "created": now, "updated": now}
        if body.get("description"):
            f["description"] = body["description"]
        self.s.folders[uid] = f
        return 200, self._folder_view(f)

    def get_folder(self, q, body, folder_uid, **_):
        f = self.s.folders.get(folder_uid)
        if f is None:
            raise Reject(404, "folder not found", status="not-found")
        return 200, self._folder_view(f)

    def update_folder(self, q, body, folder_uid, **_):
        f = self.s.folders.get(folder_uid)
        if f is None:
            raise Reject(404, "folder not found", status="not-found")
        if not body.get("overwrite") and body.get("version") != f["version"]:
            raise Reject(409, "the folder has been changed by someone else", status="version-mismatch")
        if "title" in body:
            if self._title_taken(body["title"], f.get("parentUid", ""), folder_uid):
                raise Reject(409, "a folder with the same name already exists in the current location")
            f["title"] = body["title"]
        f["version"] += 1
        f["updated"] = _now_iso()
        return 200, self._folder_view(f)

    # datasources
    _DS_FIELDS = {"name": "", "type": "", "access": "proxy", "url": "", "user": "", "database": "",
                  "basicAuth": False, "basicAuthUser": "", "withCredentials": False, "isDefault": False, "jsonData": {}}

    def _ds_view(self, d: dict) -> dict:
        out = {k: copy.deepcopy(d[k]) for k in ("id", "uid", "orgId", "version", "readOnly", *self._DS_FIELDS)}
        out["typeLogoUrl"] = f"public/app/plugins/datasource/{d['type']}/img/logo.svg"
        out["secureJsonFields"] = {k: True for k in d.get("secure", {})}
        return out

    def _ds_validate(self, body: dict, uid: str):
        if not body.get("name"):
            raise Reject(400, "data source name is required")
        if not body.get("type"):
            raise Reject(400, "data source type is required")
        if any(d["name"] == body["name"] and u != uid for u, d in self.s.datasources.items()):
            raise Reject(409, "data source with the same name already exists")

    def list_datasources(self, q, body, **_):
        return 200, [self._ds_view(d) for d in self.s.datasources.values()]

    def create_datasource(self, q, body, **_):
        uid = body.get("uid") or f"ds{next(self.s.ids)}"
        if uid in self.s.datasources:
            raise Reject(409, "data source with the same uid already exists")
        self._ds_validate(body, uid)
        d = {**self._DS_FIELDS, **{k: v for k, v in body.items() if k in self._DS_FIELDS},
             "id": next(self.s.ids), "uid": uid, "orgId": 1, "version": 1, "readOnly": False,
             "secure": dict(body.get("secureJsonData") or {})}
        self.s.datasources[uid] = d
        return 200, {"id": d["id"], "name": d["name"], "message": "Datasource added", "datasource": self._ds_view(d)}

    def get_datasource(self, q, body, uid, **_):
        d = self.s.datasources.get(uid)
        if d is None:
            raise Reject(404, "Data source not found")
        return 200, self._ds_view(d)

    def update_datasource(self, q, body, uid, **_):
        d = self.s.datasources.get(uid)
        if d is None:
            raise Reject(404, "Data source not found")
        if d["readOnly"]:
            raise Reject(403, "Cannot update read-only data source")
        if "version" in body and body["version"] != d["version"]:
            raise Reject(409, "Datasource has already been updated by someone else. Please reload and try again")
        self._ds_validate(body, uid)
        # Grafana replaces the whole datasource: a field the request leaves out is reset.
        d.update({**self._DS_FIELDS, **{k: v for k, v in body.items() if k in self._DS_FIELDS}})
        d["version"] += 1
        if body.get("secureJsonData"):
            d["secure"].update(body["secureJsonData"])
        return 200, {"id": d["id"], "name": d["name"], "message": "Datasource updated", "datasource": self._ds_view(d)}

    # dashboards
    def _folder_of(self, body: dict) -> str:
        if body.get("folderUid"):
            if body["folderUid"] not in self.s.folders:
                raise Reject(400, "folder not found", status="not-found")
            return body["folderUid"]
        fid = body.get("folderId") or 0
        if fid:
            for u, f in self.s.folders.items():
                if f["id"] == fid:
                    return u
            raise Reject(400, "folder not found", status="not-found")
        return ""  # General: what Grafana does when a save names no folder

    def save_dashboard(self, q, body, **_):
        dash = body.get("dashboard")
        if not isinstance(dash, dict) or not str(dash.get("title", "")).strip():
            raise Reject(400, "Dashboard title cannot be empty", status="empty-name")
        folder = self._folder_of(body)
        uid = dash.get("uid") or f"d{next(self.s.ids)}"
        cur = self.s.dashboards.get(uid)
        if dash.get("id") is not None and (cur is None or cur["id"] != dash["id"]):
            raise Reject(404, "Dashboard not found", status="not-found")
        if cur is not None and not body.get("overwrite") and dash.get("version") != cur["version"]:
            raise Reject(412, "The dashboard has been changed by someone else", status="version-mismatch")
        for u, other in self.s.dashboards.items():
            if u != uid and other["folderUid"] == folder and other["dashboard"]["title"] == dash["title"]:
                raise Reject(412, "A dashboard with the same name in the folder already exists", status="name-exists")
        now = _now_iso()
        rec = cur or {"id": next(self.s.ids), "version": 0, "created": now}
        rec.update(version=rec["version"] + 1, folderUid=folder, updated=now, message=body.get("message", ""),
                   dashboard={**copy.deepcopy(dash), "id": rec["id"], "uid": uid, "version": rec["version"] + 1})
        self.s.dashboards[uid] = rec
        slug = _slug(dash["title"])
        return 200, {"id": rec["id"], "uid": uid, "url": f"/d/{uid}/{slug}", "status": "success",
                     "version": rec["version"], "title": slug, "folderUid": folder}

    def get_dashboard(self, q, body, uid, **_):
        rec = self.s.dashboards.get(uid)
        if rec is None:
            raise Reject(404, "Dashboard not found", status="not-found")
        f = self.s.folders.get(rec["folderUid"])
        slug = _slug(rec["dashboard"]["title"])
        meta = {"type": "db", "slug": slug, "url": f"/d/{uid}/{slug}", "version": rec["version"],
                "created": rec["created"], "updated": rec["updated"], "createdBy": "admin", "updatedBy": "admin",
                "canSave": True, "canEdit": True, "canAdmin": True, "canStar": True, "canDelete": True,
                "provisioned": False, "isFolder": False, "hasAcl": False, "folderUid": rec["folderUid"],
                "folderId": f["id"] if f else 0, "folderTitle": f["title"] if f else "General",
                "folderUrl": self._folder_view(f)["url"] if f else ""}
        return 200, {"dashboard": copy.deepcopy(rec["dashboard"]), "meta": meta}

    def search(self, q, body, **_):
        hits = []
        if q.get("type") in (None, "dash-folder"):
            hits += [{"id": f["id"], "uid": f["uid"], "title": f["title"], "type": "dash-folder", "tags": [],
                      "uri": f"db/{_slug(f['title'])}", "url": self._folder_view(f)["url"], "isStarred": False}
                     for f in self.s.folders.values()]
        if q.get("type") in (None, "dash-db"):
            for uid, rec in self.s.dashboards.items():
                f = self.s.folders.get(rec["folderUid"])
                h = {"id": rec["id"], "uid": uid, "title": rec["dashboard"]["title"], "type": "dash-db",
                     "tags": list(rec["dashboard"].get("tags", [])), "isStarred": False,
                     "uri": f"db/{_slug(rec['dashboard']['title'])}", "url": f"/d/{uid}/{_slug(rec['dashboard']['title'])}"}
                if f:
                    h.update(folderUid=f["uid"], folderTitle=f["title"], folderId=f["id"], folderUrl=self._folder_view(f)["url"])
                hits.append(h)
        if "query" in q:
            hits = [h for h in hits if q["query"].lower() in h["title"].lower()]
        if "folderUIDs" in q:
            hits = [h for h in hits if h["type"] == "dash-db" and h.get("folderUid", "") in q["folderUIDs"]]
        if "dashboardUIDs" in q:
            hits = [h for h in hits if h["uid"] in q["dashboardUIDs"]]
        for tag in q.get("tag", []):
            hits = [h for h in hits if tag in h["tags"]]
        return 200, sorted(hits, key=lambda h: h["title"])[: q.get("limit", 1000)]

    # annotations
    def create_annotation(self, q, body, **_):
        if body.get("dashboardUID") and body["dashboardUID"] not in self.s.dashboards:
            raise Reject(404, "Dashboard not found")
        now = int(time.time() * 1000)
        t = body.get("time") or now
        a = {"id": next(self.s.ids), "time": t, "timeEnd": body.get("timeEnd") or t, "text": body["text"],
             "tags": list(body.get("tags") or []), "dashboardUID": body.get("dashboardUID", ""),
             "dashboardId": 0, "panelId": body.get("panelId", 0), "data": body.get("data", {}),
             "created": now, "updated": now, "userId": 1, "login": "admin", "email": "admin@localhost", "avatarUrl": ""}
        self.s.annotations.append(a)
        return 200, {"id": a["id"], "message": "Annotation added"}

    def list_annotations(self, q, body, **_):
        out = self.s.annotations
        tags = q.get("tags", [])
        if tags:
            match = any if q.get("matchAny") else all
            out = [a for a in out if match(t in a["tags"] for t in tags)]
        if "from" in q:
            out = [a for a in out if a["time"] >= q["from"]]
        if "to" in q:
            out = [a for a in out if a["time"] <= q["to"]]
        if "dashboardUID" in q:
            out = [a for a in out if a["dashboardUID"] == q["dashboardUID"]]
        return 200, sorted(copy.deepcopy(out), key=lambda a: -a["time"])[: q.get("limit", 100)]


class ContractServer:
    """Grafana's HTTP API on ``http://127.0.0.1:<port>``, held to the spec (see the module doc).

    Args:
        token: the service account token it accepts (``Authorization: Bearer``).
        basic: ``(user, password)`` it accepts (``Authorization: Basic``).
        spec: a loaded :class:`Spec` (they take a second to build; share one).
    """

    def __init__(self, *, token: str = "glsa_test", basic: tuple[str, str] = ("admin", "secret"), spec: Spec | None = None):
        self.spec = spec or Spec()
        self.state = State()
        self.model = Grafana(self.state)
        self.token, self.basic = token, basic
        self.requests: list[Request] = []
        self.violations: list[str] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()  # headers and body go out in two writes: no Nagle delay between them
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                status, payload = server.handle(self.command, self.path, self.headers, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _any

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="grafana-contract",
                                        daemon=True)

    def __enter__(self) -> "ContractServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _authorized(self, header: str) -> bool:
        if header == f"Bearer {self.token}":
            return True
        if header.startswith("Basic "):
            try:
                user, _, pw = base64.b64decode(header[6:]).decode().partition(":")
            except ValueError:
                return False
            return (user, pw) == self.basic
        return False

    def handle(self, method: str, raw_path: str, headers, body: bytes) -> tuple[int, object]:
        url = urlsplit(raw_path)
        auth = headers.get("Authorization", "")
        req = Request(method, url.path, "", {}, None, auth)
        with self._lock:
            self.requests.append(req)
            try:
                if not url.path.startswith("/api/"):
                    raise Reject(404, f"{url.path} is outside the API's basePath /api")
                op, path_params = self.spec.match(method, url.path[len("/api"):])
                req.template = op.template
                if not self._authorized(auth):
                    raise Reject(401, "Unauthorized")
                query, parsed = self.spec.request(op, path_params, parse_qs(url.query, keep_blank_values=True), headers, body)
                req.query, req.body = query, parsed
                fn = self.model.routes.get((method, op.template))
                if fn is None:
                    raise Reject(501, f"{method} {op.template} is in the spec but not modeled by the contract server")
                status, payload = fn(query, parsed, **path_params)
                problems = self.spec.response_problems(op, status, payload)
                if problems:
                    self.violations += problems
                    status, payload = 500, {"message": "; ".join(problems)}
            except Reject as r:
                status, payload = r.code, r.body
                # what the spec does not allow (a 404 for a path it has is Grafana's "no such uid")
                if r.code in (400, 405, 415, 501) or (r.code == 404 and not req.template):
                    self.violations.append(f"{method} {url.path}: {r.code} {r.body['message']}")
            except Exception as e:  # a bug of the model: fail the test, not the connection
                status, payload = 500, {"message": f"contract server error: {e!r}"}
                self.violations.append(f"{method} {url.path}: contract server error {e!r}")
            req.status = status
            return status, payload

    # views for tests
    def dashboards_in(self, folder_uid: str) -> list[str]:
        return sorted(u for u, d in self.state.dashboards.items() if d["folderUid"] == folder_uid)

    def calls(self, method: str, template: str) -> list[Request]:
        return [r for r in self.requests if r.method == method and r.template == template]
