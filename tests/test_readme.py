"""README and docs/ stay true: the catalog (docs/catalog.md) matches the registries, CI runs README's
test command, README stays short, and every relative link in the project's Markdown (README, docs/,
bench/, deploy/) reaches an existing file and, with a #fragment, an existing heading of it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gradwatch.commands import catalog

from .conftest import ROOT

README = (ROOT / "README.md").read_text()
CATALOG = ROOT / "docs" / "catalog.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
#: every Markdown file of the project whose links must resolve (tests/vendor is third-party)
MARKDOWN = [ROOT / "README.md", *DOCS, ROOT / "bench" / "README.md", *sorted((ROOT / "deploy").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`]*`")


def prose_lines(text: str):
    """``(line number, line)`` of each line outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def anchors(text: str) -> set[str]:
    """The fragment ids GitHub gives a Markdown file's ATX headings: the heading's text (a link's
    text, not its target) lower-cased, every character but letters, digits, ``_``, ``-`` and spaces
    removed, spaces made hyphens; a repeated id gets ``-1``, ``-2`` ... in order."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(path: Path):
    """``(line number, target)`` of each inline link in ``path`` that is not a URL with a scheme."""
    for n, line in prose_lines(path.read_text()):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                yield n, target


def test_slugs_follow_githubs_rules():
    text = "# gradwatch\n## `load.py`: the aggregator at fleet scale\n```sh\n# not a heading\n```\n" \
           "## The NaN guard's cost\n### Figures\n### Figures\n## Attach: Hugging Face Trainer, `L.Trainer`\n"
    assert anchors(text) == {"gradwatch", "loadpy-the-aggregator-at-fleet-scale", "the-nan-guards-cost",
                             "figures", "figures-1", "attach-hugging-face-trainer-ltrainer"}


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    broken = []
    for n, target in relative_links(path):
        file, _, fragment = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.is_relative_to(ROOT) or not dest.exists():
            broken.append(f"{path.name}:{n}: {target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
            broken.append(f"{path.name}:{n}: {target} (no heading #{fragment} in {dest.relative_to(ROOT)})")
    assert not broken, "\n".join(broken)


def test_link_check_finds_a_broken_anchor(tmp_path):
    """The check above can fail: a link to a missing heading or file is reported."""
    (tmp_path / "a.md").write_text("# A\n## Real section\n[ok](#real-section) [bad](#gone) [f](b.md#x) [g](c.md)\n")
    (tmp_path / "b.md").write_text("# B\n")
    found = [t for _, t in relative_links(tmp_path / "a.md")]
    assert found == ["#real-section", "#gone", "b.md#x", "c.md"]
    assert "real-section" in anchors((tmp_path / "a.md").read_text())
    assert "gone" not in anchors((tmp_path / "a.md").read_text()) and "x" not in anchors("# B\n")


MENTION = re.compile(r"docs/(\w+\.md): ([A-Za-z][\w'. -]*[\w'])")


def stale_mentions(text: str, titles: dict[str, set[str]]) -> list[str]:
    """Each ``docs/<name>.md: Section`` in ``text`` whose file is not in ``titles`` (file name -> its
    headings, lower-case) or has no such heading, as ``"docs/<name>.md: Section"``."""
    return [f"docs/{name}: {section}" for name, section in MENTION.findall(text)
            if section.lower() not in titles.get(name, ())]


def headings(text: str) -> set[str]:
    """A Markdown file's heading titles, lower-case, without code and emphasis marks."""
    return {re.sub(r"[`*]", "", m).strip().lower() for _, line in prose_lines(text)
            for m in re.findall(r"^#{1,6}\s+(.*)$", line)}


