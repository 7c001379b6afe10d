"""DESIGN §2: the one-way import rule between our packages, and a pure planner."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("planner", "dht", "swarm", "replication", "peer")
ALLOWED = {  # package -> our packages it may import
    "planner": set(),
    "dht": {"planner"},
    "swarm": {"dht", "planner"},
    "replication": {"dht", "planner"},
    "peer": {"planner", "dht", "swarm", "replication"},
}
PLANNER_FORBIDDEN = {"torch", "hivemind", "asyncio", "socket", "time", "threading", "random", "libp2p"}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_what_design_allows(package):
    for path in sorted((ROOT / package).glob("*.py")):
        ours = {name.split(".")[0] for name in imported_modules(path)} & set(PACKAGES)
        assert ours - {package} <= ALLOWED[package], f"{path.relative_to(ROOT)} imports {sorted(ours - {package})}"


def test_planner_source_imports_no_clock_rng_network_or_frameworks():
    for path in sorted((ROOT / "planner").glob("*.py")):
        roots = {name.split(".")[0] for name in imported_modules(path)}
        assert not roots & PLANNER_FORBIDDEN, f"{path.name} imports {sorted(roots & PLANNER_FORBIDDEN)}"


def test_importing_planner_loads_neither_torch_nor_hivemind():
    modules = sorted(p.stem for p in (ROOT / "planner").glob("*.py") if p.stem != "__init__")
    code = (f"import sys, importlib\nfor m in {modules!r}: importlib.import_module('planner.' + m)\n"
            "print(sorted({'torch', 'hivemind', 'asyncio'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
