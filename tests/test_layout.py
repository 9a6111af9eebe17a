"""The rule the folders make visible, read from the imports: the method (clients/, strategies/)
imports neither fedmask_app, flwr nor ray, except strategies/masked_fedavg.py, the Flower strategy,
which may import flwr; flwr is imported only by fedmask_app/engines/flower/ and that module; ray
only by fedmask_app/engines/flower/ and the sweep's cluster runner."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = sorted(p for d in ("clients", "strategies", "fedmask_app") for p in (ROOT / d).rglob("*.py"))
FLOWER_STRATEGY = "strategies/masked_fedavg.py"
FLOWER_ENGINE = "fedmask_app/engines/flower/"
CLUSTER_RUNNER = "fedmask_app/sweep/cluster.py"


def imported_packages(path: Path) -> set[str]:
    """Top-level packages a module imports, anywhere in it (also inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def allowed(relative: str, package: str) -> bool:
    method = relative.startswith(("clients/", "strategies/"))
    if package == "fedmask_app":
        return not method
    if package == "flwr":
        return relative == FLOWER_STRATEGY or relative.startswith(FLOWER_ENGINE)
    if package == "ray":
        return relative.startswith(FLOWER_ENGINE) or relative == CLUSTER_RUNNER
    return True


def violations(files: list[Path]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)} imports {package}"
        for path in files
        for package in sorted(imported_packages(path))
        if not allowed(path.relative_to(ROOT).as_posix(), package)
    ]


def test_the_source_keeps_the_import_rule():
    assert SOURCE, "no source files found"
    assert violations(SOURCE) == []


@pytest.mark.parametrize(("where", "line", "package"), [
    ("clients/stray.py", "import flwr", "flwr"),
    ("clients/stray.py", "from fedmask_app.run.config import RunConfig", "fedmask_app"),
    ("strategies/stray.py", "from flwr.app import ArrayRecord", "flwr"),
    ("strategies/stray.py", "import ray", "ray"),
    ("fedmask_app/run/stray.py", "from flwr.serverapp import Grid", "flwr"),
    ("fedmask_app/engines/local.py", "def f():\n    import ray", "ray"),
])
def test_the_rule_fails_on_a_stray_import(tmp_path, monkeypatch, where, line, package):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    stray = tmp_path / where
    stray.parent.mkdir(parents=True)
    stray.write_text(line + "\n")
    assert violations([stray]) == [f"{where} imports {package}"]