def test_code_mentions_of_docs_sections_name_existing_headings():
    """A comment or help string saying ``docs/<name>.md: Section`` names a heading that file has."""
    titles = {p.name: headings(p.read_text()) for p in DOCS}
    rooms = ["agent", "aggregator", "gradwatch", "integrations", "commands", "grafana", "deploy", "bench", "tests",
             "scripts", "examples", "docs"]
    sources = [p for room in rooms if (ROOT / room).is_dir() for p in (ROOT / room).rglob("*") if p.is_file()]
    bad = []
    for src in sources + [ROOT / "README.md", ROOT / "pyproject.toml"]:
        if src.suffix not in {".py", ".yml", ".yaml", ".sbatch", ".service", ".md", ".toml", ".sh", ".json"} \
                or {"vendor", "results", "__pycache__"} & set(src.relative_to(ROOT).parts):
            continue
        bad += [f"{src.relative_to(ROOT)}: {m}" for m in stale_mentions(src.read_text(errors="replace"), titles)]
    assert not bad, "\n".join(bad)


def test_a_mention_of_a_missing_section_is_found():
    titles = {"operations.md": headings("# Operations\n## Cardinality budget\n```\n# Scale\n```\n")}
    text = ("# (docs/operations.md: Cardinality budget) (docs/operations.md: Scale)\n"
            "see docs/agent.md: torch.compile.\n")
    assert stale_mentions(text, titles) == ["docs/operations.md: Scale", "docs/agent.md: torch.compile"]


def test_each_docs_file_opens_with_a_title_and_a_summary_paragraph():
    assert {p.name for p in DOCS} >= {"agent.md", "operations.md", "security.md", "architecture.md",
                                      "protocol.md", "catalog.md", "detection.md"}
    for p in DOCS:
        blocks = p.read_text().split("\n\n")
        assert blocks[0].startswith("# ") and "\n" not in blocks[0].strip(), p.name
        summary = blocks[1].strip()
        assert summary and summary[0] not in "#|-*`<>" and len(summary.split()) >= 25, (p.name, summary[:80])


def test_readme_reads_in_five_minutes():
    assert len(README.splitlines()) <= 300, len(README.splitlines())
    for doc in ("docs/agent.md", "docs/operations.md", "docs/security.md", "docs/architecture.md",
                "docs/protocol.md", "docs/catalog.md", "docs/detection.md", "bench/README.md"):
        assert f"]({doc}" in README, f"README links {doc}"


def test_catalog_matches_the_registries():
    text = CATALOG.read_text()
    expected = catalog.splice(text, catalog.render())
    assert text == expected, "docs/catalog.md drifted: run `python -m gradwatch.commands.catalog --write`"


def test_splice_needs_both_markers():
    with pytest.raises(ValueError, match="markers"):
        catalog.splice("# no markers here\n", catalog.render())
    with pytest.raises(ValueError, match="markers"):
        catalog.splice(catalog.BEGIN + "\n", "x")


def test_every_registered_metric_and_check_is_in_the_catalog():
    from gradwatch.aggregator.checks import CHECKS
    from gradwatch.aggregator.exporter import METRICS

    text = CATALOG.read_text()
    for name in METRICS:
        assert f"`{name}" in text, name
    for name in CHECKS:
        assert f"`{name}`" in text, name


def test_ci_runs_the_test_command_that_readme_gives():
    commands = re.findall(r"^bash (scripts/\S+\.sh)\s+# the tests", README, re.M)
    assert commands == ["scripts/test.sh"]
    assert re.search(r"^bash scripts/demo\.sh\s+# the main job", README, re.M), "README gives the demo's set-up command"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^bash scripts/test\.sh\b", ci, re.M), ".ci/run must call README's test command"
    assert (ROOT / "scripts" / "demo.sh").exists() and "gradwatch demo" in (ROOT / "scripts" / "demo.sh").read_text()


def test_readme_test_tiers_use_registered_markers():
    """The tier commands README gives select with markers pyproject registers (--strict-markers)."""
    import tomllib

    registered = {m.split(":")[0] for m in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]}
    tiers = re.findall(r'^bash scripts/test\.sh (?:-n \d+ )?-m "?([^"#]+?)"?\s+#', README, re.M)
    assert 'not slow' in tiers and {"ddp", "stack", "wheel"} <= set(tiers), tiers
    for expr in tiers:
        assert set(re.findall(r"[a-z_]+", expr)) - {"not", "and", "or"} <= registered, expr
