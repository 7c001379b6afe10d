"""Rebalancing with hysteresis: after a leave, the one peer the planner names moves to the bottleneck.

Four peers spread 2 + 2 over the default two stages; then one stage-1 peer leaves (Ctrl+C), and
stage 1, which also holds the head and costs 1.077x stage 0 per sample, is the bottleneck. Whether
moving a stage-0 peer there clears ``--rebalance-min-gain`` depends on the FLOP/s each peer measured
when it joined, which swing 2x on a busy machine. So the test asks ``choose_move`` (the oracle the
peers use too) what should happen given the FLOP/s the peers recorded, and checks that exactly that
happens: nobody moves while the swarm is 2 + 2 unless the oracle says so, and after the leave
either the named peer moves (pulls stage 1's state, trains there, nobody moves back) or, if no move
clears the threshold, nobody does.
"""

from __future__ import annotations

import time

import pytest

from dht.records import RunSpec
from peer.harness.local_swarm import wait_for
from planner.claims import cap_to_median
from planner.stage_choice import StageMember, choose_move
from swarm.model import stage_flops_per_sample

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(300)]
MIN_GAIN = 0.05
REBALANCE = ("--rebalance-period", "2", "--rebalance-min-gain", str(MIN_GAIN))
COSTS = [stage_flops_per_sample(RunSpec(run_id="demo"), k) for k in range(2)]


def stage_of(peer) -> int:
    return peer.events("status")[-1]["stage"]


def checks(peer, *, after: float = 0.0) -> int:
    """Rebalancing checks ``peer`` made (settled, no joiner in view) since ``after``."""
    return sum(e["t"] > after for e in peer.events("rebalance_checked"))


def wait_checks(peers, num_checks: int, what: str) -> None:
    """Wait until each of ``peers`` made ``num_checks`` more rebalancing checks: a claim that nobody
    moves is only as good as the checks it covers, and a busy machine makes fewer per second."""
    since = time.time()
    wait_for(lambda: all(checks(p, after=since) >= num_checks for p in peers), 30 + 10 * num_checks, what)


def expected_move(peers, *, as_joined: bool = False):
    """What choose_move says on the FLOP/s the peers recorded, bounded as their views bound them
    (``swarm.view.bound_claims``: at most 4x the lower median; in a CI rehearsal 69.3 GFLOP/s beside
    9.1-55.8 counted as 61.7 and the oracle without the bound named a move no peer saw), on their
    current stages (or on the stages they negotiated when they joined)."""
    flops = cap_to_median([p.events("joined")[0]["flops"] for p in peers])
    members = [StageMember(peer_id=p.events("joined")[0]["peer_id"],
                           stage=p.events("joined")[0]["stage"] if as_joined else stage_of(p),
                           flops=f) for p, f in zip(peers, flops, strict=True)]
    return choose_move(COSTS, members, min_gain=MIN_GAIN)


def test_after_a_leave_the_named_peer_moves_to_the_bottleneck_stage_and_trains_there(local_swarm):
    local_swarm.start_bootstrap()
    peers = [local_swarm.start_peer("--num-threads", "1", *REBALANCE) for _ in range(4)]
    wait_for(lambda: all(p.events("status") for p in peers), 150, "four peers to train")
    wait_for(lambda: all(checks(p) >= 4 for p in peers), 90, "four rebalancing checks with the swarm at 2 + 2")
    early = expected_move(peers, as_joined=True)  # the 2 + 2 map as negotiated, before any move
    if early is not None:  # the FLOP/s measured at join (noisy on a busy host) call for a move at 2 + 2 already
        mover = next(p for p in peers if p.events("joined")[0]["peer_id"] == early.peer_id)
        wait_for(lambda: mover.events("moving"), 30, "the move the oracle names at 2 + 2")
        assert [(e["from_stage"], e["to_stage"]) for e in mover.events("moving")][:1] == [(early.from_stage, early.to_stage)]
        return  # the swarm is no longer 2 + 2: the leave below needs it balanced
    if expected_move(peers) is None:
        assert not any(p.events("moving") for p in peers), "a balanced swarm must not move anyone"
        # both stages held; 1 + 3 where the FLOP/s measured at join differ enough (a rehearsal under
        # load measured 7.98 GFLOP/s on one peer and 3.5-4.2 on the others, and no move beat that)
        assert {stage_of(p) for p in peers} == {0, 1}
    leaver = next(p for p in peers if stage_of(p) == 1 and not p.events("moving"))
    assert local_swarm.stop(leaver) == 0
    rest = [p for p in peers if p is not leaver]
    moves_before = sum(len(p.events("moving")) for p in rest)  # moves the oracle allowed at 2 + 2
    move = expected_move(rest)
    if move is None:  # the FLOP/s recorded make no move worth it: nobody moves
        wait_checks(rest, 6, "six rebalancing checks on every peer after the leave")
        assert sum(len(p.events("moving")) for p in rest) == moves_before
        return
    mover = next(p for p in rest if p.events("joined")[0]["peer_id"] == move.peer_id)
    wait_for(lambda: mover.events("moved"), 90, f"peer {move.peer_id[-6:]} to move to stage {move.to_stage}")
    moving = mover.events("moving")[-1]
    assert (moving["from_stage"], moving["to_stage"]) == (move.from_stage, move.to_stage)
    assert moving["gain"] == pytest.approx(move.gain, rel=1e-6)
    moved_at = mover.events("moved")[-1]["t"]
    downloads = [e for e in mover.events("state_download") if moving["t"] <= e["t"] <= moved_at + 1]
    assert downloads, "the mover pulls its new stage's state from the holders"
    wait_for(lambda: any(e["stage"] == move.to_stage and e["t"] > moved_at for e in mover.events("microbatch")), 60,
             "the mover to train its new stage")
    wait_checks([mover], 4, "four checks by the mover on the new map")  # it is never moved back
    assert [(e["from_stage"], e["to_stage"]) for e in mover.events("moving") if e["t"] >= moving["t"]] == [
        (move.from_stage, move.to_stage)]
    assert stage_of(mover) == move.to_stage
    first = next(p for p in rest if stage_of(p) == 0)
    done = len(first.events("microbatch"))
    wait_for(lambda: len(first.events("microbatch")) >= done + 20, 60, "training to go on through the new stage map")
    assert all(p.is_alive() for p in rest)
    for peer in rest:
        lines = peer.log_path.read_text().splitlines()
        assert not [line for line in lines if " E [" in line], f"{peer.name} logged an error:\n{peer.log_tail()}"
