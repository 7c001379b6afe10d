"""python -m peer.status (py-libp2p, no daemon) against a live run_peer.py; pause and resume by SIGUSR1.

The client runs as its own process (py-libp2p and hivemind cannot share an interpreter), started
from the main environment, so its re-execution into .venv-libp2p is exercised too.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from peer.harness.local_swarm import REPO_ROOT, wait_for

pytestmark = [pytest.mark.smoke, pytest.mark.timeout(120)]
SOME_PEER_ID = "12D3KooWSat51nqvjB9HV13Cyqw1FMSJRYXAY8nqF5Hh2Wbxkbss"


def status_client(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peer.status", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT)


def peer_address(peer) -> str:
    match = re.search(r"reachable at (/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)", peer.log_path.read_text())
    return match.group(1) if match else ""


def wait_for_record_state(maddrs: list[str], peer_id: str, state: str, timeout: float) -> None:
    """Poll the run's peer records in the DHT (as another peer sees them) until ``peer_id``'s has ``state``."""
    from dht.node import DHTNodeConfig, open_dht
    from dht.registry import fetch_peers

    dht, _ = open_dht(DHTNodeConfig(initial_peers=tuple(maddrs), client_mode=True))
    try:
        def has_state() -> bool:
            records = asyncio.run(fetch_peers(dht, "demo"))
            return any(r.peer_id == peer_id and r.state == state for r in records)

        wait_for(has_state, timeout, f"the peer's DHT record to say {state}")
    finally:
        dht.shutdown()


def status_steps(peer, after: float) -> list[int]:
    return [e["step"] for e in peer.events("status") if e["t"] > after]


def next_logged_step(peer) -> int:
    """The step of the peer's first status line written after now."""
    now = time.time()
    wait_for(lambda: status_steps(peer, now), 10, "the peer's next status line")
    return status_steps(peer, now)[0]


def test_status_client_reads_a_live_peer_and_sees_it_pause_and_resume(local_swarm):
    local_swarm.start_bootstrap("--num-stages", "1", "--num-layers", "2", "--d-model", "64")
    peer = local_swarm.start_peer("--status-period", "1", "--settle-delay", "0")
    wait_for(lambda: peer_address(peer) and any(e["step"] >= 1 for e in peer.events("status")) or not peer.is_alive(),
             60, "the peer to train its first step")
    assert peer.is_alive(), peer.log_tail()
    address = peer_address(peer)
    peer_id = address.rsplit("/", 1)[1]

    peer.process.send_signal(signal.SIGUSR1)
    wait_for(lambda: peer.events("paused"), 10, "the peer to pause")
    paused_at = peer.events("paused")[0]["t"]
    # in-flight microbatches finish after the pause; then two status lines in a row show one step
    wait_for(lambda: len(set(status_steps(peer, paused_at)[-2:])) == 1 and len(status_steps(peer, paused_at)) >= 2,
             20, "the paused peer's step to settle")
    frozen_step = status_steps(peer, paused_at)[-1]
    wait_for_record_state(local_swarm.maddrs, peer_id, "paused", 10)

    result = status_client(address, "--json")
    after_step = next_logged_step(peer)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["peer_id"] == report["status"]["peer_id"] == peer_id
    assert report["status"]["stage"] == 0 and report["status"]["num_stages"] == 1
    assert report["status"]["state"] == "paused"
    assert frozen_step <= report["status"]["step"] <= after_step  # the peer's own count as it answered
    assert report["status"]["step"] >= 1
    assert "/murmuration/status/1.0.0" in report["identify"]["protocols"]
    assert "/ipfs/ping/1.0.0" in report["identify"]["protocols"]
    assert len(report["ping_ms"]) == 3 and all(0 < ms < 1000 for ms in report["ping_ms"])

    text = status_client(address)
    after_step = next_logged_step(peer)
    assert text.returncode == 0, text.stderr
    assert peer_id in text.stdout and "stage 0 of 1, paused" in text.stdout
    shown = re.search(r"^step\s+(\d+)$", text.stdout, re.M)
    assert shown and frozen_step <= int(shown.group(1)) <= after_step

    peer.process.send_signal(signal.SIGUSR1)
    wait_for(lambda: peer.events("resumed"), 10, "the peer to resume")
    wait_for(lambda: any(step > frozen_step for step in status_steps(peer, paused_at)), 30, "training to go on after resuming")
    result = status_client(address, "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["status"]["state"] == "training"
    assert peer.is_alive() and "Traceback" not in peer.log_path.read_text()


def test_a_node_without_the_status_protocol_is_named_as_such(local_swarm):
    maddrs = local_swarm.start_bootstrap()
    result = status_client(next(m for m in maddrs if "/ip4/127.0.0.1/" in m))
    assert result.returncode == 1
    assert "answers identify and ping" in result.stderr and "does not serve /murmuration/status/1.0.0" in result.stderr
    assert result.stderr.rstrip().endswith("once it has chosen its stage.") and "failed during" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == ""


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("address, sentence", [
    ("not-a-multiaddr", "error: 'not-a-multiaddr' is not a peer multiaddr"),
    ("/ip4/127.0.0.1/tcp/4001", "it has no /p2p/<peer id> part"),
    ("/ip4/127.0.0.1/tcp/{closed_port}/p2p/" + SOME_PEER_ID, "error: Cannot reach a peer at"),
], ids=["not-a-multiaddr", "no-peer-id", "closed-port"])  # ids: every test worker collects the same names
def test_a_bad_address_is_one_sentence_and_a_non_zero_exit(address, sentence):
    result = status_client(address.format(closed_port=closed_port()), "--timeout", "10")
    assert result.returncode == 2
    assert sentence in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stdout == ""
