"""Cost models, water-filling and the exact layer split, checked against brute force."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner.costs import (
    estimate_averaging_floor, estimate_stage_costs, estimate_stage_delay, estimate_throughput, fill_workload,
    profile_group,
)
from planner.layer_split import build_cost_matrix, split_layers
from planner.evaluation import ArrangementScorer
from planner.offline.scenarios import build_region_snapshot, build_transformer_profile
from planner.plan import Plan, Stage
from planner.runtime import RuntimeSettings
from planner.snapshot import Device, LinkMatrix, ModelProfile, SwarmSnapshot


def _two_device_snapshot(flops: tuple[float, float], memory_bytes: int = 10**12) -> SwarmSnapshot:
    devices = tuple(
        Device(peer_id=f"p{i}", flops=f, memory_bytes=memory_bytes, is_reliable=True) for i, f in enumerate(flops)
    )
    links = LinkMatrix(latency_delay=np.full((2, 2), 0.1), bandwidth=np.full((2, 2), 1e6))
    model = ModelProfile(
        layer_flops=(100.0, 200.0, 300.0), layer_param_bytes=(1.0, 1.0, 1.0),
        layer_activation_bytes=(1000.0, 1000.0, 1000.0), microbatch_size=2, num_microbatches=4,
    )
    return SwarmSnapshot(devices=devices, links=links, model=model)


def test_data_parallel_stage_splits_work_by_compute() -> None:
    snapshot = _two_device_snapshot((100.0, 300.0))
    plan = Plan(stages=(Stage(layer_start=0, layer_end=3, server_ids=("p0", "p1")),))
    # Eq. 1 with servers only: m F / sum c = 2 * 600 / 400.
    assert estimate_stage_costs(snapshot, plan)[0] == pytest.approx(3.0)
    assert estimate_throughput(snapshot, plan) == pytest.approx(2 / 3.0)


def test_links_are_two_resources_and_the_window_bounds_throughput() -> None:
    """Issue #18: a link's two directions are separate resources beside the compute (the
    simulator's model), and the runtime's window caps throughput at W m / R (Little's law)."""
    plan = Plan(stages=(
        Stage(layer_start=0, layer_end=1, server_ids=("p0",)),
        Stage(layer_start=1, layer_end=3, server_ids=("p1",)),
    ))
    slow_link = _two_device_snapshot((1e6, 1e6))
    slow_link = replace(slow_link, links=LinkMatrix(latency_delay=np.zeros((2, 2)), bandwidth=np.full((2, 2), 1e3)))
    # Each direction carries 2 * 1000 bytes at 1e3 B/s: 2 s, not 4 s (seed 000 Eq. 2 added both).
    assert estimate_stage_costs(slow_link, plan)[0] == pytest.approx(2.0)
    snapshot = _two_device_snapshot((100.0, 100.0))
    costs = estimate_stage_costs(snapshot, plan)
    assert costs[0] == pytest.approx(2.0)  # compute 2*100/100 beside a 2000/1e6 s transfer
    assert costs[1] == pytest.approx(2 * 500 / 100)
    round_trip = 2.0 + 10.0 + 0.2 + 2 * 0.002
    assert estimate_throughput(snapshot, plan) == pytest.approx(2 / 10.0)  # window 4: R / 4 < 10
    narrow = replace(snapshot, runtime=RuntimeSettings(max_in_flight_per_peer=1))
    assert estimate_throughput(narrow, plan) == pytest.approx(2 / round_trip)
    halved = replace(slow_link, runtime=RuntimeSettings(boundary_compression_ratio=0.5))
    assert estimate_stage_costs(halved, plan)[0] == pytest.approx(1.0)


def test_server_without_memory_makes_plan_infeasible() -> None:
    snapshot = _two_device_snapshot((100.0, 100.0), memory_bytes=5)
    plan = Plan(stages=(Stage(layer_start=0, layer_end=3, server_ids=("p0", "p1")),))
    assert estimate_throughput(snapshot, plan) == 0.0


@settings(max_examples=40, deadline=None)
@given(
    offsets=st.lists(st.floats(0, 5), min_size=1, max_size=5),
    data=st.data(),
)
def test_fill_workload_matches_grid_search(offsets: list[float], data: st.DataObject) -> None:
    n = len(offsets)
    slopes = data.draw(st.lists(st.floats(0.1, 3), min_size=n, max_size=n))
    caps = data.draw(st.lists(st.floats(0.5, 4), min_size=n, max_size=n))
    total = data.draw(st.floats(0.5, 3))
    a, b, c = np.array(offsets), np.array(slopes), np.array(caps)
    # within fill_workload's 1e-12 tolerance, caps that hold the total "exactly" may go either way
    assume(abs(c.sum() - total) > 1e-9)
    finish, shares = fill_workload(a, b, c, total)
    if c.sum() < total:
        assert finish == float("inf")
        return
    assert shares.sum() == pytest.approx(total, rel=1e-6)
    assert np.all(shares <= c + 1e-9) and np.all(shares >= -1e-12)
    # Oracle: a grid over the simplex scaled to ``total`` with caps respected.
    grid = np.linspace(0, total, 13)
    best = np.inf
    for combo in itertools.product(grid, repeat=n - 1):
        last = total - sum(combo)
        w = np.array(list(combo) + [last])
        if last < -1e-9 or np.any(w > c + 1e-9):
            continue
        used = w > 1e-12
        best = min(best, float((a[used] + w[used] * b[used]).max()))
    assert finish <= best + 1e-9


def test_fill_workload_reports_infeasible_caps() -> None:
    finish, _ = fill_workload(np.zeros(2), np.ones(2), np.array([1.0, 1.0]), 3.0)
    assert finish == float("inf")


@pytest.mark.parametrize("seed", range(4))
def test_layer_split_dp_matches_enumeration(seed: int) -> None:
    rng = np.random.default_rng(seed)
    model = build_transformer_profile(num_layers=6, hidden_size=4096, sequence_length=1024)
    snapshot = build_region_snapshot(rng, num_devices=5, num_regions=2, model=model, unreliable_fraction=0.3)
    reliable = snapshot.reliable_indices()
    unreliable = snapshot.unreliable_indices()
    arrangement = [((r,), tuple(unreliable) if k == 0 else ()) for k, r in enumerate(reliable[:3])]
    groups = [profile_group(snapshot, np.array(s), np.array(c, dtype=np.int64)) for s, c in arrangement]
    bounds, cost = split_layers(snapshot, groups)
    scorer = ArrangementScorer(snapshot)
    best = np.inf
    for cuts in itertools.combinations(range(1, 6), len(arrangement) - 1):
        candidate = tuple(cuts) + (6,)
        best = min(best, float(scorer.stage_costs(arrangement, candidate).max()))
    assert cost == pytest.approx(best)
    assert float(scorer.stage_costs(arrangement, bounds).max()) == pytest.approx(cost)
    plan = scorer.to_plan(arrangement, bounds)
    scored_bounds, scored = scorer.score(arrangement)  # the split's bottleneck, then the window bound
    assert scored_bounds == bounds and scored >= cost
    if np.isfinite(cost):
        assert estimate_throughput(snapshot, plan) == pytest.approx(model.microbatch_size / scored)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), inflight=st.integers(1, 4))
def test_vectorised_stage_matrix_matches_scalar_model(seed: int, inflight: int) -> None:
    rng = np.random.default_rng(seed)
    model = build_transformer_profile(num_layers=5, hidden_size=4096, sequence_length=2048)
    snapshot = build_region_snapshot(
        rng, num_devices=6, num_regions=2, model=model, unreliable_fraction=0.5,
        memory_range_bytes=(4e9, 30e9),
    )
    servers = np.array(snapshot.reliable_indices()[:2])
    clients = np.array(snapshot.unreliable_indices(), dtype=np.int64)
    group = profile_group(snapshot, servers, clients)
    matrix = build_cost_matrix(model, group, num_inflight=inflight, link_per_byte=None, runtime=snapshot.runtime)
    for a in range(5):
        for b in range(a + 1, 6):
            expected, _ = estimate_stage_delay(model, group, a, b, num_inflight=inflight)
            expected = max(expected, estimate_averaging_floor(model, group, a, b, runtime=snapshot.runtime))
            assert matrix[a, b] == pytest.approx(expected, rel=1e-9)
