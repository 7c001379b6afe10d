"""The global plan of issue #18: right first.

Each defect the issue lists has a test here that failed before the fix (the seed 000 planner
alone, ``plan_partition``, is the "before"), and one property test over random topologies checks
all the promises together.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from planner.canonical import plan_canonically, rename_plan
from planner.costs import estimate_throughput, is_within_memory
from planner.asteroid import plan_asteroid
from planner.baselines import plan_even, plan_petals, plan_swarm
from planner.global_plan import GlobalPlanConfig, list_device_pools, plan_global, simulation_config
from planner.partition import PartitionConfig, plan_partition
from planner.refinement import RefinementConfig
from planner.offline.scenarios import (
    GIGABYTE, V100_FLOPS, build_clustered_snapshot, build_region_snapshot, build_transformer_profile,
)
from planner.simulator import simulate_plan
from planner.spantrain import plan_spantrain
from planner.plan import Plan, Stage
from planner.runtime import RuntimeSettings
from planner.snapshot import Device, LinkMatrix, SwarmSnapshot

# Small budgets keep one plan well under a second on these sizes; the promises do not depend on them.
QUICK = GlobalPlanConfig(
    max_pools=3, num_simulated=2, simulation_steps=2,
    partition=PartitionConfig(small_swarm_size=0, num_anneal_iterations=200, refinement=RefinementConfig(num_kicks=1)),
    pool_partition=PartitionConfig(small_swarm_size=0, num_anneal_iterations=200, refinement=RefinementConfig(num_kicks=0)),
)


def _simulate(snapshot: SwarmSnapshot, plan: Plan, config: GlobalPlanConfig = QUICK) -> float:
    return simulate_plan(snapshot, plan, simulation_config(config, snapshot), rng=np.random.default_rng(0)).throughput


def _edge_swarm(seed: int = 2) -> SwarmSnapshot:
    """Eight fast GPUs (32 GB) in one cluster, eight edge devices on 100 Mbit/s links, 24 layers."""
    model = build_transformer_profile(num_layers=24, hidden_size=4096, sequence_length=1024, num_microbatches=16)
    return build_clustered_snapshot(np.random.default_rng(seed), model=model, num_clusters=1, cluster_size=8, num_edge=8)


def test_a_fast_cluster_is_planned_apart_from_its_slow_edge() -> None:
    """Defect 1: every seed 000 candidate used all reliable devices, so its pipeline crossed the
    100 Mbit/s links; the fast cluster alone is far faster and is a candidate now."""
    snapshot = _edge_swarm()
    fast = {d.peer_id for d in snapshot.devices if d.flops >= 2 * V100_FLOPS}  # the cluster
    old = estimate_throughput(snapshot, plan_partition(snapshot, rng=np.random.default_rng(0)))
    plan = plan_global(snapshot, QUICK)
    ours = estimate_throughput(snapshot, plan)
    assert set(plan.assigned_peer_ids()) <= fast  # the edge devices stay idle
    assert ours > 5 * old and ours > 5 * estimate_throughput(snapshot, plan_even(snapshot))
    assert tuple(sorted(fast)) in [
        tuple(snapshot.devices[i].peer_id for i in pool) for pool in list_device_pools(snapshot, 6)
    ]


def _link_bound_plan() -> tuple[SwarmSnapshot, Plan]:
    model = build_transformer_profile(num_layers=2, hidden_size=1024, sequence_length=1024, num_microbatches=8)
    devices = tuple(Device(peer_id=f"p{i}", flops=1e15, memory_bytes=10**11, is_reliable=True) for i in range(2))
    links = LinkMatrix(latency_delay=np.full((2, 2), 0.001), bandwidth=np.full((2, 2), 1e8))
    snapshot = SwarmSnapshot(devices=devices, links=links, model=model)
    return snapshot, plan_global(snapshot, QUICK)


SPLIT = Plan(stages=(
    Stage(layer_start=0, layer_end=1, server_ids=("p0",)), Stage(layer_start=1, layer_end=2, server_ids=("p1",)),
))


def test_the_cost_model_and_the_simulator_charge_a_link_alike() -> None:
    """Defect 2: the model charged a link's two directions in one term, the simulator in two (2x)."""
    snapshot, plan = _link_bound_plan()
    model = estimate_throughput(snapshot, SPLIT)
    assert _simulate(snapshot, SPLIT, replace(QUICK, simulation_steps=4)) == pytest.approx(model, rel=0.05)
    assert estimate_throughput(snapshot, plan) >= model


