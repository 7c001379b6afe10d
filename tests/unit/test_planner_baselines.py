"""Baselines produce valid plans and the planner is never worse than them under its cost model."""

from __future__ import annotations

import numpy as np
import pytest

from planner.costs import estimate_throughput
from planner.baselines import plan_even, plan_petals, plan_swarm
from planner.partition import plan_partition
from planner.offline.scenarios import build_case3_snapshot, build_region_snapshot, build_transformer_profile
from planner.simulator import SimulationConfig, simulate_plan

MODEL = build_transformer_profile(num_layers=12, hidden_size=2048, sequence_length=512, num_microbatches=64)


@pytest.mark.parametrize("seed", range(3))
def test_baselines_are_valid_and_not_better_than_ours(seed: int) -> None:
    snapshot = build_region_snapshot(np.random.default_rng(seed), num_devices=10, num_regions=2, model=MODEL)
    ours = estimate_throughput(snapshot, plan_partition(snapshot, rng=np.random.default_rng(0)))
    for baseline in (plan_even, plan_petals, plan_swarm):
        plan = baseline(snapshot)
        plan.check_fits(snapshot)
        assert plan.num_layers == MODEL.num_layers
        assert len(plan.assigned_peer_ids()) == len(set(plan.assigned_peer_ids()))
        assert estimate_throughput(snapshot, plan) <= ours * (1 + 1e-9)


def test_even_partition_has_equal_layer_counts() -> None:
    snapshot = build_region_snapshot(np.random.default_rng(1), num_devices=8, num_regions=1, model=MODEL)
    sizes = [stage.num_layers for stage in plan_even(snapshot).stages]
    assert max(sizes) - min(sizes) <= 1


def test_petals_fills_the_weakest_stage_first() -> None:
    snapshot = build_region_snapshot(np.random.default_rng(2), num_devices=12, num_regions=1, model=MODEL)
    plan = plan_petals(snapshot)
    flops = {d.peer_id: d.flops for d in snapshot.devices}
    totals = [sum(flops[p] for p in stage.peer_ids) for stage in plan.stages]
    assert max(totals) - min(totals) <= max(flops.values())


def test_ours_beats_even_in_simulated_case3() -> None:
    snapshot = build_case3_snapshot(np.random.default_rng(0), MODEL)
    config = SimulationConfig(num_steps=1)
    ours = simulate_plan(snapshot, plan_partition(snapshot, rng=np.random.default_rng(0)), config, rng=np.random.default_rng(0))
    even = simulate_plan(snapshot, plan_even(snapshot), config, rng=np.random.default_rng(0))
    assert ours.throughput > 1.3 * even.throughput
