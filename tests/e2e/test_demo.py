"""The README's first command: the demo swarm starts, trains, reports a falling loss, and cleans up."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from peer.harness.local_swarm import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_demo_trains_and_loss_falls(tmp_path):
    result = subprocess.run([sys.executable, "-m", "peer.harness.demo", "--duration", "30", "--workdir", str(tmp_path)],
                            capture_output=True, text=True, timeout=280, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"stage 0: 2 peers, stage 1: 2 peers", result.stdout), result.stdout + join_lines(tmp_path)
    match = re.search(r"initial loss ([\d.]+) → final loss ([\d.]+)", result.stdout)
    assert match, result.stdout
    initial, final = map(float, match.groups())
    assert final < initial - 0.5
    assert sorted(p.name for p in tmp_path.glob("peer*.jsonl")) == [f"peer{i}.jsonl" for i in range(4)]
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", "the demo left processes running"


def join_lines(workdir) -> str:
    """What each peer measured and chose, and every stage move: why a layout came out as it did."""
    lines = [line for path in sorted(workdir.glob("peer*.log")) for line in path.read_text().splitlines()
             if re.search(r"measured .*FLOP/s|chose stage|moving from stage|no holder left", line)]
    return "\n".join(["joins:", *sorted(lines)])
