"""gradwatch aggregator: one daemon per job or cluster; runs without torch.

Errors: :class:`ConfigError` at start-up for an invalid setting, an endpoint that cannot be bound
or a port in use (the message names the setting). Bad input from peers never raises: it is counted
by reason in ``gradwatch_messages_rejected_total`` and dropped.
"""

from .config import AggregatorConfig, ConfigError, load
from .daemon import Aggregator

__all__ = ["Aggregator", "AggregatorConfig", "ConfigError", "load", "main"]


def main(argv=None) -> int:
    """``gradwatch aggregator`` / ``python -m gradwatch.aggregator``: parse flags, serve until SIGTERM."""
    import logging
    import sys

    from pydantic import ValidationError
    from pydantic_settings import CliApp

    from .config import format_error, warn_unknown_variables

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        warn_unknown_variables()
        cfg = CliApp.run(AggregatorConfig, cli_args=args)
        Aggregator(cfg).serve_forever()
    except ValidationError as e:
        print(f"gradwatch: {format_error(e)}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"gradwatch: {e}", file=sys.stderr)
        return 2
    return 0
