"""DESIGN §2: the one-way import rule between our packages, a pure planner, and no import cycle.

The rule is checked on source (``ast``), so an import inside a function or under
``if TYPE_CHECKING:`` counts as much as one at the top of a module: both tie the two modules
together for a reader, and a cycle hidden behind either is still a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.parsing import no_collection_while_parsing  # noqa: F401 (autouse here)

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
OFFLINE_PLANNER = "planner.offline"
VIEWS = "peer.status"  # the volunteer-facing windows: they read snapshots and records, never the peer's core
VIEWS_MAY_IMPORT = {"peer.errors"}  # of peer/ outside peer.status
HARNESS = "peer.harness"  # local swarms for the demo, bench/ and the tests; a running peer never loads it  # evaluated by bench/ and the tests only; the live peer never imports it
SCRIPT_DIRS = ("bench", "scripts")  # folders of scripts (run as files, not imported as packages)
NOT_SOURCE = ("tests",)  # top-level folders with Python files that are neither packages nor scripts


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def package_files(package: str) -> list[Path]:
    """Every module of ``package``, its sub-packages' included."""
    return sorted((ROOT / package).rglob("*.py"))


def live_peer_files() -> list[Path]:
    """What a running peer may load: our packages (less the offline planners) and the entry scripts."""
    files = [p for package in PACKAGES for p in package_files(package)]
    offline = ROOT / Path(*OFFLINE_PLANNER.split("."))
    return [p for p in files if offline not in p.parents] + sorted(ROOT.glob("run_*.py"))


# --- the module graph of the whole repository ---------------------------------------------------

def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def repository_modules() -> dict[str, Path]:
    """Module name -> file, for every Python file of ours (packages, entry scripts, bench/, tests/)."""
    files = sorted(ROOT.glob("*.py"))
    for folder in (*PACKAGES, *SCRIPT_DIRS, *NOT_SOURCE):
        files += sorted((ROOT / folder).rglob("*.py"))
    return {module_name(p): p for p in files}


def import_targets(node: ast.Import | ast.ImportFrom, *, module: str, is_package: bool) -> list[str]:
    """The names ``node`` may load: ``a.b`` for ``import a.b``; ``a`` and ``a.x`` for ``from a import x``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against this module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere in its source."""
    graph = {}
    for module, path in modules.items():
        script_dir = module.rsplit(".", 1)[0] if path.parent.name in SCRIPT_DIRS else None
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in import_targets(node, module=module, is_package=path.name == "__init__.py"):
                if target not in modules and script_dir is not None:
                    target = f"{script_dir}.{target}"  # a bench script importing its sibling
                if target in modules and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            step = next(stack[-1], None)
            if step is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(step) == 1:
                return path[path.index(step):] + [step]
            elif step not in state:
                state[step] = 1
                path.append(step)
                stack.append(iter(sorted(graph[step])))
    return None


def reachable(graph: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


# --- the rule -------------------------------------------------------------------------------------

def test_every_package_is_covered():
    """A new top-level package must be added to PACKAGES and ALLOWED, or this test fails."""
    folders = {p.parent.name for p in ROOT.glob("*/*.py") if not p.parent.name.startswith(".")}
    assert folders - set(SCRIPT_DIRS) - set(NOT_SOURCE) == set(PACKAGES), "add the package to PACKAGES and ALLOWED"
    assert set(ALLOWED) == set(PACKAGES)
    for package in PACKAGES:  # a sub-package without __init__.py would be a namespace package nobody checks
        for folder in {p.parent for p in package_files(package)}:
            assert (folder / "__init__.py").exists(), f"{folder.relative_to(ROOT)} has no __init__.py"


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_what_design_allows(package):
    for path in package_files(package):
        ours = {name.split(".")[0] for name in imported_modules(path)} & set(PACKAGES)
        assert ours - {package} <= ALLOWED[package], f"{path.relative_to(ROOT)} imports {sorted(ours - {package})}"


def test_live_peer_never_imports_the_offline_planners():
    modules = repository_modules()
    graph = import_graph(modules)
    for path in live_peer_files():
        offline = sorted(m for m in graph[module_name(path)] if m == OFFLINE_PLANNER or m.startswith(OFFLINE_PLANNER + "."))
        assert not offline, f"{path.relative_to(ROOT)} imports {offline}: the live peer runs planner/ only"


def test_every_module_of_planner_is_one_the_live_peer_runs():
    """``planner/`` holds what the peer runs; an offline-only planner belongs in ``planner/offline/``."""
    modules = repository_modules()
    graph = import_graph(modules)
    runs = reachable(graph, [module_name(p) for p in live_peer_files() if p.parts[-2] != "planner"])
    live = {module_name(p) for p in (ROOT / "planner").glob("*.py") if p.stem != "__init__"}
    assert live - runs == set(), f"the live peer imports none of {sorted(live - runs)}: move them to planner/offline/"


def test_planner_docstrings_name_their_modules():
    """``planner/__init__.py`` lists what the live peer runs, ``planner/offline/__init__.py`` the rest."""
    for folder in (ROOT / "planner", ROOT / "planner" / "offline"):
        docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        missing = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__" and f"``{p.stem}``" not in docstring)
        assert not missing, f"{folder.relative_to(ROOT)}/__init__.py does not name {missing}"


def test_the_views_never_import_the_peers_core():
    """``peer.status`` (page, terminal, /metrics, status protocol, report) reads a ``PeerSnapshot`` and
    the DHT records; the core imports it, never the other way round."""
    modules = repository_modules()
    graph = import_graph(modules)
    for module in (m for m in modules if m == VIEWS or m.startswith(VIEWS + ".")):
        core = sorted(m for m in graph[module] if m.split(".")[0] == "peer" and m != "peer"
                      and not (m == VIEWS or m.startswith(VIEWS + ".")) and m not in VIEWS_MAY_IMPORT)
        assert not core, f"{module} imports the peer's core: {core}"


def test_the_runtime_never_imports_the_local_swarm_harness():
    modules = repository_modules()
    graph = import_graph(modules)
    for path in live_peer_files():
        module = module_name(path)
        if module == HARNESS or module.startswith(HARNESS + "."):
            continue
        harness = sorted(m for m in graph[module] if m == HARNESS or m.startswith(HARNESS + "."))
        assert not harness, f"{module} imports {harness}: the harness is for demos, benchmarks and tests"


def test_no_import_cycle_between_modules():
    cycle = find_cycle(import_graph(repository_modules()))
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_planner_source_imports_no_clock_rng_network_or_frameworks():
    for path in package_files("planner"):
        roots = {name.split(".")[0] for name in imported_modules(path)}
        assert not roots & PLANNER_FORBIDDEN, f"{path.name} imports {sorted(roots & PLANNER_FORBIDDEN)}"


def test_importing_planner_loads_neither_torch_nor_hivemind():
    modules = sorted(module_name(p).removeprefix("planner.") for p in package_files("planner") if p.stem != "__init__")
    code = (f"import sys, importlib\nfor m in {modules!r}: importlib.import_module('planner.' + m)\n"
            "print(sorted({'torch', 'hivemind', 'asyncio'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
