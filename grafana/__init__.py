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
Grafana's answer; nothing else is raised to the shell.
"""

from __future__ import annotations

import sys

__all__ = ["main"]

USAGE = """usage: gradwatch grafana {generate,push} [--help] ...

  generate     Write grafana/dashboards/*.json and grafana/provisioning/ from the dashboards as code
               (--check: only compare, exit 1 when the committed files drifted).
  push         Create or update the gradwatch folder, the Prometheus datasource and the dashboards
               in a running Grafana through its HTTP API.
"""


def main(argv: list[str] | None = None) -> int:
    """``gradwatch grafana SUBCOMMAND ...``; each subcommand imports its dependencies lazily."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "generate":
        from .generate import main as run
    elif args[0] == "push":
        from .push import main as run
    else:
        print(USAGE + f"\ngradwatch grafana: unknown command {args[0]!r}", file=sys.stderr)
        return 2
    return run(args[1:])
