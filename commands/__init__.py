"""gradwatch.commands: the programs that use both sides (installed from the top-level commands/).

:mod:`.cli` is the ``gradwatch`` command: one pydantic-settings model per subcommand
(``aggregator``, ``demo``, ``stack``, ``grafana generate``, ``grafana push``); :mod:`.demo` the
DDP demo job, :mod:`.stack` the local Prometheus and Alertmanager, :mod:`.catalog` the catalog
(docs/catalog.md). This room may import every other one; nothing but it (and grafana) imports it.
"""
