"""The shape of the package: data flows one way, and each room imports only what it must.

    agent (in the rank, torch)  ->  gradwatch.wire (bytes)  ->  aggregator (daemon, no torch)

Rooms (top-level folders, each installed under ``gradwatch``) and what each may import:

    foundation  gradwatch/   wire, columns, settings, errors, auth  -> nothing of the other rooms
    agent       agent/       in every rank                -> the foundation
    aggregator  aggregator/  the daemon                   -> the foundation
    integrations integrations/ Trainer, Lightning, accelerate -> the foundation, the agent
    commands    commands/    gradwatch CLI, demo, stack   -> anything
    grafana     grafana/     dashboards as code, push     -> anything

Checked statically with ``ast`` over the source files (imports inside functions, the lazy ones,
included), then dynamically in fresh interpreters. Also pins the public surface (``__all__``) of
both sides and the exception tree.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
AGENT, AGGREGATOR, WIRE = ROOT / "agent", ROOT / "aggregator", ROOT / "gradwatch" / "wire.py"
FOUNDATION, COMMANDS, GRAFANA = ROOT / "gradwatch", ROOT / "commands", ROOT / "grafana"
INTEGRATIONS = ROOT / "integrations"
# room -> (folder, the rooms it may import besides itself)
ROOMS = {
    "foundation": (FOUNDATION, ()),
    "agent": (AGENT, ("foundation",)),
    "aggregator": (AGGREGATOR, ("foundation",)),
    "integrations": (INTEGRATIONS, ("foundation", "agent")),
    "commands": (COMMANDS, ("foundation", "agent", "aggregator", "grafana")),
    "grafana": (GRAFANA, ("foundation", "agent", "aggregator", "commands")),
}
TOP_LEVEL_FOLDERS = ("agent", "aggregator", "commands", "grafana", "deploy", "integrations")


def imports(source: str, package: str) -> set[str]:
    """Absolute names of every module ``source`` imports, anywhere in it.

    ``package`` resolves relative imports (the package the file belongs to). ``from a import b``
    yields both ``a`` and ``a.b`` since ``b`` may be a submodule; ``importlib.import_module("x")``
    and ``__import__("x")`` with a literal name count too.
    """
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.add(node.args[0].value)
    return out


def source_imports(folder: Path, package: str) -> dict[str, set[str]]:
    """``{path relative to folder: imports}`` of every source file under ``folder``, subpackages
    included; ``package`` is the dotted name ``folder`` installs as."""
    files = sorted(folder.rglob("*.py"))
    assert files, f"no sources under {folder}"
    out = {}
    for f in files:
        rel = f.relative_to(folder)
        pkg = ".".join([package, *rel.parent.parts])
        out[str(rel)] = imports(f.read_text(), pkg)
    return out


def offenders(found: dict[str, set[str]], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for name, mods in found.items():
        hit = sorted(m for m in mods if any(m == f or m.startswith(f + ".") for f in forbidden))
        if hit:
            bad[name] = hit
    return bad


def room_of(module: str) -> str | None:
    """The room a ``gradwatch...`` module belongs to (None for other modules): ``gradwatch.X`` with X
    a room's name is that room, every other ``gradwatch`` module the foundation."""
    parts = module.split(".")
    if parts[0] != "gradwatch":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else "foundation"


def room_offenders(room: str) -> dict[str, list[str]]:
    """``{file: [imports it may not make]}`` for every source file of ``room``."""
    folder, allowed = ROOMS[room]
    package = "gradwatch" if room == "foundation" else f"gradwatch.{room}"
    bad = {}
    for name, mods in source_imports(folder, package).items():
        hit = sorted(m for m in mods if room_of(m) not in (None, room, *allowed) or m.split(".")[0] in TOP_LEVEL_FOLDERS)
        if hit:
            bad[name] = hit
    return bad


def test_import_finder_sees_relative_nested_and_dynamic_imports():
    src = textwrap.dedent(
        """
        import os.path
        from .. import aggregator
        def later():
            from ..aggregator.state import State
            import importlib
            importlib.import_module("torch.nn")
        """
    )
    found = imports(src, "gradwatch.agent")
    assert {"os.path", "gradwatch", "gradwatch.aggregator", "gradwatch.aggregator.state", "torch.nn"} <= found
    assert offenders({"x.py": found}, ("gradwatch.aggregator",)) == {"x.py": ["gradwatch.aggregator", "gradwatch.aggregator.state", "gradwatch.aggregator.state.State"]}
    assert offenders({"x.py": found}, ("torch",)) == {"x.py": ["torch.nn"]}
    assert offenders({"x.py": {"torchvision"}}, ("torch",)) == {}


