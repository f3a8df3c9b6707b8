"""The shipped deployment files, as package data of ``gradwatch.deploy`` (no code): Prometheus
configuration, alert rules and their promtool tests, Alertmanager routes, Kubernetes manifests,
the systemd unit, RUNBOOK.md. ``gradwatch stack`` runs them; find them with
``importlib.resources.files("gradwatch.deploy")``."""
