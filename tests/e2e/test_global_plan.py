"""A live swarm in two regions moves by itself to the global plan (issue #18; ``peer.plan_adoption``,
``peer.standby``), on the emulated internet of peer/harness/internet.py.

Six peers, three in each of two regions: 50 Mbit/s and 5 ms access links (20 ms round trips inside
a region), and between the regions a 10 Mbit/s path 40 ms further each way (100 ms round trips).
Their compute is what each measures on this shared machine (unequal: 8-65 GFLOP/s have been seen
for the same peer code). One of them, west2, says it is a weak device on a poor link (test-only fault
injection, ``peer.faults`` "slow_device": a thousandth of its measured compute and goodput), so every
plan leaves at least it idle: whether a plan uses the five others depends on what they measure (in
CI a plan used all six: goodputs measured on a loaded host read up to 5x the path's rate then, see
``dht.wire.ArrivalClock``). They join the bootstrap's even two-stage layout, choosing stages by
deficit, so the pipeline and each stage's replicas (which exchange gradients every step) cross the
slow path. Every 30 s each peer computes the global plan from the records, with the link figures the
peers measured and published; the first whose turn it is and whose verdict says move proposes it.

What it shows:
- the swarm moves to a plan, and that plan is the one the pure planner (``plan_global``) gives for the
  snapshot of records the proposer planned from (the peer writes its input into its event log);
- every peer ends where the plan says: on the stage it names, or standing by when the plan leaves it
  idle (it holds no stage and says so in its record);
- the swarm trains on under the plan from the trained state (the loss does not restart);
- the swarm does not move again and again: over the next two plans at most one more layout (before
  standing by existed, idled peers took the thinnest stage and every period adopted the plan again);
- when the last stage's holders crash (with every other stage's replicas but one, so no member is
  spare for it), a peer standing by takes that stage (without this a plan that serves with few
  peers would end the run), and training goes on.

Needs root, ``nft`` and ``gcc`` like tests/e2e/test_internet.py.
"""

from __future__ import annotations

import base64
import math
import statistics
import time

import pytest

from dht.layouts import STANDBY, assigned_stage
from peer.harness.internet import Link
from peer.harness.local_swarm import LocalSwarm, wait_for
from peer.plan_worker import from_wire
from planner.global_plan import plan_global

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(900), pytest.mark.xdist_group("one_at_a_time")]
ACCESS = Link(rate_mbit=50, delay_ms=5)
BETWEEN = Link(rate_mbit=10, delay_ms=40)
PERIOD = 30
SEED_LOSS = math.log(256)  # the default model's bytes, untrained
SLOW = {"MURMURATION_ALLOW_FAULT_INJECTION": "1", "MURMURATION_INJECT_FAULTS": "slow_device"}
ARGS = ("--num-threads", "1", "--rebalance-period", "0", "--global-plan-period", str(PERIOD), "--heartbeat-ttl", "10")
INTERNET_SEED = 18  # the emulated internet's (tests/e2e/conftest.py)


def peer_id_of(peer) -> str:
    return peer.events("joined")[0]["peer_id"]


def summary(peers) -> str:
    return "; ".join(f"{p.name} {peer_id_of(p)[-6:]}: {[(e['event'], e.get('reason'), e.get('version'), e.get('stage')) for e in p.events() if e['event'] in ('relayout_start', 'relayout', 'rescue', 'standby_end')]}"
                     for p in peers if p.events("joined"))


def last_stage_losses(peers, start: float, *, last_stage: int) -> list[float]:
    return [e["loss"] for p in peers for e in p.events("microbatch")
            if e["stage"] == last_stage and e.get("loss") is not None and e["t"] >= start]


