"""kill -9 of the only peer of a stage: the stage comes back from the backup a peer of the next stage kept.

Three peers on the default two stages spread 1 + 2, so one stage has a single holder and the lowest
peer id of the other stage keeps its backup (``planner.backup_plan``). The test waits for a fresh
backup, kills the holder's whole process group without warning, and checks that the keeper (its
stage keeps a holder) moves there and loads the very state it backed up — not a re-initialised
stage — with rebalancing off (a rescue is a repair, not a rebalance), and that training goes on
with no loss of what was learnt.
"""

from __future__ import annotations

import os
import signal
import statistics
import time

import pytest
import torch

from dht.records import RunSpec
from peer.harness.local_swarm import wait_for
from swarm.stage import Stage

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(300)]
ARGS = ("--num-threads", "1", "--rebalance-period", "0", "--backup-period", "3")
HEARTBEAT_TTL = 6.0  # the peers' default --heartbeat-ttl


def stage_of(peer) -> int:
    return peer.events("status")[-1]["stage"]


def peer_id_of(peer) -> str:
    return peer.events("joined")[0]["peer_id"]


def losses_between(peers, start: float, end: float) -> list[float]:
    return [e["loss"] for p in peers for e in p.events("microbatch")
            if e["stage"] == 1 and e.get("loss") is not None and start <= e["t"] < end]


def test_the_only_peer_of_a_stage_is_killed_and_the_stage_comes_back_from_its_backup(local_swarm):
    local_swarm.start_bootstrap()
    peers = [local_swarm.start_peer(*ARGS) for _ in range(3)]
    wait_for(lambda: all(p.events("status") for p in peers), 150, "three peers to train")
    lone = next(k for k in (0, 1) if sum(stage_of(p) == k for p in peers) == 1)
    victim = next(p for p in peers if stage_of(p) == lone)
    survivors = [p for p in peers if p is not victim]
    keeper = min(survivors, key=peer_id_of)  # both serve the other stage: the lowest id keeps the backup
    assert all(stage_of(p) != lone for p in survivors)

    wait_for(lambda: any(e["version"] >= 1 for e in keeper.events("backup")), 90, "a backup of a trained state")
    first = keeper.events("backup")[-1]
    wait_for(lambda: keeper.events("backup")[-1]["version"] > first["version"], 60, "the backup to be refreshed")
    refresh_from = time.time()
    wait_for(lambda: keeper.events("backup")[-1]["t"] > refresh_from, 60, "one more backup refresh")
    killed_at = time.time()
    os.killpg(victim.pid, signal.SIGKILL)  # the peer, its DHT child and its p2pd, without warning
    for other in (p for p in peers if p is not keeper):
        # a keeper for a moment while the swarm formed, or while its view of the swarm lagged under load:
        # whatever it backed up it had dropped before the kill, so the keeper's copy is the only one
        kept = [(e["t"], name) for name in ("backup", "backup_dropped") for e in other.events(name) if e["t"] < killed_at]
        assert not kept or max(kept)[1] == "backup_dropped", f"{peer_id_of(other)[-6:]} still kept a backup"
    backup = [e for e in keeper.events("backup") if e["t"] < killed_at][-1]
    assert backup["of_stage"] == lone and backup["holder"] == peer_id_of(victim)

    wait_for(lambda: keeper.events("rescue"), 90, f"the keeper to take over stage {lone}")
    rescue = keeper.events("rescue")[0]
    assert (rescue["stage"], rescue["from_stage"], rescue["source"]) == (lone, 1 - lone, "local-backup")
    assert rescue["digest"] == backup["digest"], "the rescued stage holds exactly the state backed up last"
    initial = Stage(RunSpec(run_id="demo"), lone, device=torch.device("cpu")).params_digest()
    assert rescue["digest"] != initial, "the rescued stage was not re-initialised"
    assert not any(p.events("rescue") or p.events("moving") for p in survivors if p is not keeper)
    print(f"rescue {rescue['t'] - killed_at:.1f} s after the kill")

    wait_for(lambda: any(e["t"] > rescue["t"] for e in keeper.events("microbatch")), 60,
             "the rescuer to train its new stage")
    resumed_at = min(e["t"] for p in survivors for e in p.events("microbatch") if e["t"] > rescue["t"])
    print(f"training resumed {resumed_at - killed_at:.1f} s after the kill")
    wait_for(lambda: len(losses_between(survivors, rescue["t"], time.time())) >= 60, 90,
             "60 microbatches with a loss after the rescue")
    assert all(p.is_alive() for p in survivors)
    before = losses_between(peers, killed_at - 20, killed_at)
    after = losses_between(survivors, rescue["t"], time.time())[-30:]
    assert len(before) >= 10, before
    print(f"loss before the kill {statistics.mean(before):.3f}, after the rescue {statistics.mean(after):.3f}")
    assert statistics.mean(after) < statistics.mean(before) + 0.15, "what was learnt must survive the crash"


def test_a_joiner_of_a_stage_whose_only_peer_was_killed_pulls_it_from_the_backup(local_swarm):
    """Two peers, 1 + 1: nobody can be spared for a rescue, and re-planning is off (--replan-after 0;
    tests/e2e/test_replan.py has it on), so the stage waits for a joiner, which pulls the backup from
    its keeper instead of starting the stage from the run seed."""
    local_swarm.start_bootstrap()
    peers = [local_swarm.start_peer(*ARGS, "--replan-after", "0") for _ in range(2)]
    wait_for(lambda: all(p.events("status") for p in peers), 150, "two peers to train")
    victim = next(p for p in peers if stage_of(p) == 0)
    keeper = next(p for p in peers if p is not victim)
    wait_for(lambda: any(e["of_stage"] == 0 and e["version"] >= 1 for e in keeper.events("backup")), 90,
             "a backup of stage 0's trained state")
    killed_at = time.time()
    os.killpg(victim.pid, signal.SIGKILL)
    backup = [e for e in keeper.events("backup") if e["of_stage"] == 0 and e["t"] < killed_at][-1]

    # a joiner reads the DHT: until the victim's last heartbeat expires (--heartbeat-ttl, 6 s) it may
    # still see stage 0 as held and choose stage 1 (then the keeper rescues stage 0, a different path).
    # Not a synchronisation: a record's expiry is a wall-clock time (its last heartbeat, before the
    # kill, plus the TTL), whatever the load; the second on top covers the DHT's clock skew.
    time.sleep(max(0.0, killed_at + HEARTBEAT_TTL + 1.0 - time.time()))
    joiner = local_swarm.start_peer(*ARGS, "--replan-after", "0")
    wait_for(lambda: joiner.events("backup_restored"), 150, "the joiner to restore stage 0 from its backup")
    restored = joiner.events("backup_restored")[0]
    assert (restored["stage"], restored["source"], restored["version"]) == (0, "backup-donor", backup["version"])
    assert restored["digest"] == backup["digest"]
    assert joiner.events("state_download")[0]["donor"] == peer_id_of(keeper)
    assert not keeper.events("rescue"), "a keeper alone in its stage stays there"
    count = len(keeper.events("microbatch"))
    wait_for(lambda: len(keeper.events("microbatch")) >= count + 20, 90, "training to go on through the joiner")
    assert keeper.is_alive() and joiner.is_alive()
