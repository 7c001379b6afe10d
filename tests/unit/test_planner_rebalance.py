"""Online decisions: join choice against brute force, hysteresis, never reloading unchanged stages."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from planner.costs import estimate_throughput
from planner.partition import plan_partition
from planner.offline.rebalance import RebalanceConfig, choose_join_stage, plan_rebalance, prepare_join
from planner.offline.scenarios import build_region_snapshot, build_transformer_profile
from planner.plan import Plan, Stage
from planner.snapshot import Device, LinkMatrix, SwarmSnapshot

MODEL = build_transformer_profile(num_layers=8, hidden_size=2048, sequence_length=512, num_microbatches=64)


def _without(snapshot: SwarmSnapshot, peer_id: str) -> SwarmSnapshot:
    keep = [i for i, d in enumerate(snapshot.devices) if d.peer_id != peer_id]
    links = LinkMatrix(
        latency_delay=snapshot.links.latency_delay[np.ix_(keep, keep)],
        bandwidth=snapshot.links.bandwidth[np.ix_(keep, keep)],
    )
    return SwarmSnapshot(devices=tuple(snapshot.devices[i] for i in keep), links=links, model=snapshot.model)


def _with_peer(plan: Plan, k: int, peer_id: str, *, is_reliable: bool) -> Plan:
    stages = list(plan.stages)
    stage = stages[k]
    stages[k] = Stage(
        layer_start=stage.layer_start, layer_end=stage.layer_end,
        server_ids=stage.server_ids + ((peer_id,) if is_reliable else ()),
        client_ids=stage.client_ids + (() if is_reliable else (peer_id,)),
    )
    return Plan(stages=tuple(stages))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10**6), num_devices=st.integers(4, 12))
def test_join_choice_is_the_brute_force_best(seed: int, num_devices: int) -> None:
    snapshot = build_region_snapshot(np.random.default_rng(seed), num_devices=num_devices, num_regions=2, model=MODEL)
    joiner = snapshot.devices[seed % num_devices]
    if joiner.is_reliable and len(snapshot.reliable_indices()) == 1:
        return
    plan = plan_partition(_without(snapshot, joiner.peer_id), rng=np.random.default_rng(0))
    chosen = choose_join_stage(prepare_join(snapshot, plan), joiner.peer_id)
    throughputs = [
        estimate_throughput(snapshot, _with_peer(plan, k, joiner.peer_id, is_reliable=joiner.is_reliable))
        for k in range(plan.num_stages)
    ]
    assert throughputs[chosen] == pytest.approx(max(throughputs), rel=1e-9)


def _uniform_snapshot(num_devices: int) -> SwarmSnapshot:
    devices = tuple(
        Device(peer_id=f"p{i:02d}", flops=1e13, memory_bytes=10**11, is_reliable=True) for i in range(num_devices)
    )
    links = LinkMatrix(
        latency_delay=np.full((num_devices,) * 2, 0.01), bandwidth=np.full((num_devices,) * 2, 1e8)
    )
    return SwarmSnapshot(devices=devices, links=links, model=MODEL)


def _stage(start: int, end: int, peers: list[int]) -> Stage:
    return Stage(layer_start=start, layer_end=end, server_ids=tuple(f"p{i:02d}" for i in peers))


def test_no_move_when_balanced() -> None:
    snapshot = _uniform_snapshot(6)
    plan = Plan(stages=(_stage(0, 4, [0, 1, 2]), _stage(4, 8, [3, 4, 5])))
    decision = plan_rebalance(snapshot, plan)
    assert decision.moves == () and decision.plan is plan


def test_clear_imbalance_moves_peers_and_keeps_layers() -> None:
    snapshot = _uniform_snapshot(6)
    plan = Plan(stages=(_stage(0, 4, [0]), _stage(4, 8, [1, 2, 3, 4, 5])))
    decision = plan_rebalance(snapshot, plan)
    assert decision.gain >= 0.1 and decision.moves
    assert [(s.layer_start, s.layer_end) for s in decision.plan.stages] == [(0, 4), (4, 8)]
    assert all(m.from_stage == 1 and m.to_stage == 0 for m in decision.moves)
    moved = {m.peer_id for m in decision.moves}
    for p in plan.assigned_peer_ids():  # unmoved peers keep their stage, so reload nothing
        assert p in moved or decision.plan.stage_of(p) == plan.stage_of(p)
    assert estimate_throughput(snapshot, decision.plan) >= 1.1 * estimate_throughput(snapshot, plan)


def test_hysteresis_blocks_small_gains() -> None:
    snapshot = _uniform_snapshot(6)
    plan = Plan(stages=(_stage(0, 4, [0]), _stage(4, 8, [1, 2, 3, 4, 5])))
    decision = plan_rebalance(snapshot, plan, RebalanceConfig(min_gain=100.0))
    assert decision.moves == () and decision.gain == 0.0


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10**6))
@example(seed=222657)  # found by a full unit run: a greedy "gain" scored with the search's own roles was a 4 % loss
def test_rebalance_never_lowers_throughput_or_drops_peers(seed: int) -> None:
    snapshot = build_region_snapshot(np.random.default_rng(seed), num_devices=10, num_regions=2, model=MODEL)
    plan = plan_partition(snapshot, rng=np.random.default_rng(seed))
    decision = plan_rebalance(snapshot, plan, RebalanceConfig(min_gain=0.0))
    assert set(plan.assigned_peer_ids()) <= set(decision.plan.assigned_peer_ids())
    assert estimate_throughput(snapshot, decision.plan) >= estimate_throughput(snapshot, plan) * (1 - 1e-9)


def test_join_rejects_a_member() -> None:
    snapshot = _uniform_snapshot(2)
    plan = Plan(stages=(_stage(0, 8, [0, 1]),))
    with pytest.raises(ValueError):
        choose_join_stage(prepare_join(snapshot, plan), "p00")
