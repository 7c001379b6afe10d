"""Layer-wise re-planning after a failure (seed 001 §3.4)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costs import estimate_throughput
from planner.offline.scenarios import build_transformer_profile
from planner.plan import Plan, Stage
from planner.replanning import replan_after_failure, split_by_capacity
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


# --- a running swarm's layout (peer/relayout.py): replan_layout and choose_layout ---

from planner.replanning import VANISHED, Layout, MemoryBudgetError, choose_layout, replan_layout  # noqa: E402
from planner.stage_choice import StageMember  # noqa: E402

THREE = ((0, 2), (2, 4), (4, 6))


def _members(*stage_flops: tuple[int, float]) -> list[StageMember]:
    return [StageMember(peer_id=f"p{i}", stage=stage, flops=flops) for i, (stage, flops) in enumerate(stage_flops)]


def test_replan_layout_removes_the_unheld_stage_and_splits_by_capacity() -> None:
    replan = replan_layout(THREE, (1.0,) * 6, _members((0, 1e9), (2, 1e9)))
    assert replan.stage_layers == ((0, 3), (3, 6))
    assert replan.stage_map == (0, None, 1)
    assert {(m.layer, m.from_stage, m.to_stage) for m in replan.migrations} == {(2, None, 0), (3, None, 1)}
    faster_last = replan_layout(THREE, (1.0,) * 6, _members((0, 1e9), (2, 2e9)))
    assert faster_last.stage_layers == ((0, 2), (2, 6)), "the stronger survivor takes more layers"
    heavy_head = replan_layout(THREE, (1.0,) * 5 + (3.0,), _members((0, 1e9), (2, 1e9)))
    assert heavy_head.stage_layers == ((0, 4), (4, 6)), "layer costs count, not layer numbers"


def test_replan_layout_is_none_when_every_stage_is_held_and_refuses_an_empty_swarm() -> None:
    assert replan_layout(THREE, (1.0,) * 6, _members((0, 1.0), (1, 1.0), (2, 1.0))) is None
    with pytest.raises(ValueError):
        replan_layout(THREE, (1.0,) * 6, [])
    with pytest.raises(ValueError):
        replan_layout(THREE, (1.0,) * 5, _members((0, 1.0)))
    with pytest.raises(ValueError):
        replan_layout(THREE, (1.0,) * 6, _members((3, 1.0)))


@settings(max_examples=40, deadline=None)
@given(
    bounds=st.lists(st.integers(1, 3), min_size=2, max_size=6),
    holders=st.lists(st.tuples(st.integers(0, 5), st.floats(1e6, 1e12)), min_size=1, max_size=8),
    seed=st.integers(0, 1000),
)
def test_replan_layout_properties(bounds: list[int], holders: list[tuple[int, float]], seed: int) -> None:
    ends = list(itertools.accumulate(bounds))
    layers = tuple(zip([0, *ends[:-1]], ends, strict=True))
    members = [m for m in _members(*holders) if m.stage < len(layers)]
    held = {m.stage for m in members}
    if not held:
        return
    replan = replan_layout(layers, (1.0,) * ends[-1], members)
    if len(held) == len(layers):
        assert replan is None
        return
    assert len(replan.stage_layers) == len(held)
    assert replan.stage_layers[0][0] == 0 and replan.stage_layers[-1][1] == ends[-1]
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(replan.stage_layers)), "every layer exactly once"
    assert [k for k in replan.stage_map if k is not None] == list(range(len(held))), "survivors keep their order"
    assert all((replan.stage_map[k] is None) == (k not in held) for k in range(len(layers)))
    shuffled = list(members)
    np.random.default_rng(seed).shuffle(shuffled)
    assert replan_layout(layers, (1.0,) * ends[-1], shuffled) == replan, "order of peers does not matter"
    assert not any(m.peer_id.startswith(VANISHED) for m in members)


def test_replan_layout_keeps_every_stage_within_its_members_memory() -> None:
    # by capacity the faster last survivor would take layers 2-5 (4 layers), but it can hold only 3
    members = [StageMember(peer_id="a", stage=0, flops=1e9, memory_bytes=10e6),
               StageMember(peer_id="b", stage=2, flops=2e9, memory_bytes=3.5e6 + 1e6)]
    unlimited = replan_layout(THREE, (1.0,) * 6, members)
    assert unlimited.stage_layers == ((0, 2), (2, 6))
    replan = replan_layout(THREE, (1.0,) * 6, members, layer_bytes=(1e6,) * 6, overhead_bytes=1e6)
    assert replan.stage_layers == ((0, 3), (3, 6)), "the fastest split that fits"
    assert {(m.layer, m.from_stage, m.to_stage) for m in replan.migrations} == {(2, None, 0), (3, None, 1)}
    # the smallest budget of a stage binds: one more small member of stage 0 leaves no room for 3 layers there
    small = StageMember(peer_id="c", stage=0, flops=1e9, memory_bytes=2.5e6 + 1e6)
    with pytest.raises(MemoryBudgetError, match="fits"):
        replan_layout(THREE, (1.0,) * 6, [*members, small], layer_bytes=(1e6,) * 6, overhead_bytes=1e6)
    # members that did not state a budget do not limit
    quiet = [StageMember(peer_id=m.peer_id, stage=m.stage, flops=m.flops) for m in members]
    assert replan_layout(THREE, (1.0,) * 6, quiet, layer_bytes=(1e6,) * 6) == unlimited


@settings(max_examples=60, deadline=None)
@given(
    layer_bytes=st.lists(st.integers(1, 4), min_size=3, max_size=7),
    holders=st.lists(st.tuples(st.integers(0, 2), st.floats(1e6, 1e12), st.integers(0, 12)), min_size=1, max_size=5),
)
def test_replan_layout_respects_budgets_and_refuses_only_what_nothing_fits(
        layer_bytes: list[int], holders: list[tuple[int, float, int]]) -> None:
    num_layers = len(layer_bytes)
    layers = ((0, 1), (1, 2), (2, num_layers))
    members = [StageMember(peer_id=f"p{i}", stage=stage, flops=flops, memory_bytes=float(memory))
               for i, (stage, flops, memory) in enumerate(holders)]
    survivors = sorted({m.stage for m in members})
    if len(survivors) == len(layers):
        return
    budgets = [min([m.memory_bytes for m in members if m.stage == k and m.memory_bytes > 0], default=np.inf)
               for k in survivors]
    # brute force: every split of the layers into len(survivors) contiguous non-empty ranges
    fitting = [cuts for cuts in itertools.combinations(range(1, num_layers), len(survivors) - 1)
               if all(sum(layer_bytes[a:b]) <= budget
                      for (a, b), budget in zip(itertools.pairwise((0, *cuts, num_layers)), budgets, strict=True))]
    try:
        replan = replan_layout(layers, (1.0,) * num_layers, members, layer_bytes=tuple(map(float, layer_bytes)))
    except MemoryBudgetError:
        assert not fitting, "a split that fits existed"
        return
    assert fitting
    assert all(sum(layer_bytes[a:b]) <= budget for (a, b), budget in zip(replan.stage_layers, budgets, strict=True))
    assert replan.stage_layers[0][0] == 0 and replan.stage_layers[-1][1] == num_layers
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(replan.stage_layers))


def test_choose_layout_takes_the_next_version_only_when_the_view_agrees() -> None:
    current = Layout(version=0, stage_layers=THREE)
    next_two = Layout(version=1, stage_layers=((0, 3), (3, 6)))
    next_one = Layout(version=1, stage_layers=((0, 6),))
    assert choose_layout(current, [next_two], num_unheld=1, alone=False) == next_two
    assert choose_layout(current, [next_two], num_unheld=0, alone=False) is None, "every stage held here"
    assert choose_layout(current, [next_one], num_unheld=1, alone=False) is None, "drops more than is unheld"
    assert choose_layout(current, [Layout(version=5, stage_layers=((0, 6),))], num_unheld=2, alone=False) is None
    assert choose_layout(current, [Layout(version=5, stage_layers=((0, 6),))], num_unheld=0, alone=True).version == 5
    assert choose_layout(current, [current], num_unheld=1, alone=False) is None
    assert choose_layout(next_two, [current], num_unheld=2, alone=True) is None, "never back to an older layout"


def test_choose_layout_converges_between_concurrent_replans() -> None:
    a = Layout(version=1, stage_layers=((0, 3), (3, 6)))
    b = Layout(version=1, stage_layers=((0, 2), (2, 6)))
    assert choose_layout(a, [b], num_unheld=0, alone=False) == b
    assert choose_layout(b, [a], num_unheld=0, alone=False) is None
    parent = Layout(version=0, stage_layers=THREE)
    assert choose_layout(parent, [a, b], num_unheld=1, alone=False) == b
    assert choose_layout(parent, [b, a], num_unheld=1, alone=False) == b
    c = Layout(version=2, stage_layers=((0, 6),))
    assert choose_layout(a, [b, c], num_unheld=1, alone=False) == c, "a newer version goes first"


def test_of_two_replans_of_one_version_the_one_that_kept_more_stages_wins() -> None:
    """CI: one survivor's view lost the other's record and pings for a while, so it dropped that
    peer's stage too: two v1 layouts of 2 and 1 stages. The one that dropped only the lost stage wins."""
    kept_two = Layout(version=1, stage_layers=((0, 2), (2, 4)))
    kept_one = Layout(version=1, stage_layers=((0, 4),))
    assert choose_layout(kept_one, [kept_two], num_unheld=0, alone=False) == kept_two
    assert choose_layout(kept_two, [kept_one], num_unheld=1, alone=False) is None
    assert choose_layout(kept_one, [kept_two], num_unheld=0, alone=True) == kept_two
    parent = Layout(version=0, stage_layers=((0, 1), (1, 3), (3, 4)))
    assert choose_layout(parent, [kept_one, kept_two], num_unheld=2, alone=False) == kept_two
