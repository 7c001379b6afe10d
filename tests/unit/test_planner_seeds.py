"""Seed 001 (Asteroid) and seed 002 (SpanTrain) planners against brute force and invariants."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costs import estimate_throughput
from planner.asteroid import allocate_microbatch, estimate_footprint_bytes, estimate_round_delay, plan_asteroid
from planner.offline.scenarios import build_case3_snapshot, build_region_snapshot, build_transformer_profile
from planner.spantrain import estimate_cost, group_by_compute, group_by_network, plan_spantrain

MODEL = build_transformer_profile(num_layers=8, hidden_size=2048, sequence_length=512, num_microbatches=16)


@settings(max_examples=40, deadline=None)
@given(
    delays=st.lists(st.floats(0.1, 5.0), min_size=1, max_size=4),
    data=st.data(),
)
def test_microbatch_allocation_near_brute_force(delays: list[float], data: st.DataObject) -> None:
    n = len(delays)
    caps = np.array(data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)), dtype=float)
    total = data.draw(st.integers(1, 8))
    allocation, straggler = allocate_microbatch(np.array(delays), caps, total)
    feasible = [
        a for a in itertools.product(*(range(int(c) + 1) for c in caps)) if sum(a) == total
    ]
    if not feasible:
        assert straggler == float("inf")
        return
    best = min(max(x * d for x, d in zip(a, delays)) for a in feasible)
    assert allocation.sum() == total and np.all(allocation <= caps)
    assert straggler == pytest.approx(float((allocation * np.array(delays)).max()))
    assert straggler <= best + max(delays) + 1e-9  # within one sample of the optimum


def test_round_delay_of_one_step_is_paced_microbatches_plus_allreduce() -> None:
    assert estimate_round_delay([1.0], [2.0], [0.5], 4) == pytest.approx(4 * 3.0 + 0.5)
    # Two steps: the dominant one paces, the first step waits for nothing and ends last.
    assert estimate_round_delay([1.0, 2.0], [1.0, 2.0], [0.0, 0.0], 3) == pytest.approx(2 * 4.0 + 6.0)


def test_footprint_counts_inflight_activations() -> None:
    weights = estimate_footprint_bytes(MODEL, 0, 2, num_samples=0, num_inflight=3)
    assert weights == pytest.approx(2 * MODEL.layer_param_bytes[0] * 4.0)
    full = estimate_footprint_bytes(MODEL, 0, 2, num_samples=2, num_inflight=3)
    assert full - weights == pytest.approx(3 * 2 * 2 * MODEL.layer_activation_bytes[0])


@pytest.mark.parametrize("planner", ["asteroid", "spantrain"])
def test_seed_planners_give_valid_feasible_plans(planner: str) -> None:
    snapshot = build_region_snapshot(np.random.default_rng(4), num_devices=7, num_regions=2, model=MODEL)
    plan = plan_asteroid(snapshot) if planner == "asteroid" else plan_spantrain(snapshot, rng=np.random.default_rng(0))
    plan.check_fits(snapshot)
    assert plan.num_layers == MODEL.num_layers
    assert estimate_throughput(snapshot, plan) > 0


def test_spantrain_groups_follow_regions_then_compute() -> None:
    snapshot = build_case3_snapshot(np.random.default_rng(0), MODEL)
    groups = group_by_network(snapshot, 0.2)
    names = [[snapshot.devices[i].peer_id[:4] for i in g] for g in groups]
    assert ["hpc0"] * 4 in names and ["hpc1"] * 4 in names
    sub = group_by_compute(snapshot, list(range(snapshot.num_devices)), 0.8)
    assert len(sub) == 2 and {len(g) for g in sub} == {8}


def test_spantrain_beam_is_no_worse_than_its_start() -> None:
    snapshot = build_case3_snapshot(np.random.default_rng(1), MODEL)
    plan = plan_spantrain(snapshot, rng=np.random.default_rng(0))
    groups = [sorted(snapshot.indices_of(s.peer_ids).tolist()) for s in plan.stages]
    bounds = tuple(s.layer_end for s in plan.stages)
    cost = estimate_cost(snapshot, groups, bounds)
    for order in itertools.permutations(range(len(groups))):
        ordered = [groups[k] for k in order]
        even = tuple(round(MODEL.num_layers * (k + 1) / len(groups)) for k in range(len(groups)))
        assert cost <= estimate_cost(snapshot, ordered, even) + 1e-9
