"""gradwatch: monitoring for distributed PyTorch training.

The package is in rooms that import in one direction only (tests/test_layout.py guards it):

* the foundation, this package's own modules: :mod:`gradwatch.wire` (the message format),
  :mod:`gradwatch.columns` (each statistic declared once), :mod:`gradwatch.settings` (settings
  errors), :mod:`gradwatch.errors` (the exception root), :mod:`gradwatch.auth` (CURVE keys);
  it imports nothing of the rooms below;
* :mod:`gradwatch.agent` (inside each rank, needs torch) and :mod:`gradwatch.aggregator` (the
  daemon, runs without torch): each imports the foundation only, never the other;
* :mod:`gradwatch.commands` (the ``gradwatch`` command, the demo, the local stack, the
  catalog in docs/catalog.md) and :mod:`gradwatch.grafana` (dashboards as code): they may import anything.
"""

from .errors import ConfigError, GradwatchError, Halt

__version__ = "0.1.0"

__all__ = ["ConfigError", "GradwatchError", "Halt", "__version__"]
