"""Link figures from peer records into one estimate per pair (planner.link_view), and where the router
and the planner read them: a lying record moves them by at most what its bound allows."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dht.link_figures import LinkFigure
from dht.records import PeerRecord
from planner.claims import MAX_CLAIM_RATIO
from planner.link_view import DEFAULT_BYTES_PER_S, DEFAULT_RTT_S, LinkClaim, LinkView
from planner.global_plan import plan_global
from planner.offline.scenarios import build_transformer_profile
from planner.snapshot import Device, SwarmSnapshot
from swarm.router import Router, link_factors
from swarm.view import SwarmView, link_claims
from tests.unit.test_planner_global import QUICK

MBIT = 1e6 / 8  # bytes/s per Mbit/s


def claim(reporter: str, other: str, rtt_ms: float, mbit: float | None = None) -> LinkClaim:
    return LinkClaim(reporter, other, rtt_ms / 1000, None if mbit is None else mbit * MBIT)


def test_both_ends_give_the_worse_figure_one_end_a_bounded_one_none_the_typical_link():
    claims = [claim("a", "b", 20, 100), claim("b", "a", 30, 80),  # both ends: 30 ms, 80 Mbit/s
              claim("a", "c", 40, 50), claim("c", "a", 40, None),  # only a timed a transfer from c
              claim("b", "c", 40, 50), claim("c", "b", 40, 60)]
    view = LinkView("abcd", claims)
    assert view.estimate("a", "b") == view.estimate("b", "a")
    assert view.estimate("a", "b").rtt_s == pytest.approx(0.030) and view.estimate("a", "b").bytes_per_s == 80 * MBIT
    assert view.estimate("a", "c").bytes_per_s == 50 * MBIT
    assert view.estimate("a", "d").rtt_s is None and view.estimate("a", "d").bytes_per_s is None
    # d is unknown to every figure: the matrix takes the typical link, the lower median of each reporter's
    # median (round trips: a 30, b 35, c 40 ms; goodputs: a 75, b 65, c 60 Mbit/s)
    matrix = view.matrix(("a", "b", "c", "d"))
    assert matrix.latency_delay[0, 3] == pytest.approx(view.typical.rtt_s / 2) == pytest.approx(0.035 / 2)
    assert matrix.bandwidth[0, 3] == view.typical.bytes_per_s == pytest.approx(65 * MBIT)
    assert matrix.latency_delay[0, 1] == pytest.approx(0.015) and matrix.bandwidth[1, 0] == 80 * MBIT
    nobody = LinkView("ab", []).matrix(("a", "b"))
    assert nobody.latency_delay[0, 1] == DEFAULT_RTT_S / 2 and nobody.bandwidth[0, 1] == DEFAULT_BYTES_PER_S


def test_self_figures_unknown_peers_and_duplicates():
    view = LinkView("ab", [claim("a", "a", 0.1, 1e5), claim("a", "zz", 0.1, 1e5), claim("zz", "a", 0.1, 1e5),
                           claim("a", "b", 10, 100), claim("a", "b", 50, 200)])
    assert view.estimate("a", "b").rtt_s == pytest.approx(0.050) and view.estimate("a", "b").bytes_per_s == 100 * MBIT
    assert view.typical.rtt_s == pytest.approx(0.050)  # the ignored figures did not vote
    with pytest.raises(ValueError):
        LinkClaim("a", "b", -1.0)
    with pytest.raises(ValueError):
        LinkClaim("a", "b", 0.01, 0.0)


figures = st.tuples(st.sampled_from("abcdef"), st.sampled_from("abcdef"), st.floats(0, 500), st.none() | st.floats(0.1, 1e4))


@given(st.lists(figures, max_size=30), st.randoms(use_true_random=False))
def test_the_same_figures_in_any_order_give_the_same_matrices(items, rng):
    claims = [claim(*item) for item in items]
    shuffled = list(claims)
    rng.shuffle(shuffled)
    ids = tuple("abcdef")
    first, second = LinkView(ids, claims).matrix(ids), LinkView(reversed(ids), shuffled).matrix(ids)
    assert np.array_equal(first.latency_delay, second.latency_delay)
    assert np.array_equal(first.bandwidth, second.bandwidth)


def two_regions() -> tuple[list[str], list[LinkClaim]]:
    """Peers r0..r2 in one region and s0..s2 in another (5 ms and 1 Gbit/s inside, 80 ms and 20 Mbit/s
    between), every link measured by both ends."""
    peers = [f"r{i}" for i in range(3)] + [f"s{i}" for i in range(3)]
    claims = []
    for a in peers:
        for b in peers:
            if a != b:
                near = a[0] == b[0]
                claims.append(claim(a, b, 5 if near else 80, 1000 if near else 20))
    return peers, claims


def test_a_liar_cannot_better_a_link_the_other_end_measured_and_one_sided_lies_stop_at_the_bound():
    peers, honest = two_regions()
    # x, in region s, claims a perfect link to everyone; r0 and s0 measured x (the real figures), the rest never did
    measured = [claim("r0", "x", 80, 20), claim("s0", "x", 5, 1000)]
    lie = [claim("x", p, 0.0, 1e5) for p in peers]
    at_bound = [claim("x", "r0", 80, 20), claim("x", "s0", 5, 1000)] + [
        LinkClaim("x", p, 0.0, 1e12) for p in peers if p not in ("r0", "s0")]
    ids = (*peers, "x")
    lied, bounded = LinkView(ids, honest + measured + lie), LinkView(ids, honest + measured + at_bound)
    assert lied.estimate("x", "r0").rtt_s == pytest.approx(0.080) and lied.estimate("x", "r0").bytes_per_s == 20 * MBIT
    typical = lied.typical  # each honest reporter's median figure: x's 6 figures are one vote among 7
    assert lied.estimate("x", "r1") == type(typical)(typical.rtt_s / MAX_CLAIM_RATIO, typical.bytes_per_s * MAX_CLAIM_RATIO)
    assert np.array_equal(lied.matrix(ids).bandwidth, bounded.matrix(ids).bandwidth)
    assert np.array_equal(lied.matrix(ids).latency_delay, bounded.matrix(ids).latency_delay)
    # so the global planner, fed either, makes the same plan: the lie beyond the bound moved nothing
    plans = [plan_global(snapshot(ids, view), QUICK) for view in (lied, bounded)]
    assert plans[0] == plans[1]


def snapshot(ids, view: LinkView) -> SwarmSnapshot:
    devices = tuple(Device(peer_id=p, flops=1e12 * (2 if p.startswith("r") else 1), memory_bytes=16 << 30,
                           is_reliable=True) for p in ids)
    return SwarmSnapshot(devices=devices, links=view.matrix(ids), model=build_transformer_profile(num_layers=8, hidden_size=1024, sequence_length=512))


def test_published_figures_become_claims():
    figures = (LinkFigure("b", rtt_ms=40.0, mbit_per_s=20.0), LinkFigure("c", rtt_ms=5.0, mbit_per_s=None),
               LinkFigure("d", rtt_ms=5.0, mbit_per_s=0.0))
    assert link_claims("a", figures) == [LinkClaim("a", "b", 0.04, 20 * MBIT), LinkClaim("a", "c", 0.005, None),
                                         LinkClaim("a", "d", 0.005, None)]


def record(peer_id: str, stage: int, links: tuple[LinkFigure, ...] = ()) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, role="reliable", state="training", stage=stage, flops=1e9, samples_per_s=10.0,
                      links=links)


def router_over(records: list[PeerRecord]) -> Router:
    view = SwarmView(None, "links")
    view.records = view.all_records = records
    return Router(None, view, run_id="links", next_stage=1, next_stage_flops=1e9, request_timeout=30.0,
                  max_payload_bytes=1 << 26, rng=random.Random(0))


def test_the_path_sends_a_stage_1_replica_to_the_stage_2_replica_its_links_favour():
    far, near = LinkFigure("far", rtt_ms=150.0, mbit_per_s=10.0), LinkFigure("near", rtt_ms=10.0, mbit_per_s=100.0)
    records = [record("me", 0), record("mid", 1, (far, near)),
               record("far", 2, (LinkFigure("mid", rtt_ms=150.0, mbit_per_s=10.0),)),
               record("near", 2, (LinkFigure("mid", rtt_ms=10.0, mbit_per_s=100.0),))]
    router = router_over(records)
    router.payload_bytes = 500_000
    factors = link_factors(router.view.links(), "mid", ["far", "near"], router.payload_bytes)
    assert factors[1] == 1.0 and factors[0] == pytest.approx(2 * (0.01 + 0.04) / (0.15 + 0.4))
    picks = Counter(router.plan_path([1e9, 1e9, 1e9])[1] for _ in range(2000))
    assert picks["near"] / 2000 > 0.8, picks  # 1 / (1 + 0.18) expected
    # without link figures the two are alike: the same router weights split the path evenly
    blind = router_over([record("me", 0), record("mid", 1), record("far", 2), record("near", 2)])
    blind.payload_bytes = 500_000
    picks = Counter(blind.plan_path([1e9, 1e9, 1e9])[1] for _ in range(2000))
    assert 0.45 < picks["near"] / 2000 < 0.55, picks
