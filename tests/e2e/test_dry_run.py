"""run_peer.py --dry-run against a live swarm, and the memory budget refusing a stage before allocating it."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from peer.bootstrap import build_run_spec
from peer.config import BootstrapConfig
from peer.harness.local_swarm import REPO_ROOT, wait_for
from peer.profiler import stage_memory_bytes

pytestmark = [pytest.mark.smoke, pytest.mark.timeout(150)]
MODEL = ("--num-layers", "2", "--d-model", "64")
MIB = 2**20


def start_peer(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO_ROOT / "run_peer.py"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                             "--join-timeout", "20", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO_ROOT)


def finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = process.communicate(timeout=90)
    finally:
        process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run_peer(*args: str) -> subprocess.CompletedProcess:
    return finish(start_peer(*args))


def test_dry_run_reports_stage_memory_and_gain_then_leaves(local_swarm):
    local_swarm.start_bootstrap("--num-stages", "2", *MODEL)
    member = local_swarm.start_peer("--status-period", "1", "--settle-delay", "0")
    wait_for(lambda: member.events("status") or not member.is_alive(), 60, "the first peer to train")
    assert member.is_alive(), member.log_tail()
    spec = build_run_spec(BootstrapConfig(num_stages=2, num_layers=2, d_model=64))
    needed_mib = stage_memory_bytes(spec, 1, max_in_flight=4) / MIB

    # both visitors at once: neither announces itself, so neither sees the other
    visitors = [start_peer("--bootstrap", *local_swarm.maddrs, "--dry-run", *extra) for extra in ((), ("--max-memory-mb", "64"))]
    result, small = [finish(visitor) for visitor in visitors]
    finished = time.time()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "left without taking a stage" in out
    assert "would take stage 1 of 2 (layers 1-1; negotiated)" in out  # stage 0 is held: stage 1 is the deficit
    assert re.search(rf"needs about {needed_mib:,.0f} MiB; budget [\d,]+ MiB \(available on cpu\): fits", out), out
    gain = re.search(r"bottleneck would go from 0 to ([\d,]+) tokens/s \(\+([\d,]+)\)", out)
    assert gain and int(gain.group(1).replace(",", "")) > 0 and gain.group(1) == gain.group(2), out
    assert "stage 0: 1 peer," in out and "stage 1: 0 peers" in out

    assert small.returncode == 0, small.stderr
    assert f"needs about {needed_mib:,.0f} MiB; budget 64 MiB (--max-memory-mb): does NOT fit" in small.stdout

    # the visitor never took a stage: the member's view never showed anyone at stage 1
    wait_for(lambda: [e for e in member.events("status") if e["t"] > finished + 1], 10, "a status line after the dry runs")
    assert all(e["peers_per_stage"][1] == 0 for e in member.events("status"))
    assert member.events("status")[-1]["peers_per_stage"] == [1, 0]


def test_memory_budget_refuses_the_stage_before_allocating_it(local_swarm):
    local_swarm.start_bootstrap("--num-stages", "2", *MODEL)
    spec = build_run_spec(BootstrapConfig(num_stages=2, num_layers=2, d_model=64))
    needed_mib = stage_memory_bytes(spec, 0, max_in_flight=4) / MIB
    result = run_peer("--bootstrap", *local_swarm.maddrs, "--max-memory-mb", "100", "--settle-delay", "0")
    assert result.returncode == 3
    assert f"Stage 0 needs about {needed_mib:.0f} MiB but this peer's budget (--max-memory-mb allows) is 100 MiB" in result.stderr
    assert "chose stage" not in result.stderr  # refused before the stage (and its model) was created
    assert "Traceback" not in result.stderr
