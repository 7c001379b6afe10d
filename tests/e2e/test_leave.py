"""Ctrl+C on a peer: it tells the others, they stop routing to it within a second, training goes on."""

from __future__ import annotations

import signal
import time

import pytest

from peer.harness.local_swarm import wait_for

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(300)]


def stage_of(peer) -> int:
    return peer.events("status")[-1]["stage"]


def test_ctrl_c_is_noticed_within_a_second_and_training_goes_on(local_swarm):
    local_swarm.start_bootstrap()
    peers = [local_swarm.start_peer("--num-threads", "1") for _ in range(3)]
    wait_for(lambda: all(p.events("status") for p in peers), 150, "three peers to train")
    crowded = max((0, 1), key=lambda k: sum(stage_of(p) == k for p in peers))
    leaver = next(p for p in peers if stage_of(p) == crowded)
    others = [p for p in peers if p is not leaver]
    leaver_id = leaver.events("joined")[0]["peer_id"]

    signalled_at = time.time()
    leaver.process.send_signal(signal.SIGINT)
    assert leaver.process.wait(30) == 0
    assert leaver.events("leave_announced")[0]["peers"] == 2
    for peer in others:
        notices = [e for e in peer.events("notice") if e["peer_id"] == leaver_id]
        assert notices and notices[0]["kind"] == "leave", peer.name
        assert notices[0]["t"] - signalled_at < 1.0, f"{peer.name} noticed after {notices[0]['t'] - signalled_at:.2f}s"

    first = next(p for p in others if stage_of(p) == 0)
    count = len(first.events("microbatch"))
    wait_for(lambda: len(first.events("microbatch")) >= count + 20, 60, "training to go on after the leave")
