"""User mistakes end run_peer.py with one clear sentence and a non-zero exit, within a bounded time."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from peer.harness.local_swarm import REPO_ROOT

pytestmark = [pytest.mark.smoke, pytest.mark.timeout(180)]
SOME_PEER_ID = "12D3KooWSat51nqvjB9HV13Cyqw1FMSJRYXAY8nqF5Hh2Wbxkbss"


def run_peer(*args: str, timeout: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(REPO_ROOT / "run_peer.py"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *args],
                            capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    return result, time.monotonic() - started


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_bootstrap(tmp_path):
    result, seconds = run_peer("--bootstrap", f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{SOME_PEER_ID}", "--join-timeout", "10")
    assert result.returncode == 2
    assert "error: Cannot reach the swarm" in result.stderr and "check that the bootstrap is running" in result.stderr
    assert "Traceback" not in result.stderr
    assert seconds < 60


def test_malformed_bootstrap_address():
    result, _ = run_peer("--bootstrap", "not-a-multiaddr")
    assert result.returncode == 2
    assert "error: 'not-a-multiaddr' is not a multiaddr" in result.stderr and "copy the bootstrap's address" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_id_nobody_serves(local_swarm):
    local_swarm.start_bootstrap()
    result, _ = run_peer("--bootstrap", *local_swarm.maddrs, "--run-id", "no-such-run", "--join-timeout", "3")
    assert result.returncode == 2
    assert "No run named 'no-such-run' is served by this swarm (runs it serves: demo)" in result.stderr


def test_stage_that_does_not_fit_in_memory(local_swarm):
    local_swarm.start_bootstrap()
    result, _ = run_peer("--bootstrap", *local_swarm.maddrs, "--max-memory-mb", "64", "--join-timeout", "20")
    assert result.returncode == 3
    assert "needs about" in result.stderr and "raise --max-memory-mb" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_on_own_files_without_data(local_swarm, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    local_swarm.start_bootstrap("--data", str(corpus))
    result, _ = run_peer("--bootstrap", *local_swarm.maddrs, "--join-timeout", "20")
    assert result.returncode == 2
    assert "Cannot load the training data: this run trains on its own data files" in result.stderr
    other = tmp_path / "other.txt"
    other.write_text("something else entirely. " * 400)
    result, _ = run_peer("--bootstrap", *local_swarm.maddrs, "--join-timeout", "20", "--data", str(other))
    assert result.returncode == 2 and "are not the run's dataset" in result.stderr


def test_a_misspelt_murmuration_variable():
    env = {**os.environ, "MURMURATION_MAX_INFLIGHT": "8"}
    result = subprocess.run([sys.executable, str(REPO_ROOT / "run_peer.py"), "--bootstrap", f"/ip4/127.0.0.1/tcp/1/p2p/{SOME_PEER_ID}"],
                            capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, env=env)
    assert result.returncode == 2
    assert "MURMURATION_MAX_INFLIGHT is not an option of this script (did you mean MURMURATION_MAX_IN_FLIGHT?)" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_owner_key_pinned_is_not_the_runs(local_swarm):
    local_swarm.start_bootstrap()
    result, _ = run_peer("--bootstrap", *local_swarm.maddrs, "--run-owner", "0" * 32, "--join-timeout", "10")
    assert result.returncode == 2
    assert f"is not published by the owner key {'0' * 32} you pinned" in result.stderr
    assert "check --run-owner against the bootstrap's join line" in result.stderr and "Traceback" not in result.stderr
