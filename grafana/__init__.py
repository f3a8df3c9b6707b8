"""gradwatch.grafana: the dashboards as code, and ``gradwatch grafana`` to generate or push them.

The end of the pipeline: the aggregator's series (``/metrics``, scraped by Prometheus) and
findings become five dashboards. :mod:`.generate` builds them as plain dicts (Grafana's classic
dashboard JSON model, schemaVersion 41) and writes ``grafana/dashboards/*.json`` and the
file-provisioning YAML under ``grafana/provisioning/``; :mod:`.push` creates or updates the
folder, the Prometheus datasource and the dashboards through Grafana's HTTP API (grafana-client,
installed with the ``grafana`` extra).

Commands::

    gradwatch grafana generate [--check]     write (or only compare) the committed files
    gradwatch grafana push --url URL (--token T | --basic-auth USER:PASSWORD) [...]

Errors: a failed request ends ``push`` with exit status 1 and one line naming the request and
Grafana's answer; nothing else is raised to the shell. Grafana's client (and niquests) are imported
only when ``push`` runs.
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from pydantic_settings import CliApp, CliSubCommand

from .generate import GenerateCommand
from .push import PushCommand

__all__ = ["GrafanaCommand", "main"]


class GrafanaCommand(BaseModel):
    """Generate the dashboards, or push folder, datasource and dashboards to a running Grafana."""

    generate: CliSubCommand[GenerateCommand] = Field(
        description="Write grafana/dashboards/*.json and grafana/provisioning/ from the dashboards as code "
        "(--check: only compare, exit 1 when the committed files drifted).")
    push: CliSubCommand[PushCommand] = Field(
        description="Create or update the gradwatch folder, the Prometheus datasource and the dashboards "
        "in a running Grafana through its HTTP API.")

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> int:
    """``gradwatch grafana SUBCOMMAND ...``; the exit status."""
    import sys

    from gradwatch.commands.cli import main as gradwatch

    return gradwatch(["grafana", *(sys.argv[1:] if argv is None else argv)])
