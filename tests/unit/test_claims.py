"""Bounds on claimed figures (planner.claims) and where the view and the router apply them."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dht.records import PeerRecord
from planner.backup_plan import BackupCopy
from planner.claims import MAX_CLAIM_RATIO, cap_to_median, credible_copies, lower_median
from planner.stage_choice import StageMember
from swarm.router import hop_weights
from swarm.view import bound_claims

rates = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False)


def record(peer_id: str, stage: int, *, flops: float = 1e9, samples_per_s: float = 0.0, state: str = "training",
           **fields) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, role="reliable", state=state, stage=stage, flops=flops,
                      samples_per_s=samples_per_s, **fields)


def test_lower_median():
    assert lower_median([3.0]) == 3.0
    assert lower_median([5.0, 1.0]) == 1.0
    assert lower_median([4.0, 1.0, 9.0, 2.0]) == 2.0
    with pytest.raises(ValueError):
        lower_median([])


def test_a_liar_among_two_is_capped_at_the_ratio_of_the_honest_one():
    assert cap_to_median([10.0, 1e12]) == [10.0, 10.0 * MAX_CLAIM_RATIO]
    assert cap_to_median([0.0, 1e12]) == [0.0, 1e12]  # nobody else measured anything: nothing to bound by
    assert cap_to_median([7.0]) == [7.0]
    assert cap_to_median([0.0, 5.0, 6.0, 1e9], max_ratio=2.0) == [0.0, 5.0, 6.0, 12.0]
    with pytest.raises(ValueError):
        cap_to_median([1.0, 2.0], max_ratio=0.5)


@given(st.lists(rates, min_size=1, max_size=12), st.floats(min_value=1.0, max_value=1e18))
def test_one_liar_never_outweighs_ratio_times_the_honest_maximum(honest, lie):
    capped = cap_to_median([*honest, lie])
    assert capped[:-1] == [min(h, MAX_CLAIM_RATIO * lower_median([*honest, lie])) for h in honest]
    assert capped[-1] <= MAX_CLAIM_RATIO * max(honest)  # the median of honest + 1 is at most an honest value
    assert all(c <= v for c, v in zip(capped, [*honest, lie]))  # a bound only ever lowers a claim


def test_the_router_gives_one_liar_at_most_ratio_over_ratio_plus_one_of_the_picks():
    honest, liar = record("honest", 1, samples_per_s=5.0), record("liar", 1, samples_per_s=1e9)
    weights = hop_weights([honest, liar], Counter(), stage_flops=1e9)
    assert weights[1] / sum(weights) == pytest.approx(MAX_CLAIM_RATIO / (MAX_CLAIM_RATIO + 1))
    # a liar that has not "measured" yet and claims huge FLOP/s instead is bounded the same way
    liar = record("liar", 1, flops=1e18)
    weights = hop_weights([honest, liar], Counter(), stage_flops=1e9)
    assert weights[1] / sum(weights) <= MAX_CLAIM_RATIO / (MAX_CLAIM_RATIO + 1) + 1e-9


def test_the_view_bounds_flops_swarm_wide_and_samples_per_s_within_a_stage():
    records = [record("a", 0, flops=1e9, samples_per_s=4.0), record("b", 0, flops=2e9, samples_per_s=1e6),
               record("c", 1, flops=1e18, samples_per_s=50.0), record("d", 1, flops=1e9, samples_per_s=60.0),
               record("e", -1, flops=3e9, state="joining")]
    bounded = {r.peer_id: r for r in bound_claims(records)}
    assert bounded["c"].flops == MAX_CLAIM_RATIO * 2e9  # the lower median of 1e9, 1e9, 2e9, 3e9, 1e18
    assert bounded["b"].samples_per_s == MAX_CLAIM_RATIO * 4.0  # stage 0's median is a's
    assert bounded["d"].samples_per_s == 60.0 and bounded["c"].samples_per_s == 50.0  # honest: untouched
    assert bounded["a"] == records[0] and bounded["e"] == records[4]
    assert bound_claims(records) == bound_claims(list(records))  # deterministic: same records, same bounds


def members(*pairs: tuple[str, int]) -> list[StageMember]:
    return [StageMember(peer_id=p, stage=s, flops=1e9) for p, s in pairs]


def test_the_named_keepers_copy_wins_over_a_newer_claim_by_anyone_else():
    # stage 0 lost its only holder; the backup rule named stage 1's first peer, "k", its keeper
    holders = members(("k", 1), ("m", 1), ("x", 2))
    honest, liar = BackupCopy(peer_id="k", stage=0, version=120), BackupCopy(peer_id="x", stage=0, version=10**9)
    assert credible_copies(3, holders, [honest, liar]) == [honest]
    # without a copy from the named keeper (it left with it), the others still count
    assert credible_copies(3, holders, [liar]) == [liar]
    # stage 2's keeper is stage 0's first holder, or stage 1's when stage 0 is empty
    copies = [BackupCopy(peer_id="k", stage=2, version=3), BackupCopy(peer_id="m", stage=2, version=9)]
    assert credible_copies(3, holders, copies) == [copies[0]]
    assert credible_copies(3, members(("k", 1)), [BackupCopy(peer_id="z", stage=7, version=1)]) == []