def test_the_runtime_window_is_an_input() -> None:
    """Defect 3: with one micro-batch in flight the pipeline waits for every round trip; the model
    and the simulator both see it, and both see the boundary codec."""
    snapshot, _ = _link_bound_plan()
    wide = estimate_throughput(snapshot, SPLIT)
    narrow_snapshot = replace(snapshot, runtime=RuntimeSettings(max_in_flight_per_peer=1))
    narrow = estimate_throughput(narrow_snapshot, SPLIT)
    assert narrow < 0.75 * wide
    assert _simulate(narrow_snapshot, SPLIT, replace(QUICK, simulation_steps=4)) == pytest.approx(narrow, rel=0.1)
    packed = replace(snapshot, runtime=RuntimeSettings(boundary_compression_ratio=0.5))
    assert estimate_throughput(packed, SPLIT) == pytest.approx(2 * wide)


def test_a_plan_that_does_not_fit_is_worth_nothing_anywhere() -> None:
    """Defect 4: the simulator gave throughput to a plan that held 51.5 GB on 32 GB cards."""
    snapshot = _edge_swarm()
    reliable_small = min((d for d in snapshot.devices if d.is_reliable), key=lambda d: d.memory_bytes)
    whole = Plan(stages=(Stage(layer_start=0, layer_end=24, server_ids=(reliable_small.peer_id,)),))
    assert not is_within_memory(snapshot, whole)
    assert estimate_throughput(snapshot, whole) == 0.0
    result = simulate_plan(snapshot, whole, simulation_config(QUICK, snapshot), rng=np.random.default_rng(0))
    assert result.throughput == 0.0 and not result.is_within_memory
    tiny = replace(snapshot, devices=tuple(replace(d, memory_bytes=GIGABYTE) for d in snapshot.devices))
    with pytest.raises(ValueError, match="fits in memory"):
        plan_global(tiny, QUICK)


def _renamed(snapshot: SwarmSnapshot, rng: np.random.Generator) -> tuple[SwarmSnapshot, dict[str, str]]:
    """The same swarm under new random ids, listed in a random order; and new id -> old id."""
    order = rng.permutation(snapshot.num_devices)
    names = [f"{int(x):010x}" for x in rng.choice(2**40, size=snapshot.num_devices, replace=False)]
    back = {names[i]: snapshot.devices[i].peer_id for i in range(snapshot.num_devices)}
    devices = tuple(replace(snapshot.devices[i], peer_id=names[i]) for i in order)
    index = np.ix_(order, order)
    links = LinkMatrix(latency_delay=snapshot.links.latency_delay[index], bandwidth=snapshot.links.bandwidth[index])
    return SwarmSnapshot(devices=devices, links=links, model=snapshot.model, runtime=snapshot.runtime), back


def test_the_plan_needs_no_seed_and_ignores_names() -> None:
    """Defect 5: another seed moved seed 000's plan from 0.54x to 1.02x even, and renaming peers
    changed it. The global plan takes no rng and runs on the canonical order."""
    snapshot = _edge_swarm(seed=3)
    plan = plan_global(snapshot, QUICK)
    renamed, back = _renamed(snapshot, np.random.default_rng(5))
    assert rename_plan(plan_global(renamed, QUICK), back) == plan
    assert plan_global(snapshot, QUICK) == plan


