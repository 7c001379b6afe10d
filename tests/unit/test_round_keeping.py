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
