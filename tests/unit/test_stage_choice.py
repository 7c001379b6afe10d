"""Stage choice at join time: brute force as the oracle, permutation invariance, input checks."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.stage_choice import Joiner, StageMember, assign_joiners, choose_stage, stage_throughputs


def brute_force_stage(stage_costs: list[float], members: list[StageMember], flops: float) -> int:
    """Try the joiner on every stage; keep the one whose resulting bottleneck is highest.

    Among stages that give the same bottleneck, the one whose throughput before joining is lowest,
    then the lowest index, is what the module documents.
    """
    before = stage_throughputs(stage_costs, members)
    best_key, best_stage = None, -1
    for k in range(len(stage_costs)):
        after = stage_throughputs(stage_costs, [*members, StageMember(peer_id="~joiner", stage=k, flops=flops)])
        key = (-min(after), before[k], k)
        if best_key is None or key < best_key:
            best_key, best_stage = key, k
    return best_stage


def bottleneck_after(stage_costs, members, stage, flops) -> float:
    return min(stage_throughputs(stage_costs, [*members, StageMember(peer_id="~joiner", stage=stage, flops=flops)]))


def test_empty_swarm_fills_stages_in_index_order():
    costs = [3.0, 1.0, 2.0, 5.0]
    joiners = [Joiner(peer_id=f"p{i}", flops=10.0, announced_at=float(i)) for i in range(4)]
    assert assign_joiners(costs, [], joiners) == {"p0": 0, "p1": 1, "p2": 2, "p3": 3}
    assert choose_stage(costs, []) == 0


def test_equal_stages_tie_to_lowest_index():
    members = [StageMember(peer_id="a", stage=1, flops=5.0), StageMember(peer_id="b", stage=2, flops=5.0)]
    assert choose_stage([1.0, 1.0, 1.0], members) == 0
    members.append(StageMember(peer_id="c", stage=0, flops=5.0))
    assert choose_stage([1.0, 1.0, 1.0], members) == 0


def test_fast_peer_counts_more_than_a_slow_one():
    # stage 0 has one fast GPU, stage 1 has three slow laptops: stage 1 still has the deficit
    members = [StageMember(peer_id="gpu", stage=0, flops=100.0)] + [
        StageMember(peer_id=f"laptop{i}", stage=1, flops=10.0) for i in range(3)
    ]
    assert choose_stage([1.0, 1.0], members) == 1
    # ... unless stage 0 is ten times as expensive per sample
    assert choose_stage([20.0, 1.0], members) == 0


def test_throughputs_are_flops_over_cost():
    members = [StageMember(peer_id="a", stage=0, flops=6.0), StageMember(peer_id="b", stage=0, flops=2.0),
               StageMember(peer_id="c", stage=1, flops=9.0)]
    assert stage_throughputs([2.0, 3.0, 1.0], members) == [4.0, 3.0, 0.0]


@pytest.mark.parametrize("seed", range(300))
def test_choose_stage_matches_brute_force_oracle(seed):
    rng = random.Random(seed)
    num_stages = rng.randint(1, 4)
    costs = [float(rng.choice([1, 2, 3, 4])) for _ in range(num_stages)]
    members = [
        StageMember(peer_id=f"m{i}", stage=rng.randrange(num_stages), flops=float(rng.choice([0, 1, 2, 3, 6, 12])))
        for i in range(rng.randint(0, 6))
    ]
    flops = float(rng.choice([1, 2, 5, 12]))
    chosen = choose_stage(costs, members)
    oracle = brute_force_stage(costs, members, flops)
    # chosen stage reaches the best achievable bottleneck ...
    assert bottleneck_after(costs, members, chosen, flops) == bottleneck_after(costs, members, oracle, flops)
    # ... and, with ties broken as documented, it is exactly the oracle's choice
    assert chosen == oracle


def test_every_stage_is_tried_exhaustively_for_tiny_instances():
    """All members layouts of 2 peers over 2-3 stages with a few speeds: choice is never beaten."""
    speeds = (1.0, 3.0)
    for num_stages in (1, 2, 3):
        costs = [float(k + 1) for k in range(num_stages)]
        for layout in itertools.product(range(num_stages), repeat=2):
            for fl in itertools.product(speeds, repeat=2):
                members = [StageMember(peer_id=f"m{i}", stage=s, flops=f) for i, (s, f) in enumerate(zip(layout, fl))]
                chosen = choose_stage(costs, members)
                best = max(bottleneck_after(costs, members, k, 2.0) for k in range(num_stages))
                assert bottleneck_after(costs, members, chosen, 2.0) == best
                assert chosen == brute_force_stage(costs, members, 2.0)


members_strategy = st.lists(
    st.tuples(st.integers(0, 3), st.sampled_from([0.5, 1.0, 2.0, 7.0, 1e12])), max_size=6
)
joiners_strategy = st.lists(
    st.tuples(st.sampled_from([1.0, 3.0, 1e12]), st.sampled_from([0.0, 1.0, 2.0])), max_size=6
)


@settings(max_examples=50, deadline=None)
@given(
    costs=st.lists(st.sampled_from([0.1, 1.0, 2.5, 3.0, 1e9]), min_size=4, max_size=4),
    member_specs=members_strategy,
    joiner_specs=joiners_strategy,
    shuffle_seed=st.integers(0, 2**32 - 1),
)
def test_assign_joiners_is_invariant_under_permutation(costs, member_specs, joiner_specs, shuffle_seed):
    members = [StageMember(peer_id=f"m{i:02d}", stage=s, flops=f) for i, (s, f) in enumerate(member_specs)]
    joiners = [Joiner(peer_id=f"j{i:02d}", flops=f, announced_at=t) for i, (f, t) in enumerate(joiner_specs)]
    expected = assign_joiners(costs, members, joiners)
    rng = random.Random(shuffle_seed)
    for _ in range(3):
        shuffled_members, shuffled_joiners = members[:], joiners[:]
        rng.shuffle(shuffled_members)
        rng.shuffle(shuffled_joiners)
        assert assign_joiners(costs, shuffled_members, shuffled_joiners) == expected
        # also as tuples: any Sequence
        assert assign_joiners(tuple(costs), tuple(shuffled_members), tuple(shuffled_joiners)) == expected
    assert set(expected) == {j.peer_id for j in joiners}
    assert all(0 <= k < len(costs) for k in expected.values())


@settings(max_examples=30, deadline=None)
@given(joiner_specs=joiners_strategy, num_stages=st.integers(1, 4))
def test_each_joiner_is_placed_on_the_deficit_stage_at_its_turn(joiner_specs, num_stages):
    costs = [1.0 + k for k in range(num_stages)]
    joiners = [Joiner(peer_id=f"j{i}", flops=f, announced_at=t) for i, (f, t) in enumerate(joiner_specs)]
    result = assign_joiners(costs, [], joiners)
    placed: list[StageMember] = []
    for joiner in sorted(joiners, key=lambda j: (j.announced_at, j.peer_id)):
        assert result[joiner.peer_id] == brute_force_stage(costs, placed, joiner.flops)
        placed.append(StageMember(peer_id=joiner.peer_id, stage=result[joiner.peer_id], flops=joiner.flops))


def test_every_evaluator_computes_the_same_assignment():
    """Peers each evaluate the same snapshot from their own (differently ordered) copy of it."""
    rng = random.Random(7)
    costs = [1.3, 0.7, 2.9]
    members = [StageMember(peer_id=f"peer-{rng.getrandbits(40):x}", stage=rng.randrange(3), flops=rng.uniform(0.1, 10))
               for _ in range(20)]
    joiners = [Joiner(peer_id=f"join-{i}", flops=rng.uniform(0.1, 10), announced_at=rng.choice([5.0, 6.0]))
               for i in range(8)]
    results = []
    for evaluator in range(10):
        view_rng = random.Random(evaluator)
        m, j = members[:], joiners[:]
        view_rng.shuffle(m)
        view_rng.shuffle(j)
        results.append(assign_joiners(costs, m, j))
    assert all(r == results[0] for r in results)
    # concurrent joiners into an empty swarm spread over the stages instead of all taking one
    assert set(assign_joiners(costs, [], joiners).values()) == {0, 1, 2}


def test_earlier_joiner_is_placed_first_then_peer_id_breaks_ties():
    costs = [1.0, 1.0]
    late = Joiner(peer_id="a", flops=1.0, announced_at=2.0)
    early = Joiner(peer_id="z", flops=1.0, announced_at=1.0)
    assert assign_joiners(costs, [], [late, early]) == {"z": 0, "a": 1}
    same_time = [Joiner(peer_id="b", flops=1.0, announced_at=1.0), Joiner(peer_id="a", flops=1.0, announced_at=1.0)]
    assert assign_joiners(costs, [], same_time) == {"a": 0, "b": 1}


def test_no_joiners_gives_empty_assignment():
    assert assign_joiners([1.0], [StageMember(peer_id="a", stage=0, flops=1.0)], []) == {}


@pytest.mark.parametrize("stage", [-1, 2, 10])
def test_member_on_a_stage_outside_the_run_is_rejected(stage):
    members = [StageMember(peer_id="bad", stage=stage, flops=1.0)]
    with pytest.raises(ValueError, match="bad"):
        choose_stage([1.0, 1.0], members)
    with pytest.raises(ValueError):
        stage_throughputs([1.0, 1.0], members)
    with pytest.raises(ValueError):
        assign_joiners([1.0, 1.0], members, [Joiner(peer_id="j", flops=1.0, announced_at=0.0)])


@pytest.mark.parametrize("costs", [[], [0.0], [1.0, -1.0], [float("nan")], [1.0, float("nan")]])
def test_bad_stage_costs_are_rejected(costs):
    with pytest.raises(ValueError):
        choose_stage(costs, [])
    with pytest.raises(ValueError):
        stage_throughputs(costs, [])
    with pytest.raises(ValueError):
        assign_joiners(costs, [], [Joiner(peer_id="j", flops=1.0, announced_at=0.0)])


def test_duplicate_joiner_is_rejected():
    joiners = [Joiner(peer_id="j", flops=1.0, announced_at=0.0), Joiner(peer_id="j", flops=2.0, announced_at=3.0)]
    with pytest.raises(ValueError, match="twice"):
        assign_joiners([1.0, 1.0], [], joiners)


def test_negative_flops_count_as_zero():
    members = [StageMember(peer_id="a", stage=0, flops=-5.0)]
    assert stage_throughputs([1.0, 1.0], members) == [0.0, 0.0]
    assert choose_stage([1.0, 1.0], members) == 0


# ---- rebalancing: choose_move ---------------------------------------------------------------------

from planner.stage_choice import StageMove, choose_move  # noqa: E402


def brute_force_move(stage_costs, members, min_gain):
    """Every single move of every peer to every other stage; the best that clears min_gain."""
    before = min(stage_throughputs(stage_costs, members))
    counts = [sum(1 for m in members if m.stage == k) for k in range(len(stage_costs))]
    if 0 in counts:
        return None
    best = None
    for member in members:
        if counts[member.stage] < 2:
            continue
        for k in range(len(stage_costs)):
            if k == member.stage:
                continue
            moved = [m if m is not member else StageMember(peer_id=m.peer_id, stage=k, flops=m.flops) for m in members]
            after = min(stage_throughputs(stage_costs, moved))
            if best is None or after > best[0] + 1e-12:
                best = (after, member, k)
    if best is None or best[0] <= before * (1 + min_gain):
        return None
    return best


@pytest.mark.parametrize("seed", range(300))
def test_choose_move_reaches_the_brute_force_bottleneck(seed):
    rng = random.Random(seed)
    num_stages = rng.randint(1, 4)
    costs = [rng.uniform(1.0, 4.0) for _ in range(num_stages)]
    members = [StageMember(peer_id=f"p{i}", stage=rng.randrange(num_stages), flops=rng.uniform(1.0, 10.0))
               for i in range(rng.randint(1, 8))]
    min_gain = rng.choice([0.0, 0.05, 0.2])
    move, oracle = choose_move(costs, members, min_gain=min_gain), brute_force_move(costs, members, min_gain)
    if oracle is None:
        assert move is None
        return
    assert move is not None
    assert move.bottleneck_after == pytest.approx(oracle[0], rel=1e-9)
    moved = [m if m.peer_id != move.peer_id else StageMember(peer_id=m.peer_id, stage=move.to_stage, flops=m.flops)
             for m in members]
    assert min(stage_throughputs(costs, moved)) == pytest.approx(move.bottleneck_after, rel=1e-9)
    assert move.gain >= min_gain - 1e-12
    # the stage it leaves keeps a member
    assert any(m.stage == move.from_stage for m in moved)


def test_a_balanced_swarm_moves_nobody_and_noise_is_below_the_threshold():
    costs = [1.0, 1.0]
    members = [StageMember(peer_id="a", stage=0, flops=10.0), StageMember(peer_id="b", stage=0, flops=10.5),
               StageMember(peer_id="c", stage=1, flops=9.8), StageMember(peer_id="d", stage=1, flops=10.1)]
    assert choose_move(costs, members, min_gain=0.1) is None


def test_after_a_leave_the_slower_spare_peer_moves_to_the_bottleneck():
    costs = [1.0, 1.0]
    members = [StageMember(peer_id="a", stage=0, flops=10.0), StageMember(peer_id="b", stage=0, flops=8.0),
               StageMember(peer_id="c", stage=0, flops=12.0), StageMember(peer_id="d", stage=1, flops=10.0)]
    move = choose_move(costs, members, min_gain=0.1)
    # moving b (8) gives min(22, 18) = 18; a gives min(20, 20) = 20; c gives min(18, 22) = 18
    assert move == StageMove(peer_id="a", from_stage=0, to_stage=1, bottleneck_before=10.0, bottleneck_after=20.0)
    assert move.gain == pytest.approx(1.0)


def test_a_move_is_never_undone_by_the_next_decision():
    rng = random.Random(7)
    for _ in range(200):
        costs = [rng.uniform(1, 3) for _ in range(rng.randint(2, 4))]
        members = [StageMember(peer_id=f"p{i}", stage=rng.randrange(len(costs)), flops=rng.uniform(1, 10))
                   for i in range(rng.randint(2, 9))]
        for _ in range(10):  # apply moves until none is left: it must stop, and never go back
            move = choose_move(costs, members, min_gain=0.05)
            if move is None:
                break
            members = [m if m.peer_id != move.peer_id else StageMember(peer_id=m.peer_id, stage=move.to_stage,
                                                                        flops=m.flops) for m in members]
            again = choose_move(costs, members, min_gain=0.05)
            assert again is None or (again.peer_id, again.to_stage) != (move.peer_id, move.from_stage)
            assert again is None or again.bottleneck_after > move.bottleneck_after
        else:
            pytest.fail("moves did not settle within 10 decisions")


def test_a_pinned_peer_is_never_moved_but_counts_where_it_is():
    costs = [1.0, 1.0]
    members = [StageMember(peer_id="a", stage=0, flops=10.0), StageMember(peer_id="b", stage=0, flops=8.0),
               StageMember(peer_id="c", stage=0, flops=12.0), StageMember(peer_id="d", stage=1, flops=10.0)]
    assert choose_move(costs, members, min_gain=0.1).peer_id == "a"
    move = choose_move(costs, members, min_gain=0.1, pinned={"a"})  # next best: b and c tie at 18, b slower
    assert (move.peer_id, move.bottleneck_after) == ("b", 18.0)
    assert choose_move(costs, members, min_gain=0.1, pinned={"a", "b", "c"}) is None


def test_an_unheld_stage_stops_rebalancing_and_no_stage_is_emptied():
    costs = [1.0, 1.0, 1.0]
    assert choose_move(costs, [StageMember(peer_id="a", stage=0, flops=1.0),
                               StageMember(peer_id="b", stage=0, flops=1.0),
                               StageMember(peer_id="c", stage=1, flops=1.0)], min_gain=0.0) is None
    lone = [StageMember(peer_id="a", stage=0, flops=100.0), StageMember(peer_id="b", stage=1, flops=1.0)]
    assert choose_move([1.0, 1.0], lone, min_gain=0.0) is None


@given(st.permutations(range(6)))
@settings(max_examples=50, deadline=None)
def test_choose_move_does_not_depend_on_the_order_of_records(order):
    base = [StageMember(peer_id=f"p{i}", stage=0 if i < 4 else 1, flops=5.0 + i) for i in range(6)]
    expected = choose_move([1.0, 2.0], base, min_gain=0.1)
    assert choose_move([1.0, 2.0], [base[i] for i in order], min_gain=0.1) == expected


def test_min_gain_must_not_be_negative():
    with pytest.raises(ValueError):
        choose_move([1.0], [StageMember(peer_id="a", stage=0, flops=1.0)], min_gain=-0.1)
