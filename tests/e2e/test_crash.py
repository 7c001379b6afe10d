"""kill -9 of a replica: the swarm loses only that peer's compute and keeps training."""

from __future__ import annotations

import os
import signal
import statistics
import time

import pytest

from peer.harness.local_swarm import wait_for

pytestmark = [pytest.mark.smoke, pytest.mark.timeout(300)]


def stage_of(peer) -> int:
    return peer.events("status")[-1]["stage"]


def losses_between(peers, start: float, end: float) -> list[float]:
    return [e["loss"] for p in peers for e in p.events("microbatch")
            if e["stage"] == 1 and e.get("loss") is not None and start <= e["t"] < end]


def test_kill_9_of_a_last_stage_replica_costs_only_its_compute(local_swarm):
    local_swarm.start_bootstrap()
    peers = [local_swarm.start_peer("--num-threads", "1", "--rebalance-period", "0") for _ in range(4)]  # a fixed map
    wait_for(lambda: all(p.events("status") for p in peers), 150, "four peers to train")
    # the loss compared below is that of the 15 s before the kill: make sure they hold enough of it
    wait_for(lambda: len(losses_between(peers, time.time() - 10, time.time())) > 10, 90,
             "more than 10 losses in the last 10 s before the kill")
    victim = next(p for p in peers if stage_of(p) == 1)
    survivors = [p for p in peers if p is not victim]
    killed_at = time.time()
    os.killpg(victim.pid, signal.SIGKILL)  # the peer, its DHT child and its p2pd, without warning

    first_stage = [p for p in survivors if stage_of(p) == 0]
    done_before = sum(len(p.events("microbatch")) for p in first_stage)
    wait_for(lambda: sum(len(p.events("microbatch")) for p in first_stage) >= done_before + 100, 90,
             "100 more microbatches through the pipeline after the crash")
    # the loss compared below is that of the last 15 s: a window wholly after the kill, with enough in it
    def window_after_kill() -> bool:
        now = time.time()
        return now - 15 >= killed_at and len(losses_between(survivors, now - 15, now)) > 10
    wait_for(window_after_kill, 90, "15 s after the kill with more than 10 losses in them")
    assert all(p.is_alive() for p in survivors)
    before = losses_between(survivors + [victim], killed_at - 15, killed_at)
    after = losses_between(survivors, time.time() - 15, time.time())
    assert len(before) > 10 and len(after) > 10
    assert statistics.mean(after) < statistics.mean(before) + 0.1, "training should go on improving after the crash"
    for peer in survivors:
        lines = peer.log_path.read_text().splitlines()
        assert not [line for line in lines if " E [" in line], f"{peer.name} logged an error:\n{peer.log_tail()}"
        # hivemind's averager logs, with a traceback, the rounds the crashed partner broke or missed; nothing else
        hivemind_errors = [line for line in lines if "[ERROR]" in line]
        assert all("[hivemind.averaging." in line for line in hivemind_errors), hivemind_errors
