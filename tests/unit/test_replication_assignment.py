"""Greedy LPT shard assignment and binary search on s (seed 003 §III), against brute force."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replication.assignment import (
    NeighbourLink,
    SearchConfig,
    ShardAssignment,
    assign_shards_greedy,
    count_shards,
    list_shard_sizes,
    plan_replication,
    replan,
)


def solve_optimal_makespan(
    shard_sizes: Mapping[int, int], neighbours: Sequence[NeighbourLink], *, now: float
) -> float:
    """Test oracle: the optimal makespan of P3 by trying all |U|^K assignments (vectorised).

    Within one neighbour the order of its shards does not change its finish time, so an
    assignment is fully described by which neighbour sends each shard.
    """
    sizes = np.array(list(shard_sizes.values()), dtype=np.float64)
    num_links = len(neighbours)
    if sizes.size == 0:
        return now
    choices = np.indices((num_links,) * sizes.size).reshape(sizes.size, -1).T
    makespan = np.full(choices.shape[0], -np.inf)
    for u, link in enumerate(neighbours):
        mask = choices == u
        count = mask.sum(axis=1)
        sent_bytes = mask.astype(np.float64) @ sizes
        finish = (
            max(link.free_time, now) + count * link.propagation_delay
            + sent_bytes * link.per_byte_delay
        )
        makespan = np.maximum(makespan, np.where(count > 0, finish, -np.inf))
    return float(makespan.min())


def make_links(rng: random.Random, num_links: int, *, identical: bool) -> list[NeighbourLink]:
    if identical:
        delay, rate = rng.uniform(0.0, 0.5), rng.uniform(0.1, 2.0)
        return [NeighbourLink(peer_id=f"p{i}", propagation_delay=delay, per_byte_delay=rate)
                for i in range(num_links)]
    return [
        NeighbourLink(
            peer_id=f"p{i}",
            propagation_delay=rng.uniform(0.0, 1.0),
            per_byte_delay=rng.uniform(0.1, 2.0),
            free_time=rng.choice([0.0, rng.uniform(0.0, 3.0)]),
        )
        for i in range(num_links)
    ]


def graham_bound(num_links: int) -> float:
    return 4.0 / 3.0 - 1.0 / (3.0 * num_links)


def test_equal_shards_heterogeneous_links_within_graham_bound() -> None:
    """Equal-size shards (the paper's setting): greedy is in fact optimal; Graham's bound holds."""
    rng = random.Random(3)
    ratios = []
    for _ in range(150):
        num_links, num_shards = rng.randint(1, 4), rng.randint(1, 7)
        links = make_links(rng, num_links, identical=False)
        shards = {i: 5 for i in range(num_shards)}
        greedy = assign_shards_greedy(shards, links, now=0.0).makespan
        optimum = solve_optimal_makespan(shards, links, now=0.0)
        ratios.append(greedy / optimum)
        assert greedy <= graham_bound(num_links) * optimum + 1e-9
        assert greedy == pytest.approx(optimum, rel=1e-12)
    print(f"equal shards, heterogeneous links: mean ratio {np.mean(ratios):.4f}, "
          f"worst {max(ratios):.4f}")


def test_identical_links_unequal_shards_within_graham_bound() -> None:
    """Identical neighbours, arbitrary sizes: P||Cmax, where Graham's LPT bound applies."""
    rng = random.Random(5)
    ratios = []
    for _ in range(200):
        num_links = rng.randint(2, 4)
        num_shards = rng.randint(2, 8 if num_links < 4 else 7)
        links = make_links(rng, num_links, identical=True)
        shards = {i: rng.randint(1, 20) for i in range(num_shards)}
        greedy = assign_shards_greedy(shards, links, now=0.0).makespan
        optimum = solve_optimal_makespan(shards, links, now=0.0)
        ratios.append(greedy / optimum)
        assert optimum - 1e-9 <= greedy <= graham_bound(num_links) * optimum + 1e-9
    print(f"identical links, unequal shards: mean ratio {np.mean(ratios):.4f}, "
          f"worst {max(ratios):.4f}")
    assert max(ratios) > 1.0  # the instances are hard enough that LPT is sometimes not optimal


def test_heterogeneous_unequal_measured_against_optimum() -> None:
    """No proven bound here; the oracle must never beat greedy's lower bound, report the ratio."""
    rng = random.Random(7)
    ratios = []
    for _ in range(150):
        num_links, num_shards = rng.randint(2, 3), rng.randint(2, 7)
        links = make_links(rng, num_links, identical=False)
        shards = {i: rng.randint(1, 20) for i in range(num_shards)}
        greedy = assign_shards_greedy(shards, links, now=0.0).makespan
        optimum = solve_optimal_makespan(shards, links, now=0.0)
        ratios.append(greedy / optimum)
        assert greedy >= optimum - 1e-9
    print(f"heterogeneous links, unequal shards: mean ratio {np.mean(ratios):.4f}, "
          f"worst {max(ratios):.4f}")
    assert np.mean(ratios) < 1.2


link_strategy = st.builds(
    NeighbourLink,
    peer_id=st.text(alphabet="abcdef", min_size=1, max_size=4),
    propagation_delay=st.floats(0.0, 2.0),
    per_byte_delay=st.floats(0.0, 2.0),
    free_time=st.floats(0.0, 5.0),
)
links_strategy = st.lists(link_strategy, min_size=1, max_size=6, unique_by=lambda l: l.peer_id)


@settings(max_examples=150, deadline=None)
@given(links=links_strategy, sizes=st.lists(st.integers(0, 1000), max_size=30),
       seed=st.integers(0, 2**32 - 1))
def test_every_shard_once_and_permutation_invariant(
    links: list[NeighbourLink], sizes: list[int], seed: int
) -> None:
    shards = dict(enumerate(sizes))
    plan = assign_shards_greedy(shards, links, now=1.0)
    sent = sorted(i for indices in plan.shards_by_peer.values() for i in indices)
    assert sent == list(range(len(sizes)))
    assert list(plan.shards_by_peer) == sorted(link.peer_id for link in links)
    shuffled_links = links[:]
    random.Random(seed).shuffle(shuffled_links)
    shuffled_shards = dict(sorted(shards.items(), key=lambda _: random.Random(seed).random()))
    assert assign_shards_greedy(shuffled_shards, shuffled_links, now=1.0) == plan


def test_ties_go_to_smallest_peer_id() -> None:
    links = [NeighbourLink(peer_id=name, propagation_delay=0.0, per_byte_delay=1.0)
             for name in ("c", "a", "b")]
    plan = assign_shards_greedy({0: 10}, links, now=0.0)
    assert plan.shards_by_peer == {"a": (0,), "b": (), "c": ()}


def test_greedy_cost_model_matches_docstring() -> None:
    link = NeighbourLink(peer_id="a", propagation_delay=0.5, per_byte_delay=0.25, free_time=3.0)
    plan = assign_shards_greedy({0: 8, 1: 4}, [link], now=1.0)
    assert plan.shards_by_peer == {"a": (0, 1)}  # largest first
    assert plan.makespan == pytest.approx(3.0 + 2 * 0.5 + 12 * 0.25)
    past = NeighbourLink(peer_id="a", propagation_delay=0.5, per_byte_delay=0.25, free_time=0.0)
    assert assign_shards_greedy({0: 4}, [past], now=10.0).makespan == pytest.approx(11.5)


def test_no_shards_and_no_neighbours() -> None:
    link = NeighbourLink(peer_id="a", propagation_delay=0.1, per_byte_delay=0.1)
    assert assign_shards_greedy({}, [link], now=2.0) == ShardAssignment({"a": ()}, {}, 2.0)
    with pytest.raises(ValueError, match="no neighbour"):
        assign_shards_greedy({0: 3}, [], now=0.0)
    with pytest.raises(ValueError, match="duplicate"):
        assign_shards_greedy({0: 3}, [link, link], now=0.0)
    with pytest.raises(ValueError, match="now"):
        assign_shards_greedy({0: 3}, [link], now=float("nan"))
    with pytest.raises(ValueError, match="sizes"):
        assign_shards_greedy({0: -3}, [link], now=0.0)


def test_assignment_module_is_pure() -> None:
    """DESIGN §2: the planning code loads no torch, so every peer can run it cheaply."""
    code = "import sys, replication.assignment; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "kwargs",
    [
        {"peer_id": ""},
        {"propagation_delay": -1.0},
        {"per_byte_delay": float("nan")},
        {"free_time": float("inf")},
        {"propagation_delay": True},
        {"per_byte_delay": "1"},
    ],
)
def test_neighbour_link_rejects_bad_values(kwargs: dict[str, object]) -> None:
    values: dict[str, object] = {"peer_id": "a", "propagation_delay": 0.1, "per_byte_delay": 0.1}
    values.update(kwargs)
    with pytest.raises(ValueError):
        NeighbourLink(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"min_shard_bytes": 0}, {"min_shard_bytes": 10, "max_shard_bytes": 5},
     {"max_num_shards": -1}, {"shard_align_bytes": 8, "max_shard_bytes": 4, "min_shard_bytes": 1}],
)
def test_search_config_rejects_bad_values(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        SearchConfig(**kwargs)


def test_shard_sizes() -> None:
    assert list_shard_sizes(10, 4) == [4, 4, 2]
    assert list_shard_sizes(8, 4) == [4, 4]
    assert list_shard_sizes(0, 4) == []
    assert count_shards(1, 1000) == 1
    with pytest.raises(ValueError):
        count_shards(5, 0)


search_config_small = SearchConfig(
    min_shard_bytes=1, max_shard_bytes=64, shard_align_bytes=1, max_num_shards=10_000
)


@settings(max_examples=120, deadline=None)
@given(links=links_strategy, total_bytes=st.integers(0, 300), now=st.floats(0.0, 3.0))
def test_binary_search_never_worse_than_what_it_tried(
    links: list[NeighbourLink], total_bytes: int, now: float
) -> None:
    plan = plan_replication(total_bytes, links, now=now, config=search_config_small)
    low, high = 1, min(64, max(1, total_bytes))  # the search range of search_config_small
    assert {low, high} <= set(plan.tried_shard_bytes)
    for shard_bytes in (low, high, *plan.tried_shard_bytes):
        sizes = dict(enumerate(list_shard_sizes(total_bytes, shard_bytes)))
        other = assign_shards_greedy(sizes, links, now=now)
        assert plan.assignment.makespan <= other.makespan
    assert plan.shard_bytes in plan.tried_shard_bytes
    sizes = dict(enumerate(list_shard_sizes(total_bytes, plan.shard_bytes)))
    assert assign_shards_greedy(sizes, links, now=now) == plan.assignment
    reversed_plan = plan_replication(total_bytes, links[::-1], now=now, config=search_config_small)
    assert reversed_plan == plan


def test_binary_search_trades_balance_against_per_shard_delay() -> None:
    """Two equal links: a large per-shard delay favours one shard per link, i.e. s = total/2."""
    total = 1000
    cheap = [NeighbourLink(peer_id=p, propagation_delay=0.0, per_byte_delay=1.0) for p in "ab"]
    costly = [NeighbourLink(peer_id=p, propagation_delay=5000.0, per_byte_delay=1.0) for p in "ab"]
    config = SearchConfig(min_shard_bytes=10, max_shard_bytes=1000, shard_align_bytes=10)
    balanced = plan_replication(total, cheap, now=0.0, config=config)
    assert balanced.assignment.makespan == pytest.approx(500.0)
    single = plan_replication(total, costly, now=0.0, config=config)
    assert single.shard_bytes == 500  # 1000 bytes as one shard would cost 6000 s
    assert single.assignment.makespan == pytest.approx(5500.0)
    assert 2 < len(single.tried_shard_bytes) <= 2 + 7  # endpoints + O(log S) steps


def test_search_range_respects_alignment_and_shard_cap() -> None:
    links = [NeighbourLink(peer_id="a", propagation_delay=0.0, per_byte_delay=1e-9)]
    config = SearchConfig(min_shard_bytes=1, max_shard_bytes=1 << 20, shard_align_bytes=4096,
                          max_num_shards=16)
    plan = plan_replication(10_000_000, links, now=0.0, config=config)
    assert all(s % 4096 == 0 for s in plan.tried_shard_bytes)
    assert all(count_shards(10_000_000, s) <= 16 for s in plan.tried_shard_bytes)


def test_replan_moves_missing_shards_to_survivors() -> None:
    links = [NeighbourLink(peer_id=p, propagation_delay=0.1, per_byte_delay=0.01) for p in "abc"]
    plan = plan_replication(1000, links, now=0.0, config=search_config_small)
    dead = "b"
    missing = plan.assignment.shards_by_peer[dead]
    survivors = [link for link in links if link.peer_id != dead]
    again = replan(missing, survivors, total_bytes=1000, shard_bytes=plan.shard_bytes, now=5.0)
    assert dead not in again.shards_by_peer
    assert sorted(i for ids in again.shards_by_peer.values() for i in ids) == sorted(missing)
    assert again.makespan >= 5.0
    with pytest.raises(ValueError, match="out of range"):
        replan([10_000], survivors, total_bytes=1000, shard_bytes=plan.shard_bytes, now=5.0)
    with pytest.raises(ValueError, match="no neighbour"):
        replan(missing, [], total_bytes=1000, shard_bytes=plan.shard_bytes, now=5.0)


def test_brute_force_oracle_on_a_hand_instance() -> None:
    """The oracle itself: 3 shards of 3, 3, 2 bytes on two unit links -> best split is 5 / 3."""
    links = [NeighbourLink(peer_id=p, propagation_delay=0.0, per_byte_delay=1.0) for p in "ab"]
    assert solve_optimal_makespan({0: 3, 1: 3, 2: 2}, links, now=0.0) == 5.0
    assert solve_optimal_makespan({0: 2, 1: 2, 2: 2, 3: 2}, links, now=1.0) == 5.0
