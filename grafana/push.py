"""``gradwatch grafana push``: the folder, the Prometheus datasource and the dashboards, through
Grafana's HTTP API (grafana-client, the maintained fork of grafana-api; ``pip install
'gradwatch[grafana]'``).

Idempotent: each object is looked up by its stable uid first, then created or updated, so pushing
again never duplicates anything.

* folder (``GET /api/folders/{uid}``, then ``POST /api/folders`` or, when the title changed,
  ``PUT /api/folders/{uid}``);
* datasource (``GET /api/datasources/uid/{uid}``, then ``POST /api/datasources`` or, when it
  differs, ``PUT /api/datasources/uid/{uid}``); ``--skip-datasource`` uses an existing one;
* each dashboard (``GET /api/dashboards/uid/{uid}``, then ``POST /api/dashboards/db`` with
  ``overwrite``). Grafana puts a saved dashboard in the folder the request names and in General
  when it names none, so an update always names the folder the dashboard is in now: a dashboard
  stays where it is (in the gradwatch folder, or wherever someone moved it); a new one goes to
  the gradwatch folder.

Errors: :class:`PushError` (a request Grafana refused, or no connection), reported by
:func:`main` as one line, exit status 1.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from gradwatch.commands.errors import CommandError, UsageError
from gradwatch.errors import GradwatchError

from .generate import DATASOURCE_NAME, DATASOURCE_UID, FOLDER_TITLE, FOLDER_UID, build


class PushError(GradwatchError):
    """A Grafana request failed; the message names the object and Grafana's answer."""


def connect(url: str, *, token: str = "", basic_auth: str = "", timeout: float = 10.0):
    """A ``grafana_client.GrafanaApi`` for ``url`` (``https://grafana.example[/sub/path]``)."""
    from grafana_client import GrafanaApi

    if not url.endswith("/"):
        url += "/"  # grafana-client appends "api" to the path as it is
    credential = token or (tuple(basic_auth.split(":", 1)) if basic_auth else None)
    return GrafanaApi.from_url(url, credential=credential, timeout=timeout)


def with_datasource(dashboard: dict, uid: str, name: str) -> dict:
    """A copy of ``dashboard`` whose ``datasource`` variable preselects datasource ``uid``."""
    d = copy.deepcopy(dashboard)
    for v in d["templating"]["list"]:
        if v["name"] == "datasource":
            v["current"] = {"text": name, "value": uid}
    return d


def _missing(e) -> bool:
    return getattr(e, "status_code", None) == 404


