"""Cost models, water-filling and the exact layer split, checked against brute force."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner.costs import (
    estimate_averaging_floor, estimate_stage_costs, estimate_stage_delay, estimate_link_terms, estimate_throughput,
    fill_workload, fill_workloads, profile_group,
)
from planner.layer_split import build_cost_matrix, compute_range_delays, split_layers
from planner.evaluation import ArrangementScorer
from planner.offline.scenarios import build_region_snapshot, build_transformer_profile
from planner.plan import Plan, Stage
from planner.runtime import RuntimeSettings
from planner.snapshot import Device, LinkMatrix, ModelProfile, SwarmSnapshot


MODEL_FOR_LINKS = build_transformer_profile(num_layers=6, hidden_size=2048, sequence_length=1024)


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


@pytest.mark.parametrize("flushing", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_layer_split_dp_matches_enumeration(seed: int, flushing: bool) -> None:
    rng = np.random.default_rng(seed)
    model = build_transformer_profile(num_layers=6, hidden_size=4096, sequence_length=1024)
    snapshot = build_region_snapshot(rng, num_devices=5, num_regions=2, model=model, unreliable_fraction=0.3)
    snapshot = replace(snapshot, runtime=replace(snapshot.runtime, is_flushing=flushing))
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
    scored_bounds, scored = scorer.score(arrangement)  # the split's bottleneck, then the window bound (or the flush)
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


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), num_rows=st.integers(1, 12), num_devices=st.integers(1, 9))
def test_batched_water_filling_is_row_by_row_water_filling(seed: int, num_rows: int, num_devices: int) -> None:
    """``fill_workloads`` works on the pending rows only: each row's result must be exactly what
    the row gets alone, and match the scalar ``fill_workload``."""
    rng = np.random.default_rng(seed)
    offsets = np.where(rng.random(num_devices) < 0.3, 0.0, rng.uniform(0.0, 2.0, num_devices))
    per_sample = rng.uniform(0.1, 3.0, (num_rows, num_devices))
    caps = np.where(rng.random((num_rows, num_devices)) < 0.2, 0.0, rng.uniform(0.0, 4.0, (num_rows, num_devices)))
    total = float(rng.uniform(0.5, 8.0))
    batched = fill_workloads(offsets, per_sample, caps, total)
    for row in range(num_rows):
        alone = fill_workloads(offsets, per_sample[row: row + 1], caps[row: row + 1], total)
        assert batched[row] == alone[0]
        finish, _ = fill_workload(offsets, per_sample[row], caps[row], total)
        assert batched[row] == pytest.approx(finish, rel=1e-9) or np.isinf(finish) == np.isinf(batched[row])


@pytest.mark.parametrize("seed", range(3))
def test_range_delays_skip_ranges_no_server_holds(seed: int) -> None:
    """Ranges whose weights no server can hold are inf without being filled; the others are
    what the scalar stage delay gives."""
    rng = np.random.default_rng(seed)
    model = build_transformer_profile(num_layers=6, hidden_size=4096, sequence_length=1024)
    snapshot = build_region_snapshot(
        rng, num_devices=7, num_regions=2, model=model, unreliable_fraction=0.4, memory_range_bytes=(2e9, 7e9),
    )
    group = profile_group(
        snapshot, np.array(snapshot.reliable_indices()[:2]), np.array(snapshot.unreliable_indices(), dtype=np.int64)
    )
    starts, ends = np.triu_indices(7, k=1)
    delays = compute_range_delays(model, group, starts, ends, num_inflight=3)
    assert np.isinf(delays).any() and np.isfinite(delays).any()
    for a, b, delay in zip(starts.tolist(), ends.tolist(), delays.tolist()):
        expected, _ = estimate_stage_delay(model, group, a, b, num_inflight=3)
        assert delay == pytest.approx(expected, rel=1e-9) or (np.isinf(delay) and np.isinf(expected))


@pytest.mark.parametrize("seed", range(3))
def test_memoised_scorer_scores_like_a_fresh_one(seed: int) -> None:
    """The scorer memoises profiles and link terms across arrangements: after scoring many
    arrangements that share groups, each score is exactly a fresh scorer's."""
    rng = np.random.default_rng(seed)
    model = build_transformer_profile(num_layers=6, hidden_size=4096, sequence_length=1024)
    snapshot = build_region_snapshot(rng, num_devices=9, num_regions=3, model=model, unreliable_fraction=0.4)
    reliable, unreliable = snapshot.reliable_indices(), snapshot.unreliable_indices()
    shared = ArrangementScorer(snapshot)
    for _ in range(12):
        servers = rng.permutation(reliable)
        cut = int(rng.integers(1, len(servers))) if len(servers) > 1 else 1
        clients = [c for c in unreliable if rng.random() < 0.5]
        arrangement = [
            (tuple(sorted(servers[:cut].tolist())), tuple(clients)),
            (tuple(sorted(servers[cut:].tolist())), ()),
        ]
        arrangement = [stage for stage in arrangement if stage[0]]
        assert shared.score(arrangement) == ArrangementScorer(snapshot).score(arrangement)
        bounds, _ = shared.score(arrangement)
        fresh = ArrangementScorer(snapshot)
        assert shared.score_with_bounds(arrangement, bounds) == fresh.score_with_bounds(arrangement, bounds)
        assert shared.round_trip(arrangement, bounds) == fresh.round_trip(arrangement, bounds)


