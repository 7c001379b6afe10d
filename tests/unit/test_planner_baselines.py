"""Baselines produce valid plans and the planner is never worse than them under its cost model."""

from __future__ import annotations

import numpy as np
import pytest

from planner.costs import estimate_group_costs, estimate_throughput, profile_group, throughput_of
from planner.baselines import _deal, _even_bounds, _fits, _to_plan, plan_even, plan_petals, plan_swarm
from planner.canonical import canonicalize
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


@pytest.mark.parametrize("seed", range(3))
def test_a_canonical_snapshot_is_its_own_canonical_form(seed: int) -> None:
    """``is_canonical`` skips the colouring of a snapshot that ``canonicalize`` made: that is
    right only because such a snapshot canonicalises to itself, every name its own."""
    rng = np.random.default_rng(seed)
    snapshot = build_region_snapshot(rng, num_devices=14, num_regions=3, model=MODEL, unreliable_fraction=0.3)
    canonical, _ = canonicalize(snapshot)
    again, names = canonicalize(canonical)
    assert names == tuple(device.peer_id for device in canonical.devices)
    assert again.devices == canonical.devices
    assert np.array_equal(again.links.latency_delay, canonical.links.latency_delay)
    assert np.array_equal(again.links.bandwidth, canonical.links.bandwidth)
    for baseline in (plan_even, plan_petals, plan_swarm):
        assert baseline(canonical, is_canonical=True) == baseline(canonical)


@pytest.mark.parametrize("seed", range(3))
def test_even_partition_scores_groups_as_its_plan(seed: int) -> None:
    """The even baseline scores each stage count without building its Plan, and skips counts whose
    members cannot hold their stage: the figures must be the Plan's, a skipped count worth 0, and
    the count it keeps the best of all counts."""
    rng = np.random.default_rng(seed)
    snapshot = build_region_snapshot(
        rng, num_devices=12, num_regions=2, model=MODEL, unreliable_fraction=0.3, memory_range_bytes=(2e9, 12e9),
    )
    canonical, _ = canonicalize(snapshot)
    chosen = estimate_throughput(canonical, plan_even(canonical, is_canonical=True))
    for num_stages in range(1, len(canonical.reliable_indices()) + 1):
        groups, bounds = _deal(canonical, num_stages), _even_bounds(MODEL.num_layers, num_stages)
        plan = _to_plan(canonical, groups, bounds)
        profiles = [profile_group(canonical, np.array(s), np.array(c, dtype=np.int64)) for s, c in groups]
        scored = throughput_of(canonical, estimate_group_costs(canonical, profiles, (0,) + bounds))
        assert scored == estimate_throughput(canonical, plan)
        assert _fits(canonical, groups, bounds) or scored == 0.0  # a count that does not fit is skipped
        assert scored <= chosen
