"""README stays true: its catalog matches the registries, and CI runs README's test command."""

from __future__ import annotations

import re

from gradwatch.commands import catalog

from .conftest import ROOT

README = (ROOT / "README.md").read_text()


def test_catalog_in_readme_matches_the_registries():
    expected = catalog.splice(README, catalog.render())
    assert README == expected, "README catalog drifted: run `python -m gradwatch.commands.catalog --write`"


def test_every_registered_metric_and_check_is_in_the_readme():
    from gradwatch.aggregator.checks import CHECKS
    from gradwatch.aggregator.exporter import METRICS

    for name in METRICS:
        assert f"`{name}" in README, name
    for name in CHECKS:
        assert f"`{name}`" in README, name


def test_ci_runs_the_test_command_that_readme_gives():
    commands = re.findall(r"^bash (scripts/\S+\.sh)\s+# the tests", README, re.M)
    assert commands == ["scripts/test.sh"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^bash scripts/test\.sh\b", ci, re.M), ".ci/run must call README's test command"
    assert (ROOT / "scripts" / "demo.sh").exists() and "gradwatch demo" in (ROOT / "scripts" / "demo.sh").read_text()


def test_readme_test_tiers_use_registered_markers():
    """The tier commands README gives select with markers pyproject registers (--strict-markers)."""
    import tomllib

    registered = {m.split(":")[0] for m in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]}
    tiers = re.findall(r'^bash scripts/test\.sh -m "?([^"#]+?)"?\s+#', README, re.M)
    assert 'not slow' in tiers and {"ddp", "stack", "wheel"} <= set(tiers), tiers
    for expr in tiers:
        assert set(re.findall(r"[a-z_]+", expr)) - {"not", "and", "or"} <= registered, expr