def test_where_the_model_and_the_simulator_disagree_the_models_promise_is_kept() -> None:
    """Two clusters of three GPUs, two micro-batches in flight: the model puts Asteroid's plan
    (104.2 samples/s) above the even partition (92.6); the simulator, which queues, gives them
    81.5 and 93.0. No plan keeps both promises; the one returned keeps the model's. (The instance
    before the round trip's transfers counted one pair of peers, seed 7862752 with clusters of two,
    no longer disagrees, nor does any of 200 seeds of that shape.)"""
    model = build_transformer_profile(num_layers=3, hidden_size=2048, sequence_length=1024, microbatch_size=4, num_microbatches=8)
    snapshot = build_clustered_snapshot(
        np.random.default_rng(19), model=model, num_clusters=2, cluster_size=3, num_edge=0,
        cluster_memory_bytes=(1 * GIGABYTE, 2 * GIGABYTE, 4 * GIGABYTE), edge_memory_bytes=(0.5e9, 3e9),
    )
    snapshot = replace(snapshot, runtime=RuntimeSettings(max_in_flight_per_peer=2))
    even, asteroid = plan_even(snapshot), plan_canonically(snapshot, plan_asteroid)
    assert estimate_throughput(snapshot, asteroid) > estimate_throughput(snapshot, even)
    assert _simulate(snapshot, asteroid) < _simulate(snapshot, even)
    plan = plan_global(snapshot, QUICK)
    assert estimate_throughput(snapshot, plan) >= estimate_throughput(snapshot, asteroid)
    assert _simulate(snapshot, plan) >= _simulate(snapshot, asteroid)


def _draw_snapshot(data: st.DataObject) -> SwarmSnapshot:
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    model = build_transformer_profile(
        num_layers=data.draw(st.integers(2, 6), label="layers"), hidden_size=2048, sequence_length=1024,
        microbatch_size=data.draw(st.sampled_from([1, 4]), label="microbatch"), num_microbatches=8,
    )
    runtime = RuntimeSettings(
        max_in_flight_per_peer=data.draw(st.integers(1, 6), label="in_flight"),
        boundary_compression_ratio=data.draw(st.sampled_from([1.0, 0.5, 1 / 3.76]), label="codec"),
        averaging_period=data.draw(st.sampled_from([0.0, 15.0]), label="period"),
    )
    if data.draw(st.booleans(), label="clustered"):
        snapshot = build_clustered_snapshot(
            rng, model=model, num_clusters=data.draw(st.integers(1, 2), label="clusters"),
            cluster_size=data.draw(st.integers(1, 3), label="cluster_size"),
            num_edge=data.draw(st.integers(0, 3), label="edge"),
            inter_cluster_megabits=data.draw(st.sampled_from([50.0, 1000.0]), label="inter"),
            cluster_memory_bytes=(1 * GIGABYTE, 2 * GIGABYTE, 4 * GIGABYTE), edge_memory_bytes=(0.5e9, 3e9),
        )
    else:
        snapshot = build_region_snapshot(
            rng, num_devices=data.draw(st.integers(1, 7), label="devices"),
            num_regions=data.draw(st.integers(1, 3), label="regions"), model=model,
            memory_range_bytes=(0.5e9, 4e9),
        )
    return replace(snapshot, runtime=runtime)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_plan_is_never_worse_than_what_it_implements_fits_and_ignores_names(data: st.DataObject) -> None:
    snapshot = _draw_snapshot(data)
    rivals = [plan_even(snapshot), plan_petals(snapshot), plan_swarm(snapshot)]
    if snapshot.num_devices <= QUICK.max_literature_devices:
        for planner in (plan_asteroid, lambda s: plan_spantrain(s, rng=np.random.default_rng(0))):
            try:
                rivals.append(plan_canonically(snapshot, planner))
            except ValueError:
                pass
    best = max(estimate_throughput(snapshot, r) for r in rivals)
    try:
        plan = plan_global(snapshot, QUICK)
    except ValueError:
        assert best == 0.0  # refused only when nothing it implements fits either
        return
    assert is_within_memory(snapshot, plan)
    assert estimate_throughput(snapshot, plan) >= best * (1 - 1e-9)
    simulated = _simulate(snapshot, plan)
    assert simulated > 0
    models = [estimate_throughput(snapshot, r) for r in rivals]
    simulations = [_simulate(snapshot, r) for r in rivals]
    if simulated < max(simulations) * (1 - 1e-9):
        # Allowed only where no rival is the best under both the model and the simulator, so no
        # rival could have been returned to keep both promises; the model's promise is kept.
        event("the model and the simulator rank the rivals differently")
        best_model, best_simulated = max(models), max(simulations)
        assert all(simulations[i] < best_simulated for i in range(len(rivals)) if models[i] == best_model)
        assert all(models[i] < best_model for i in range(len(rivals)) if simulations[i] == best_simulated)
    renamed, back = _renamed(snapshot, np.random.default_rng(data.draw(st.integers(0, 99), label="names")))
    assert rename_plan(plan_global(renamed, QUICK), back) == plan
