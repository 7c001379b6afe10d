"""One clock (issue 34): no code of the converted packages reads the machine's time or sleeps but
through a clock (``dht/clock.py``), so a simulation that gives each peer a virtual clock controls
every wait, deadline, period and timestamp.

Converted so far: ``dht/``, ``swarm/`` and ``replication/``. ``peer/`` is not yet, and is not
checked here; it joins :data:`CHECKED` when it is done.
"""

from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path

from dht.clock import SYSTEM_CLOCK, SystemClock

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("dht", "swarm", "replication")
THE_CLOCK = ROOT / "dht" / "clock.py"
# module.function calls that read the machine's time or sleep on it
FORBIDDEN_CALLS = {("time", "monotonic"), ("time", "time"), ("time", "perf_counter"), ("time", "sleep"),
                   ("time", "monotonic_ns"), ("time", "time_ns"), ("time", "perf_counter_ns"), ("asyncio", "sleep")}
FORBIDDEN_NAMES = {"get_dht_time"}  # hivemind's wall clock under another name


def direct_time_uses(path: Path, *, root: Path = ROOT) -> list[str]:
    """Each place in ``path`` that reads the machine's time or sleeps without a clock, in line order."""
    tree = ast.parse(path.read_text())
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    found = []
    for node in ast.walk(tree):
        where = (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and (node.value.id, node.attr) in FORBIDDEN_CALLS:
            found.append((where, f"{node.value.id}.{node.attr}" + ("()" if id(node) in called else " (as a value)")))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "time" \
                and not node.args and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "time"):
            found.append((where, f"{ast.unparse(node.func)}()"))  # the event loop's: loop.time()
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "asyncio"):
            found += [(where, f"from {node.module} import {a.name}") for a in node.names
                      if (node.module, a.name) in FORBIDDEN_CALLS]
        elif isinstance(node, ast.alias) and node.name in FORBIDDEN_NAMES:
            found.append(((node.lineno, node.col_offset), f"import {node.name}"))
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            found.append((where, node.id))
    return [f"{path.relative_to(root)}:{line} {what}" for (line, _), what in sorted(found)]


def test_the_converted_packages_read_time_and_sleep_only_through_a_clock():
    found = [use for package in CHECKED for path in sorted((ROOT / package).rglob("*.py")) if path != THE_CLOCK
             for use in direct_time_uses(path)]
    assert not found, "read the time and sleep through the clock you are given (dht/clock.py):\n" + "\n".join(found)


def test_the_check_finds_each_way_of_reading_the_time(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text("import asyncio, time\nfrom time import monotonic\nfrom hivemind.utils import get_dht_time\n"
                      "async def f(loop, clock):\n    a = time.monotonic()\n    await asyncio.sleep(1)\n"
                      "    b = loop.time()\n    c = get_dht_time()\n    d = time.monotonic\n"
                      "    await clock.sleep(1)\n    return a, b, c, d, clock(), clock.dht_time(), time.strftime('%H')\n")
    assert [use.split(" ", 1)[1] for use in direct_time_uses(source, root=tmp_path)] == [
        "from time import monotonic", "import get_dht_time", "time.monotonic()", "asyncio.sleep()", "loop.time()",
        "get_dht_time", "time.monotonic (as a value)"]


def test_the_system_clock_reads_the_machines_clocks_and_sleeps():
    assert isinstance(SYSTEM_CLOCK, SystemClock)
    before = time.monotonic()
    assert before <= SYSTEM_CLOCK() <= SYSTEM_CLOCK.now() <= time.monotonic()
    assert abs(SYSTEM_CLOCK.dht_time() - time.time()) < 5
    started = time.monotonic()
    asyncio.run(SYSTEM_CLOCK.sleep(0.01))
    assert time.monotonic() - started >= 0.009
    asyncio.run(SYSTEM_CLOCK.sleep(-1))  # a negative wait is a yield, not an error