def test_source_walk_covers_subpackages():
    found = source_imports(AGGREGATOR, "gradwatch.aggregator")
    subdirs = {str(p.parent.relative_to(AGGREGATOR)) for p in AGGREGATOR.rglob("*.py")} - {"."}
    assert {str(Path(n).parent) for n in found if "/" in n} == subdirs
    # relative imports in a subpackage resolve against the subpackage
    assert imports("from .. import state\nfrom . import x", "gradwatch.aggregator.checks") >= {
        "gradwatch.aggregator.state", "gradwatch.aggregator.checks.x",
    }


def test_room_finder_sorts_modules_into_rooms():
    assert [room_of(m) for m in ("gradwatch", "gradwatch.wire.Report", "gradwatch.__version__", "gradwatch.agent.config",
                                 "gradwatch.commands.cli", "gradwatch.grafana", "numpy")] == [
        "foundation", "foundation", "foundation", "agent", "commands", "grafana", None]


@pytest.mark.parametrize("room", list(ROOMS))
def test_each_room_imports_only_the_rooms_below_it(room):
    """Foundation -> nothing; agent, aggregator -> the foundation; commands, grafana -> anything.
    Lazy imports (inside functions) count: they are arrows too."""
    assert room_offenders(room) == {}


def test_the_room_check_sees_a_lazy_import_upwards():
    """A function-level import of a command from the foundation is caught like a top-level one."""
    found = {"wire.py": imports("def f():\n    from .commands import cli\n", "gradwatch")}
    assert sorted(m for m in found["wire.py"] if room_of(m) == "commands") == ["gradwatch.commands", "gradwatch.commands.cli"]


def test_foundation_holds_only_what_both_sides_share():
    # the wire format, the table of columns, settings, errors and key material: nothing that runs a command
    assert sorted(p.name for p in FOUNDATION.glob("*.py")) == ["__init__.py", "auth.py", "columns.py", "errors.py", "settings.py", "wire.py"]
    assert not [p for p in FOUNDATION.iterdir() if p.is_dir() and p.name != "__pycache__"]


def test_agent_never_imports_the_aggregator():
    assert offenders(source_imports(AGENT, "gradwatch.agent"), ("gradwatch.aggregator", "aggregator")) == {}


def test_aggregator_never_imports_the_agent_or_torch():
    found = source_imports(AGGREGATOR, "gradwatch.aggregator")
    assert offenders(found, ("gradwatch.agent", "agent", "torch", "gradwatch.commands")) == {}


def test_wire_imports_neither_torch_nor_prometheus():
    found = {"wire.py": imports(WIRE.read_text(), "gradwatch")}
    assert offenders(found, ("torch", "prometheus_client", "zmq", "gradwatch.agent", "gradwatch.aggregator")) == {}


def test_bench_imports_nothing_from_the_tests():
    """The benchmarks run on machines without the test suite (the lent GPU machine): what they
    share with the tests lives in bench/ or in the package, and the tests import it from there."""
    assert offenders(source_imports(ROOT / "bench", "bench"), ("tests",)) == {}


def test_agent_serves_no_http_C38():
    """C38: ranks never open HTTP ports; only the aggregator serves /metrics."""
    found = source_imports(AGENT, "gradwatch.agent")
    assert offenders(found, ("prometheus_client", "http.server", "wsgiref", "socketserver", "aiohttp")) == {}


def test_only_the_wire_module_touches_msgpack():
    """One module owns the wire format: no other module builds or parses message bytes."""
    for folder, package in ((AGENT, "gradwatch.agent"), (AGGREGATOR, "gradwatch.aggregator")):
        assert offenders(source_imports(folder, package), ("msgpack",)) == {}, package


def fresh(code: str) -> str:
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_importing_the_aggregator_leaves_torch_out_of_sys_modules():
    """Nor does the gradwatch command: ``gradwatch aggregator`` runs where torch is not installed."""
    out = fresh(
        """
        import importlib, pkgutil, sys
        import gradwatch.aggregator, gradwatch.commands.cli, gradwatch.wire
        for m in pkgutil.walk_packages(gradwatch.aggregator.__path__, "gradwatch.aggregator."):
            if not m.name.endswith("__main__"):
                importlib.import_module(m.name)
        assert "gradwatch.aggregator.daemon" in sys.modules
        # (the demo's fault specs, gradwatch.commands.demo.inject, may come: --help lists their
        # kinds, and the module takes torch only inside the methods that apply a fault)
        print(sorted(n for n in sys.modules if n.split(".")[0] == "torch" or n.startswith(
            ("gradwatch.agent", "gradwatch.commands.demo.model"))))
        """
    )
    assert out == "[]"


