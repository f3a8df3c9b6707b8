"""The wheel: built from this checkout and installed into a fresh virtual environment, without the
source tree on the path, it runs the ``gradwatch`` command and finds every shipped file.

The fresh environment reuses this one's installed dependencies through a ``.pth`` line (nothing is
downloaded; a ``.pth`` line adds a directory without running that directory's own ``.pth`` files,
so the editable install of this checkout stays out), and every check asserts that ``gradwatch``
was imported from the wheel.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.wheel

#: package data: shipped folder in the checkout -> (package, its folder there)
SHIPPED = {"deploy": ("gradwatch.deploy", ""), "grafana/dashboards": ("gradwatch.grafana", "dashboards"),
           "grafana/provisioning": ("gradwatch.grafana", "provisioning")}


def shipped_files() -> dict[str, tuple[str, str]]:
    """``{path in the checkout: (package, path inside it)}`` of every data file that must ship."""
    out = {}
    for folder, (package, inside) in SHIPPED.items():
        for p in sorted((ROOT / folder).rglob("*")):
            if p.is_file() and p.suffix not in (".py", ".pyc"):
                rel = p.relative_to(ROOT / folder).as_posix()
                out[f"{folder}/{rel}"] = (package, f"{inside}/{rel}" if inside else rel)
    return out


def run(cmd: list[str], cwd: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd}: {r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """``(python, gradwatch executable, env, workdir, wheel)`` of a fresh venv with the wheel installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    # build from a copy, so the checkout gets no build/ folder
    src = tmp / "src"
    anywhere = shutil.ignore_patterns(".git", ".venv", "*.egg-info", "__pycache__", ".pytest_cache")

    def ignore(folder: str, names: list[str]) -> set[str]:
        top = {"build", "dist", "bench", "tests"} if Path(folder) == ROOT else set()  # deploy/prometheus/tests ships
        return set(anywhere(folder, names)) | (top & set(names))

    shutil.copytree(ROOT, src, ignore=ignore)
    dist = tmp / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "--wheel-dir", str(dist), str(src)], tmp, env)
    (wheel,) = dist.glob("gradwatch-*.whl")

    target = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(target)], tmp, env)
    python = target / "bin" / "python"
    purelib = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp, env).stdout.strip())
    (purelib / "_gradwatch_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)], tmp, env)
    work = tmp / "work"  # cwd of every command: nowhere near the checkout
    work.mkdir()
    return python, target / "bin" / "gradwatch", env, work, wheel


def test_gradwatch_is_imported_from_the_wheel_not_the_checkout(venv):
    python, _, env, work, _ = venv
    out = run([str(python), "-c", "import gradwatch, gradwatch.commands, gradwatch.grafana, gradwatch.deploy, "
               "gradwatch.agent, gradwatch.aggregator; print(gradwatch.__file__, gradwatch.commands.__file__, "
               "gradwatch.deploy.__file__)"], work, env).stdout.split()
    root = python.parent.parent.resolve()
    for f in out:
        assert Path(f).resolve().is_relative_to(root), (f, root)
        assert not Path(f).resolve().is_relative_to(ROOT), f


def test_the_wheel_holds_every_shipped_file_and_no_test_data(venv):
    *_, wheel = venv
    names = set(zipfile.ZipFile(wheel).namelist())
    for path, (package, inside) in shipped_files().items():
        assert f"{package.replace('.', '/')}/{inside}" in names, path
    assert not [n for n in names if "vendor" in n or n.startswith("tests/")]


def test_installed_package_finds_every_shipped_file_through_importlib_resources(venv):
    python, _, env, work, _ = venv
    want = shipped_files()
    code = textwrap.dedent(f"""
        import hashlib, json
        from importlib.resources import files
        want = {json.dumps({k: list(v) for k, v in want.items()})}
        print(json.dumps({{k: hashlib.sha256((files(pkg) / inside).read_bytes()).hexdigest() for k, (pkg, inside) in want.items()}}))
    """)
    got = json.loads(run([str(python), "-c", code], work, env).stdout)
    assert got == {k: hashlib.sha256((ROOT / k).read_bytes()).hexdigest() for k in want}
    assert {"deploy/prometheus/prometheus.yml", "deploy/alertmanager/alertmanager.yml", "deploy/RUNBOOK.md",
            "deploy/systemd/gradwatch-aggregator.service", "grafana/dashboards/gradwatch-overview.json"} <= set(got)


def test_installed_command_answers_help_for_every_subcommand(venv):
    _, gradwatch, env, work, _ = venv
    top = run([str(gradwatch), "--help"], work, env).stdout
    for sub in ("aggregator", "demo", "grafana", "stack"):
        assert sub in top
    for args, flag in ((["stack"], "--aggregator-metrics"), (["aggregator"], "--metrics-port"), (["demo"], "--inject"),
                       (["grafana"], "push"), (["grafana", "push"], "--skip-datasource"), (["grafana", "generate"], "--check")):
        assert flag in run([str(gradwatch), *args, "--help"], work, env).stdout, args


def test_installed_stack_renders_the_shipped_configuration(venv):
    _, gradwatch, env, work, _ = venv
    out = work / "stack"
    run([str(gradwatch), "stack", "--render-only", "--workdir", str(out), "--aggregator-metrics", "127.0.0.1:9500"], work, env)
    assert "127.0.0.1:9500" in (out / "prometheus.yml").read_text()
    rendered = (out / "rules" / "gradwatch.rules.yml").read_text()
    assert "alert: AggregatorDown" in rendered and "alert: Watchdog" in rendered
    assert "receivers:" in (out / "alertmanager.yml").read_text()
    manifest = run([str(gradwatch), "stack", "--print-prometheusrule"], work, env).stdout
    assert manifest == (ROOT / "deploy" / "kubernetes" / "prometheusrule.yaml").read_text()


def test_installed_grafana_generate_finds_the_shipped_dashboards(venv):
    """``--check`` compares every generated file with the one installed: all found, none drifted."""
    _, gradwatch, env, work, _ = venv
    run([str(gradwatch), "grafana", "generate", "--check"], work, env)


def test_installed_aggregator_module_entry_point(venv):
    python, _, env, work, _ = venv
    assert "--listen" in run([str(python), "-m", "gradwatch.aggregator", "--help"], work, env).stdout
