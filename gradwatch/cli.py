"""The ``gradwatch`` command. Subcommands import lazily: ``aggregator`` never imports torch."""

from __future__ import annotations

import sys

COMMANDS = {
    "aggregator": ("gradwatch.aggregator", "Run the aggregator daemon (receives agents' reports, serves /metrics)."),
    "demo": ("gradwatch.demo", "Train a small transformer on 2 DDP ranks with agents and an aggregator."),
    "grafana": ("gradwatch.grafana", "Generate the dashboards, or push folder, datasource and dashboards to Grafana."),
    "keys": ("gradwatch.auth", "Make CURVE keys: a server pair for the aggregator, client pairs for the agents."),
    "stack": ("gradwatch.stack", "Run a local Prometheus and Alertmanager with the shipped alert rules against an aggregator."),
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        out = sys.stdout if args and args[0] in ("-h", "--help") else sys.stderr
        print("usage: gradwatch {" + ",".join(COMMANDS) + "} [--help] ...\n", file=out)
        for name, (_, doc) in COMMANDS.items():
            print(f"  {name:<12} {doc}", file=out)
        if args and args[0] not in ("-h", "--help"):
            print(f"\ngradwatch: unknown command {args[0]!r}", file=out)
        return 0 if args and args[0] in ("-h", "--help") else 2
    import importlib

    module = importlib.import_module(COMMANDS[args[0]][0])
    return module.main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
