"""Which averaging rounds a replica keeps: a pair inside a larger stage is dropped under a robust aggregation."""

from __future__ import annotations

import pytest

from swarm.averaging import count_active, keeps_round


@pytest.mark.parametrize("aggregation", ["centered_clip", "trimmed_mean"])
def test_a_robust_pair_is_kept_only_when_the_stage_has_no_third_replica(aggregation):
    assert keeps_round(aggregation, group_size=2, num_members=2)
    assert not keeps_round(aggregation, group_size=2, num_members=3)
    assert not keeps_round(aggregation, group_size=2, num_members=5)
    assert keeps_round(aggregation, group_size=3, num_members=5)


def test_the_plain_mean_keeps_every_round():
    assert keeps_round("mean", group_size=2, num_members=5)


def test_only_replicas_that_averaged_lately_and_are_still_in_the_view_count():
    last_seen = {"a": 100.0, "b": 90.0, "gone": 100.0}
    # "liar" announced itself in the stage but never averaged; "gone" averaged but left the view
    in_view = {"me", "a", "b", "liar"}
    assert count_active(last_seen, in_view, "me", since=95.0) == 2  # me and a
    assert count_active(last_seen, in_view, "me", since=80.0) == 3  # me, a and b
    assert count_active({}, in_view, "me", since=0.0) == 1  # nobody averaged yet: a pair is kept
    assert count_active({"me": 100.0}, set(), "me", since=0.0) == 1  # this peer counts once, in the view or not


def test_a_pair_with_a_newcomer_counts_the_newcomer():
    """This peer averaged with "a" lately; a newcomer "new" (never averaged, maybe Byzantine) then forms a
    pair with it. The stage has three replicas, so the pair is dropped; before the newcomer counted it was kept
    (the honest replica took half the newcomer's state: CI, honest loss +112 %)."""
    last_seen, in_view = {"a": 100.0}, {"me", "a", "new"}
    members = count_active(last_seen, in_view, "me", since=90.0, group=["me", "new"])
    assert members == 3
    assert not keeps_round("centered_clip", group_size=2, num_members=members)
    # the newcomer itself sees only the pair: a stage of two as far as it knows
    assert count_active({}, in_view, "new", since=90.0, group=["me", "new"]) == 2
    # a pair of the two replicas that averaged lately, with nobody else around, is still kept
    assert keeps_round("centered_clip", group_size=2,
                       num_members=count_active(last_seen, {"me", "a"}, "me", since=90.0, group=["me", "a"]))