def test_a_two_region_swarm_moves_by_itself_to_the_pure_planners_plan(internet, tmp_path):
    boot = internet.add_host("bootstrap", ACCESS)
    east = [internet.add_host(f"east{i}", ACCESS) for i in range(3)]
    west = [internet.add_host(f"west{i}", ACCESS) for i in range(3)]
    internet.connect_regions([boot, *east], west, BETWEEN)
    internet.start()
    swarm = LocalSwarm(tmp_path / "swarm")
    try:
        swarm.start_bootstrap("--num-stages", "2", host=boot.address, command_prefix=boot.command_prefix)
        peers = [swarm.start_peer(*ARGS, host=h.address, command_prefix=h.command_prefix, env=SLOW if h is west[-1] else None)
                 for h in (*east, *west)]
        wait_for(lambda: all(p.events("status") or not p.is_alive() for p in peers), 240, "six peers to train")
        assert all(p.is_alive() for p in peers), swarm.logs()
        assert sorted({p.events("status")[-1]["stage"] for p in peers}) == [0, 1]
        wait_for(lambda: len(last_stage_losses(peers, 0, last_stage=1)) >= 20 or not all(p.is_alive() for p in peers),
                 180, "20 microbatches through two stages")
        initial = statistics.mean(last_stage_losses(peers, 0, last_stage=1)[:10])

        # one proposes; its plan is the pure planner's for the records it planned from
        wait_for(lambda: any(e["reason"] == "global_plan" for p in peers for e in p.events("relayout_start"))
                 or not all(p.is_alive() for p in peers), 6 * PERIOD, "a peer to propose the global plan")
        assert all(p.is_alive() for p in peers), swarm.logs()
        proposals = sorted(((e["t"], p.name, e) for p in peers for e in p.events("relayout_start")
                            if e["reason"] == "global_plan"), key=lambda item: item[:2])
        proposer = next(p for p in peers if p.name == proposals[0][1])
        proposal = proposals[0][2]
        planned = [e for e in proposer.events("global_plan") if e["adopt"] and e["t"] <= proposal["t"]][-1]
        snapshot = from_wire(base64.b64decode(planned["snapshot"]))
        plan = plan_global(snapshot)
        layout = [[s.layer_start, s.layer_end] for s in plan.stages]
        assert proposal["stage_layers"] == planned["stage_layers"] == layout and proposal["version"] == 1, summary(peers)
        ids = {p.name: peer_id_of(p) for p in peers}
        expected = {name: plan.stage_of(pid) if plan.stage_of(pid) is not None else STANDBY for name, pid in ids.items()}
        assert {name: assigned_stage(tuple(map(tuple, proposal["assignment"])), pid) for name, pid in ids.items()} == expected
        print(f"the plan: {layout} with {[len(s.peer_ids) for s in plan.stages]} peers; stages by host {expected}; "
              f"planned {planned['planned']:.3g} against {planned['current']:.3g} samples/s under the cost model")

        # every peer goes where the plan says: its stage, or standing by
        wait_for(lambda: all(p.events("relayout") and p.events("relayout")[-1]["version"] == 1 for p in peers)
                 or not all(p.is_alive() for p in peers), 180, "every peer to move to the plan's layout")
        assert all(p.is_alive() for p in peers), swarm.logs()
        assert {p.name: p.events("relayout")[-1]["stage"] for p in peers} == expected, summary(peers)
        assert all(p.events("relayout")[-1]["stage_layers"] == layout for p in peers)
        assert expected[peers[-1].name] == STANDBY, f"the plan uses the peer that says it is slow: {expected}"

        # the swarm trains on under the plan from the trained state, and does not adopt it again
        moved_at = max(p.events("relayout")[-1]["t"] for p in peers)

        def serving_now() -> list:  # a later plan may idle a peer this one placed (CI rehearsal: 37 s later)
            return [p for p in peers if p.events("relayout")[-1]["stage"] != STANDBY]

        def losses_after(t: float) -> list[float]:  # the last stage's, under whatever layout
            return [e["loss"] for p in peers for e in p.events("microbatch") if e.get("loss") is not None and e["t"] >= t]
        wait_for(lambda: (len(losses_after(moved_at)) >= 20
                          and all(len([e for e in p.events("global_plan") if e["t"] > moved_at]) >= 2 for p in serving_now()))
                 or not all(p.is_alive() for p in peers), 4 * PERIOD + 60,
                 "20 microbatches, and two global plans by each peer serving, since the move")
        assert all(p.is_alive() for p in peers), swarm.logs()
        after = statistics.mean(losses_after(moved_at)[:10])
        # from the seed a byte-level model predicts at about ln 256 = 5.55 nats; the first microbatches'
        # mean is no fixed bar (3.45-5.18 across runs: it depends on how far training got before them)
        assert after < SEED_LOSS - 1.0, f"the swarm goes on from the trained state, not from the seed: {initial:.3f} -> {after:.3f}"
        # before peers stood by, the idled ones took the thinnest stage and every period adopted the
        # plan again: a new layout version each period. A later plan may still move the swarm once
        # (link figures measured under the new layout differ; in one run of five it swapped two peers)
        later = {e["version"] for p in peers for e in p.events("relayout_start") if e["t"] > moved_at}
        assert len(later) <= 1, f"the swarm moved again and again after the plan: {summary(peers)}"
        print(f"loss {initial:.3f} at first, {after:.3f} after the move; moves took "
              f"{[round(p.events('relayout')[0]['seconds'], 2) for p in peers]} s; later layouts {sorted(later)}")
        newest = max(e["version"] for p in peers for e in p.events("relayout"))
        # (a peer standing by that a later plan leaves idle again says so with a relayout event at stage -1;
        # one that judged the later plan wrong stays as it was, standing by)
        wait_for(lambda: all(p.events("relayout")[-1]["version"] == newest or p.events("relayout")[-1]["stage"] == STANDBY
                             for p in peers) or not all(p.is_alive() for p in peers), 150, f"every peer under layout v{newest}")
        assert all(p.is_alive() for p in peers), swarm.logs()
        now = {p.name: p.events("relayout")[-1]["stage"] for p in peers}
        last = len(peers[0].events("relayout")[-1]["stage_layers"]) - 1
        print(f"layout v{newest}: stages by host {now}; {summary(peers)}")

        # the last stage's holders crash, and every other stage's holders but one, so that no member can
        # spare itself for it (a rescue never empties a stage): a peer standing by takes it
        kept = {min(p.name for p in peers if now[p.name] == k) for k in set(now.values()) - {STANDBY, last}}
        crashed = [p for p in peers if now[p.name] != STANDBY and p.name not in kept]
        crashed_at = time.time()
        for peer in crashed:
            swarm.stop(peer, graceful=False)
        standing = [p for p in peers if now[p.name] == STANDBY]
        alive = [p for p in peers if p not in crashed]

        def rescued() -> list:
            return [e for p in standing for e in p.events("relayout")
                    if e["t"] > crashed_at and e["stage"] == last and e["reason"] == "standby_rescue"]

        def trained_after(t: float) -> int:  # microbatches whose loss came back, under whatever layout
            return len([e for p in alive for e in p.events("microbatch") if e["t"] > t and e.get("loss") is not None])
        wait_for(lambda: (rescued() and trained_after(rescued()[0]["t"]) >= 10) or not all(p.is_alive() for p in alive),
                 180, "a peer standing by to take the lost last stage, and training to go on")
        assert all(p.is_alive() for p in alive), swarm.logs()
        took = rescued()[0]
        # (a plan may come right after the rescue: in one run the swarm moved to one stage 11 s later)
        print(f"{[p.name for p in crashed]} crashed; a peer standing by took stage {last} {took['seconds']:.1f} s "
              f"after deciding, {took['t'] - crashed_at:.1f} s after the crash, from {took['provenance']}; {summary(peers)}")

        swarm.shutdown()
        for peer in alive:
            assert peer.process.returncode == 0, peer.log_tail()
            assert "Traceback" not in peer.log_path.read_text(), peer.log_tail()
    finally:
        swarm.shutdown(timeout=20)
        print(swarm.logs())