@pytest.mark.parametrize("seed", range(3))
def test_ranges_with_equal_figures_are_filled_once_with_the_same_result(seed: int) -> None:
    """``compute_range_delays`` fills each distinct set of range figures once (identical layers
    give many): every range's delay must be exactly what it gets computed alone."""
    rng = np.random.default_rng(seed)
    model = build_transformer_profile(num_layers=8, hidden_size=2048, sequence_length=1024)
    snapshot = build_region_snapshot(rng, num_devices=8, num_regions=2, model=model, unreliable_fraction=0.4)
    group = profile_group(
        snapshot, np.array(snapshot.reliable_indices()[:3]), np.array(snapshot.unreliable_indices(), dtype=np.int64)
    )
    starts, ends = np.triu_indices(9, k=1)
    delays = compute_range_delays(model, group, starts, ends, num_inflight=2)
    for a, b, delay in zip(starts.tolist(), ends.tolist(), delays.tolist()):
        alone = compute_range_delays(model, group, np.array([a]), np.array([b]), num_inflight=2)
        assert delay == alone[0] or (np.isnan(delay) and np.isnan(alone[0]))


@pytest.mark.parametrize("seed", range(3))
def test_group_profile_and_link_terms_read_the_cached_link_figures_exactly(seed: int) -> None:
    """``profile_group`` and ``estimate_link_terms`` read the snapshot's cached ``1 / beta`` and
    two-way means: their figures must be exactly those from the raw matrices."""
    rng = np.random.default_rng(seed)
    snapshot = build_region_snapshot(rng, num_devices=11, num_regions=3, model=MODEL_FOR_LINKS, unreliable_fraction=0.4)
    latency, bandwidth = snapshot.links.latency_delay, snapshot.links.bandwidth
    order = rng.permutation(11)
    servers, clients, receivers = np.sort(order[:3]), np.sort(order[3:8]), np.sort(order[8:])
    group = profile_group(snapshot, servers, clients)
    alpha = (latency[np.ix_(clients, servers)] + latency[np.ix_(servers, clients)].T) / 2
    per_byte = (1.0 / bandwidth[np.ix_(clients, servers)] + 1.0 / bandwidth[np.ix_(servers, clients)].T) / 2
    ratio = snapshot.runtime.boundary_compression_ratio
    members = np.concatenate([servers, clients])
    assert np.array_equal(group.offset_delays[3:], 4.0 * alpha.mean(axis=1))
    assert np.array_equal(group.inverse_bandwidths[3:], 2.0 * ratio * per_byte.mean(axis=1))
    assert group.averaging_per_byte == 2.0 * float((1.0 / bandwidth[np.ix_(members, servers)]).mean(axis=1).max())
    terms = estimate_link_terms(snapshot, servers, receivers)
    scale = ratio / min(servers.size, receivers.size)
    assert terms.forward_per_byte == float((1.0 / bandwidth[np.ix_(servers, receivers)]).mean()) * scale
    assert terms.backward_per_byte == float((1.0 / bandwidth[np.ix_(receivers, servers)]).mean()) * scale
    assert not snapshot.links.inverse_bandwidth.flags.writeable


def test_the_exchange_every_step_costs_each_replica_a_send_to_every_other_not_a_butterflys_share() -> None:
    """Under ``averaging_period`` 0 the runtime's replicas each send their whole gradient sum to every
    co-replica (swarm.gradient_sync): at n replicas that is n / 2 times a butterfly all-reduce's bytes,
    which periodic rounds (hivemind) use. Two replicas cost the same either way."""
    rng = np.random.default_rng(7)
    snapshot = build_region_snapshot(rng, num_devices=6, num_regions=2, model=MODEL_FOR_LINKS, unreliable_fraction=0.0)
    inverse = 1.0 / snapshot.links.bandwidth
    every_step = replace(snapshot, runtime=replace(snapshot.runtime, averaging_period=0.0))
    for servers in (np.array([0, 3]), np.array([0, 1, 4]), np.arange(6)):
        sums = inverse[np.ix_(servers, servers)].sum(axis=1).max()  # the diagonal's 1 / inf is 0
        exchange = profile_group(every_step, servers, np.array([], dtype=np.int64)).averaging_per_byte
        butterfly = profile_group(snapshot, servers, np.array([], dtype=np.int64)).averaging_per_byte
        assert exchange == pytest.approx(sums) and butterfly == pytest.approx(2 * sums / servers.size)
        assert exchange == pytest.approx(butterfly * servers.size / 2)