def push(api, *, prometheus_url: str = "http://localhost:9090", datasource_uid: str = DATASOURCE_UID,
         datasource_name: str = DATASOURCE_NAME, skip_datasource: bool = False, folder_uid: str = FOLDER_UID,
         folder_title: str = FOLDER_TITLE, dashboards: dict[str, dict] | None = None,
         say: Callable[[str], None] = print) -> None:
    """Create or update folder, datasource and dashboards; ``say`` gets one line per object.

    Raises:
        PushError: naming the object whose request failed and Grafana's answer.
    """
    from grafana_client.client import GrafanaException
    from niquests.exceptions import RequestException

    def call(what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GrafanaException as e:
            if _missing(e) and what.startswith("look up"):
                return None
            raise PushError(f"{what}: {e.message}") from None
        except RequestException as e:
            raise PushError(f"{what}: cannot reach Grafana: {e}") from None

    # folder
    folder = call(f"look up folder {folder_uid}", api.folder.get_folder, folder_uid)
    if folder is None:
        call(f"create folder {folder_uid}", api.folder.create_folder, folder_title, uid=folder_uid)
        say(f"folder {folder_uid}: created")
    elif folder.get("title") != folder_title:
        call(f"update folder {folder_uid}", api.folder.update_folder, folder_uid, title=folder_title, overwrite=True)
        say(f"folder {folder_uid}: updated")
    else:
        say(f"folder {folder_uid}: unchanged")

    # datasource
    if skip_datasource:
        say(f"datasource {datasource_uid}: skipped (--skip-datasource)")
    else:
        want = {"uid": datasource_uid, "name": datasource_name, "type": "prometheus", "access": "proxy",
                "url": prometheus_url, "jsonData": {"timeInterval": "5s"}}
        ds = call(f"look up datasource {datasource_uid}", api.datasource.get_datasource_by_uid, datasource_uid)
        if ds is None:
            call(f"create datasource {datasource_uid}", api.datasource.create_datasource, want)
            say(f"datasource {datasource_uid}: created ({prometheus_url})")
        elif any(ds.get(k) != v for k, v in want.items() if k != "jsonData") or \
                any((ds.get("jsonData") or {}).get(k) != v for k, v in want["jsonData"].items()):
            body = dict(want, jsonData={**(ds.get("jsonData") or {}), **want["jsonData"]})
            call(f"update datasource {datasource_uid}", api.datasource.update_datasource_by_uid, datasource_uid, body)
            say(f"datasource {datasource_uid}: updated ({prometheus_url})")
        else:
            say(f"datasource {datasource_uid}: unchanged")

    # dashboards
    for uid, d in (dashboards if dashboards is not None else build()).items():
        current = call(f"look up dashboard {uid}", api.dashboard.get_dashboard, uid)
        target = folder_uid if current is None else current.get("meta", {}).get("folderUid", "")
        r = call(f"save dashboard {uid}", api.dashboard.update_dashboard, {
            "dashboard": with_datasource(d, datasource_uid, datasource_name), "folderUid": target,
            "overwrite": True, "message": "gradwatch grafana push",
        })
        where = f"folder {target}" if target else "General"
        say(f"dashboard {uid}: {'created' if current is None else 'updated'} (version {r.get('version')}, in {where})")


class PushCommand(BaseModel):
    """Create or update the gradwatch folder, the Prometheus datasource and the five dashboards in a
    running Grafana, through its HTTP API. Pushing again updates them in place."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(description="Grafana's base URL, e.g. https://grafana.example.")
    token: str = Field("", description="Service account token (default: $GRAFANA_TOKEN).")
    basic_auth: str = Field("", description="USER:PASSWORD, basic auth instead of a token.")
    prometheus_url: str = Field("http://localhost:9090", description="URL Grafana's server uses to reach the Prometheus that scrapes the aggregator.")
    datasource_uid: str = Field(DATASOURCE_UID, description="uid of the Prometheus datasource.")
    datasource_name: str = Field(DATASOURCE_NAME, description="Name of the Prometheus datasource.")
    skip_datasource: bool = Field(False, description="Do not create or update the datasource; use the existing --datasource-uid.")
    folder_uid: str = Field(FOLDER_UID, description="uid of the folder new dashboards go to.")
    folder_title: str = Field(FOLDER_TITLE, description="Title of that folder.")
    timeout: float = Field(10.0, gt=0, description="Seconds per request.")

    @field_validator("basic_auth")
    @classmethod
    def _basic_auth(cls, v: str, info: ValidationInfo) -> str:
        if v and info.data.get("token"):
            raise ValueError("give --token or --basic-auth, not both")
        if v and ":" not in v:
            raise ValueError("must look like USER:PASSWORD")
        return v

    def cli_cmd(self) -> None:
        """Push.

        Raises:
            UsageError: no credential given.
            PushError: a request Grafana refused, or no connection.
            CommandError: grafana-client is not installed.
        """
        token = self.token or ("" if self.basic_auth else os.environ.get("GRAFANA_TOKEN", ""))
        if not token and not self.basic_auth:
            raise UsageError("give --token, --basic-auth USER:PASSWORD, or set GRAFANA_TOKEN")
        try:
            api = connect(self.url, token=token, basic_auth=self.basic_auth, timeout=self.timeout)
            push(api, prometheus_url=self.prometheus_url, datasource_uid=self.datasource_uid,
                 datasource_name=self.datasource_name, skip_datasource=self.skip_datasource,
                 folder_uid=self.folder_uid, folder_title=self.folder_title)
        except ImportError as e:
            raise CommandError(f"{e}; install it with: pip install 'gradwatch[grafana]'") from None


def main(argv: list[str] | None = None) -> int:
    """``gradwatch grafana push [FLAGS]``; the exit status."""
    from gradwatch.commands.cli import main as gradwatch

    return gradwatch(["grafana", "push", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
