"""Layer-wise re-planning after a failure (seed 001 §3.4)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costs import estimate_throughput
from planner.plan import Plan, Stage
from planner.replanning import replan_after_failure, split_by_capacity
from planner.scenarios import build_transformer_profile
from planner.snapshot import Device, LinkMatrix, SwarmSnapshot

MODEL = build_transformer_profile(num_layers=8, hidden_size=1024, sequence_length=256)


def _snapshot(flops: list[float], unreliable: set[int] = frozenset()) -> SwarmSnapshot:
    n = len(flops)
    devices = tuple(
        Device(peer_id=f"p{i}", flops=f, memory_bytes=10**11, is_reliable=i not in unreliable)
        for i, f in enumerate(flops)
    )
    links = LinkMatrix(latency_delay=np.full((n, n), 0.01), bandwidth=np.full((n, n), 1e8))
    return SwarmSnapshot(devices=devices, links=links, model=MODEL)


def _plan() -> Plan:
    return Plan(stages=(
        Stage(layer_start=0, layer_end=3, server_ids=("p0", "p1")),
        Stage(layer_start=3, layer_end=5, server_ids=("p2",), client_ids=("p5",)),
        Stage(layer_start=5, layer_end=8, server_ids=("p3", "p4")),
    ))


def test_failure_inside_a_stage_moves_no_layer() -> None:
    snapshot = _snapshot([1e13] * 6, unreliable={5})
    decision = replan_after_failure(snapshot, _plan(), {"p1"})
    assert decision.migrations == ()
    assert [(s.layer_start, s.layer_end) for s in decision.plan.stages] == [(0, 3), (3, 5), (5, 8)]
    assert "p1" not in decision.plan.assigned_peer_ids()


def test_vanished_stage_layers_go_to_neighbours_by_capacity() -> None:
    snapshot = _snapshot([1e13] * 6, unreliable={5})
    decision = replan_after_failure(snapshot, _plan(), {"p2"})
    plan = decision.plan
    assert plan.num_stages == 2 and decision.released_peer_ids == ("p5",)
    assert [(s.layer_start, s.layer_end) for s in plan.stages] == [(0, 4), (4, 8)]
    moved = {(m.layer, m.from_stage, m.to_stage) for m in decision.migrations}
    assert moved == {(3, None, 0), (4, None, 1)}  # only the vanished stage's layers move
    assert estimate_throughput(snapshot, plan) > 0


@settings(max_examples=30, deadline=None)
@given(
    flops=st.lists(st.floats(1.0, 100.0), min_size=4, max_size=8),
    capacities=st.lists(st.floats(1.0, 10.0), min_size=1, max_size=4),
)
def test_capacity_split_is_the_closest_prefix_split(flops: list[float], capacities: list[float]) -> None:
    bounds = split_by_capacity(tuple(flops), np.array(capacities))
    assert len(bounds) == len(capacities) and bounds[-1] == len(flops)
    assert all(a < b for a, b in zip((0,) + bounds[:-1], bounds))
    # Brute force: no valid split has a smaller worst deviation of any boundary from its target.
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    targets = prefix[-1] * np.cumsum(capacities) / sum(capacities)

    def error(cuts: tuple[int, ...]) -> float:
        return float(max((abs(prefix[c] - t) for c, t in zip(cuts, targets[:-1])), default=0.0))

    best = min(error(c) for c in itertools.combinations(range(1, len(flops)), len(capacities) - 1))
    assert error(bounds[:-1]) <= best * 1.0 + max(flops)


def test_all_servers_lost_raises() -> None:
    snapshot = _snapshot([1e13] * 6, unreliable={5})
    with pytest.raises(ValueError):
        replan_after_failure(snapshot, _plan(), {"p0", "p1", "p2", "p3", "p4"})