@pytest.mark.parametrize("room", ["foundation", "agent", "aggregator"])
def test_importing_every_module_of_a_room_loads_no_room_it_may_not_import(room):
    """The dynamic twin of the static check: in a fresh interpreter, import every module of the
    room, then no module of a room it may not import is loaded."""
    folder, allowed = ROOMS[room]
    package = "gradwatch" if room == "foundation" else f"gradwatch.{room}"
    forbidden = sorted(set(ROOMS) - {room, *allowed})
    out = fresh(
        f"""
        import importlib, pkgutil, sys
        pkg = importlib.import_module({package!r})
        names = [m.name for m in pkgutil.walk_packages(pkg.__path__, {package!r} + ".")
                 if not m.name.endswith("__main__")]
        if {room!r} == "foundation":  # the foundation's own modules, not the rooms installed inside it
            names = [n for n in names if n.split(".")[1] not in {tuple(ROOMS)!r}]
        for n in names:
            importlib.import_module(n)
        print(sorted(n for n in sys.modules if n.split(".")[0] == "gradwatch" and len(n.split(".")) > 1
                     and n.split(".")[1] in {tuple(forbidden)!r}))
        """
    )
    assert out == "[]"


def test_importing_the_wire_module_pulls_in_neither_torch_nor_prometheus():
    out = fresh(
        """
        import sys
        import gradwatch.wire
        print(sorted({n.split(".")[0] for n in sys.modules} & {"torch", "prometheus_client", "zmq"}))
        """
    )
    assert out == "[]"


@pytest.mark.parametrize("pkg, names", [
    ("agent", ["attach", "AgentConfig", "ConfigError", "Halt", "Monitor", "NullMonitor"]),
    ("aggregator", ["Aggregator", "AggregatorConfig", "ConfigError", "load", "main"]),
], ids=["agent", "aggregator"])
def test_public_surface_is_pinned(pkg, names):
    import importlib

    mod = importlib.import_module(f"gradwatch.{pkg}")
    assert sorted(mod.__all__) == sorted(names)
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name


@pytest.mark.parametrize("pkg", ["agent", "aggregator"])
def test_both_sides_report_config_errors_as_value_errors(pkg):
    import importlib

    mod = importlib.import_module(f"gradwatch.{pkg}")
    assert issubclass(mod.ConfigError, ValueError)


def test_one_exception_root():
    """One ConfigError for both sides, and every error gradwatch raises on purpose under
    ``gradwatch.GradwatchError``; config and wire errors stay ValueErrors."""
    import gradwatch
    import gradwatch.agent
    import gradwatch.aggregator
    from gradwatch.commands.errors import CommandError, UsageError
    from gradwatch.commands.stack import StackError
    from gradwatch.grafana.push import PushError
    from gradwatch.wire import WireError

    assert gradwatch.agent.ConfigError is gradwatch.aggregator.ConfigError is gradwatch.ConfigError
    for err in (gradwatch.ConfigError, WireError):
        assert issubclass(err, gradwatch.GradwatchError) and issubclass(err, ValueError), err
    for err in (CommandError, UsageError, StackError, PushError):
        assert issubclass(err, gradwatch.GradwatchError), err


def test_every_package_folder_is_listed_in_pyproject():
    """A subpackage missing from pyproject's explicit list is absent from a wheel (non-editable
    installs would fail to import it)."""
    import tomllib

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    found = set()
    for name, folder in conf["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found <= listed, f"not in pyproject packages: {sorted(found - listed)}"


# --- no import circle inside the aggregator --------------------------------------------------------


def module_edges(source: str, package: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``source`` (a module of ``package``) imports, anywhere in it
    (imports inside functions, the lazy ones, included): ``from X import y`` imports ``X.y`` when
    that is a module of ``known``, else ``X``; ``import X.y`` imports ``X.y``; a literal
    ``importlib.import_module`` too."""
    out: set[str] = set()

    def add(name: str) -> None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            out.add(name)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                mod = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                add(node.args[0].value)
    return out


def import_graph(folder: Path, package: str) -> dict[str, set[str]]:
    """``{module: the modules of the same package it imports}`` for every source file under ``folder``
    (subpackages included; a package is its ``__init__``), ``package`` its dotted name."""
    files = {}
    for f in sorted(folder.rglob("*.py")):
        rel = f.relative_to(folder).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        files[".".join([package, *parts])] = (f, ".".join([package, *rel.parts[:-1]]))
    known = set(files)
    return {m: module_edges(f.read_text(), pkg, known) - {m} for m, (f, pkg) in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other, directly or through others (the strongly
    connected components of more than one module, Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_circle_finder_sees_a_lazy_circle_and_resolves_submodules(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from . import b\nA = 1\n")
    (pkg / "b.py").write_text("def later():\n    from .c import C\n")
    (pkg / "c.py").write_text("import pkg.a\nfrom .sub import x\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "x.py").write_text("from .. import b\n")
    graph = import_graph(pkg, "pkg")
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a", "pkg.sub.x"},
                     "pkg.sub": set(), "pkg.sub.x": {"pkg.b"}}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.sub.x"]]
    assert circles({"x": {"y"}, "y": set()}) == []


def test_no_import_circle_inside_the_aggregator():
    """Every module of the aggregator (its checks included) imports only modules that do not
    import it back, directly or through others, lazily or not: each room can be read, tested and
    changed without the rest of the circle."""
    assert circles(import_graph(AGGREGATOR, "gradwatch.aggregator")) == []
