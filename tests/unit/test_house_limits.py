"""The house stays readable: no module of ours over 500 lines, no function over 60 outside tests,
and the peer's composition root (``peer/lifecycle.py``) at most 400 lines (issue "A house a newcomer
can live in"). Counted on the source files, so a change that breaks a limit fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.parsing import no_collection_while_parsing  # noqa: F401 (autouse here)

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("planner", "dht", "swarm", "replication", "peer", "bench", "scripts")
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_LIFECYCLE_LINES = 500, 60, 400


def our_sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")) + sorted(ROOT.glob("run_*.py"))


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in ``source`` longer than ``limit`` lines."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def test_the_sources_are_found():
    files = our_sources()
    assert ROOT / "peer" / "lifecycle.py" in files and ROOT / "run_peer.py" in files and len(files) > 50


def test_no_module_over_500_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in our_sources()}
    assert not {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES}


def test_no_function_over_60_lines():
    found = {str(p.relative_to(ROOT)): long_functions(p.read_text(), MAX_FUNCTION_LINES) for p in our_sources()}
    assert not {p: f for p, f in found.items() if f}


def test_the_peers_composition_root_stays_short():
    assert len((ROOT / "peer" / "lifecycle.py").read_text().splitlines()) <= MAX_LIFECYCLE_LINES


def test_a_long_function_is_caught():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n", MAX_FUNCTION_LINES) == [("f", MAX_FUNCTION_LINES + 1)]
    assert long_functions(f"async def g():\n{body[: body.rfind(chr(10))]}\n", MAX_FUNCTION_LINES) == []
