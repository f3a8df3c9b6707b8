"""The ``gradwatch`` command: one pydantic-settings model per subcommand, parsed and run by
:class:`pydantic_settings.CliApp`.

Each subcommand is a model whose docstring is its ``--help``, whose fields are its flags
(``metrics_port`` is ``--metrics-port``) and whose ``cli_cmd`` method runs it. Adding one takes
that model and one line in :class:`Gradwatch`::

    keys: CliSubCommand[KeysCommand] = Field(description="...")

Exit statuses: 0 done; 2 an invalid, unknown or missing setting (one line naming it:
``gradwatch: aggregator.metrics_port: Input should be ...``); 1 a command that failed
(:class:`~gradwatch.commands.errors.CommandError` and the other :class:`~gradwatch.GradwatchError`
s, one line). Importing this module imports neither torch, nor a Grafana client, nor textual.
"""

from __future__ import annotations

import logging
import sys
import typing

from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import BaseSettings, CliApp, CliSubCommand, SettingsConfigDict, SettingsError

from gradwatch.aggregator import Aggregator, AggregatorConfig
from gradwatch.aggregator.config import warn_unknown_variables
from gradwatch.errors import ConfigError, GradwatchError
from gradwatch.grafana import GrafanaCommand
from gradwatch.settings import describe

from .control import ProbeCommand, StacksCommand
from .demo.run import DemoConfig, run as run_demo
from .errors import CommandError
from .keys import KeysCommand
from .stack import StackCommand
from .top import TopCommand


class AggregatorCommand(AggregatorConfig):
    """gradwatch aggregator: receives every rank's reports, reconciles ranks, serves /metrics."""

    def cli_cmd(self) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        warn_unknown_variables()  # a typo in a variable would be ignored without a word
        Aggregator(self).serve_forever()


class DemoCommand(DemoConfig):
    """Train a small character-level transformer on the standard library's source with gradwatch attached."""

    def cli_cmd(self) -> None:
        status = run_demo(self)
        if status:
            raise CommandError(status=status)  # run_demo printed why


class Gradwatch(BaseSettings):
    """gradwatch: monitoring for distributed PyTorch training."""

    model_config = SettingsConfigDict(
        cli_prog_name="gradwatch", cli_kebab_case=True, cli_implicit_flags=True, cli_exit_on_error=False,
        env_prefix="GRADWATCH_CLI_",  # each subcommand reads its own variables; none are read here
    )

    aggregator: CliSubCommand[AggregatorCommand] = Field(
        description="Run the aggregator daemon (receives agents' reports, serves /metrics).")
    demo: CliSubCommand[DemoCommand] = Field(
        description="Train a small transformer on 2 DDP ranks with agents and an aggregator.")
    grafana: CliSubCommand[GrafanaCommand] = Field(
        description="Generate the dashboards, or push folder, datasource and dashboards to Grafana.")
    keys: CliSubCommand[KeysCommand] = Field(
        description="Make CURVE keys: a server pair for the aggregator, client pairs for the agents.")
    probe: CliSubCommand[ProbeCommand] = Field(
        description="Make every rank of a job probe its next N steps now (needs the aggregator's control token).")
    stack: CliSubCommand[StackCommand] = Field(
        description="Run a local Prometheus and Alertmanager with the shipped alert rules against an aggregator.")
    stacks: CliSubCommand[StacksCommand] = Field(
        description="Every rank's training-thread stack now, grouped by identical stacks (needs the control token).")
    top: CliSubCommand[TopCommand] = Field(
        description="Watch a running aggregator live in the terminal: jobs, ranks, findings (pip install 'gradwatch[top]').")

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def _route(args: list[str]) -> tuple[list[str], type[BaseModel]]:
    """The subcommand names at the head of ``args`` and the model of the last one."""
    names: list[str] = []
    model: type[BaseModel] = Gradwatch
    for a in args:
        field = model.model_fields.get(a) if not a.startswith("-") else None
        sub = [t for t in typing.get_args(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)] if field else []
        if not sub:
            break
        names.append(a)
        model = sub[0]
    return names, model


def main(argv: list[str] | None = None) -> int:
    """``gradwatch SUBCOMMAND [FLAGS]``; returns the exit status (see the module docstring)."""
    args = sys.argv[1:] if argv is None else list(argv)
    names, model = _route(args)
    prog = " ".join(["gradwatch", *names])
    try:
        CliApp.run(Gradwatch, cli_args=args)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except ValidationError as e:
        loc = e.errors()[0]["loc"]
        skip = len(names) if tuple(loc[: len(names)]) == tuple(names) else 0
        env_prefix = model.model_config.get("env_prefix", "") if issubclass(model, BaseSettings) else ""
        given = {a[2:].split("=")[0].replace("-", "_") for a in args if a.startswith("--")}
        print(f"gradwatch: {describe(e, '.'.join(names) or 'gradwatch', env_prefix, given, skip=skip)}", file=sys.stderr)
        return 2
    except SettingsError as e:  # argparse: an unknown flag or subcommand, a missing value
        msg = str(e).removeprefix("error parsing CLI: ")
        if msg.startswith("Error: CLI subcommand is required"):
            print(msg, file=sys.stderr)  # with the usage: which subcommands there are
        else:
            print(f"{prog}: {msg} (see {prog} --help)", file=sys.stderr)
        return 2
    except CommandError as e:
        if str(e):
            print(f"{prog}: {e}", file=sys.stderr)
        return e.status
    except GradwatchError as e:  # ConfigError (a port in use), StackError, PushError, ...
        print(f"gradwatch: {e}" if isinstance(e, ConfigError) else f"{prog}: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
