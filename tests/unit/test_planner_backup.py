"""Backups of singly held stages and rescues of unheld ones: exact cases, invariants, order invariance."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.backup_plan import (
    BackupCopy,
    BackupDuty,
    Rescue,
    assign_backups,
    choose_rescues,
)
from planner.stage_choice import StageMember


def member(peer_id: str, stage: int, flops: float = 1.0) -> StageMember:
    return StageMember(peer_id=peer_id, stage=stage, flops=flops)


swarms = st.integers(1, 5).flatmap(lambda num_stages: st.tuples(
    st.just(num_stages),
    st.lists(st.tuples(st.integers(0, num_stages - 1), st.floats(0.5, 4.0)), max_size=9).map(
        lambda xs: [member(f"p{i:02d}", stage, flops) for i, (stage, flops) in enumerate(xs)])))


# ---- assign_backups


def test_a_single_holder_is_backed_up_by_the_lowest_peer_of_the_next_stage():
    members = [member("a", 0), member("z", 1), member("c", 1)]
    assert assign_backups(2, members) == {0: BackupDuty(stage=0, holder_id="a", keeper_id="c")}


def test_the_last_stage_wraps_around_to_stage_0():
    members = [member("b", 0), member("a", 0), member("x", 1)]
    assert assign_backups(2, members) == {1: BackupDuty(stage=1, holder_id="x", keeper_id="a")}


def test_two_single_stages_back_each_other_up():
    duties = assign_backups(2, [member("a", 0), member("b", 1)])
    assert duties == {0: BackupDuty(stage=0, holder_id="a", keeper_id="b"),
                      1: BackupDuty(stage=1, holder_id="b", keeper_id="a")}


def test_an_unheld_next_stage_is_skipped():
    members = [member("a", 0), member("d", 3), member("c", 3)]
    assert assign_backups(4, members) == {0: BackupDuty(stage=0, holder_id="a", keeper_id="c")}


def test_no_backup_is_needed_with_two_holders_or_with_nowhere_to_keep_one():
    assert assign_backups(2, [member("a", 0), member("b", 0), member("c", 1), member("d", 1)]) == {}
    assert assign_backups(1, [member("a", 0)]) == {}  # one stage: no other stage to keep it
    assert assign_backups(3, [member("a", 1)]) == {}  # the only held stage
    assert assign_backups(3, []) == {}


def test_a_stage_no_other_stage_can_keep_is_kept_by_the_first_peer_standing_by():
    """A one-stage layout of the global plan (peer.standby): the peer standing by that would take the
    stage if its holder crashed keeps its copy; holders of other stages still come first."""
    assert assign_backups(1, [member("m", 0)], standby=["s2", "s1"]) == {0: BackupDuty(stage=0, holder_id="m", keeper_id="s1")}
    assert assign_backups(3, [member("a", 1)], standby=["s1"]) == {1: BackupDuty(stage=1, holder_id="a", keeper_id="s1")}
    assert assign_backups(2, [member("a", 0), member("b", 1)], standby=["s1"]) == assign_backups(2, [member("a", 0), member("b", 1)])
    assert assign_backups(1, [member("m", 0), member("n", 0)], standby=["s1"]) == {}  # two holders back each other up
    assert assign_backups(1, [member("m", 0)], standby=["m"]) == {}  # a holder is not standing by


@settings(max_examples=300, deadline=None)
@given(swarms)
def test_backup_duties_hold_their_invariants(swarm):
    num_stages, members = swarm
    duties = assign_backups(num_stages, members)
    stage_of = {m.peer_id: m.stage for m in members}
    counts = [sum(m.stage == k for m in members) for k in range(num_stages)]
    held = [k for k in range(num_stages) if counts[k]]
    expected = {k for k in range(num_stages) if counts[k] == 1} if len(held) >= 2 else set()
    assert set(duties) == expected
    for stage, duty in duties.items():
        assert duty.stage == stage and stage_of[duty.holder_id] == stage
        assert duty.keeper_id != duty.holder_id and stage_of[duty.keeper_id] != stage
        # the keeper's stage is the first held one after the holder's, and it is its lowest peer
        gap = (stage_of[duty.keeper_id] - stage) % num_stages
        assert all(counts[(stage + step) % num_stages] == 0 for step in range(1, gap))
        assert duty.keeper_id == min(m.peer_id for m in members if m.stage == stage_of[duty.keeper_id])
    keepers = [d.keeper_id for d in duties.values()]
    assert len(keepers) == len(set(keepers)), "a peer keeps at most one backup"


@settings(max_examples=100, deadline=None)
@given(swarms, st.randoms(use_true_random=False))
def test_backup_duties_do_not_depend_on_the_order_of_the_records(swarm, rng):
    num_stages, members = swarm
    shuffled = list(members)
    rng.shuffle(shuffled)
    assert assign_backups(num_stages, shuffled) == assign_backups(num_stages, members)


def test_bad_members_are_refused():
    with pytest.raises(ValueError, match="claims stage"):
        assign_backups(2, [member("a", 2)])
    with pytest.raises(ValueError, match="twice"):
        assign_backups(2, [member("a", 0), member("a", 1)])
    with pytest.raises(ValueError, match="at least one stage"):
        assign_backups(0, [])


# ---- choose_rescues

COSTS = [1.0, 1.0]


def test_the_keeper_takes_over_with_its_own_backup():
    members = [member("b", 1), member("c", 1)]
    backups = [BackupCopy(peer_id="c", stage=0, version=12)]
    assert choose_rescues(COSTS, members, backups) == [
        Rescue(peer_id="c", from_stage=1, to_stage=0, keeper_id="c", backup_version=12)]
    assert choose_rescues(COSTS, members, backups)[0].source == "local-backup"


def test_a_keeper_that_would_empty_its_stage_stays_and_another_peer_pulls_from_it():
    members = [member("k", 0), member("x", 2), member("y", 2, flops=3.0)]
    backups = [BackupCopy(peer_id="k", stage=1, version=5)]
    (rescue,) = choose_rescues([1.0, 1.0, 1.0], members, backups)
    assert (rescue.peer_id, rescue.from_stage, rescue.to_stage, rescue.keeper_id) == ("x", 2, 1, "k")
    assert rescue.source == "backup-donor" and rescue.backup_version == 5


def test_the_rescuer_comes_from_the_stage_with_the_most_throughput_to_spare():
    members = [member("a", 0), member("b", 0), member("c", 2, 2.0), member("d", 2, 2.0), member("e", 2, 1.0)]
    (rescue,) = choose_rescues([1.0, 1.0, 1.0], members, [])
    assert (rescue.peer_id, rescue.from_stage, rescue.source) == ("e", 2, "none")  # 4 left on stage 2, the slower peer


def test_a_paused_peer_holds_its_stage_but_is_not_moved():
    members = [member("a", 1), member("b", 1), member("c", 1)]
    backups = [BackupCopy(peer_id="a", stage=0, version=4)]
    (rescue,) = choose_rescues(COSTS, members, backups, unmovable={"a"})
    assert (rescue.peer_id, rescue.keeper_id, rescue.source) == ("b", "a", "backup-donor")
    assert choose_rescues(COSTS, members[:2], backups, unmovable={"a"}) == []  # b is stage 1's last working peer
    assert choose_rescues(COSTS, members, backups, unmovable={"a", "b", "c"}) == []


def test_the_newest_backup_wins():
    members = [member("a", 1), member("b", 1), member("c", 1)]
    backups = [BackupCopy(peer_id="a", stage=0, version=3), BackupCopy(peer_id="c", stage=0, version=9),
               BackupCopy(peer_id="b", stage=0, version=9)]
    (rescue,) = choose_rescues(COSTS, members, backups)
    assert (rescue.peer_id, rescue.keeper_id, rescue.backup_version) == ("b", "b", 9)


def test_nobody_moves_when_every_stage_is_held_or_nobody_may_move():
    assert choose_rescues(COSTS, [member("a", 0), member("b", 1)], [BackupCopy(peer_id="a", stage=1, version=1)]) == []
    assert choose_rescues(COSTS, [member("a", 1)], [BackupCopy(peer_id="a", stage=0, version=1)]) == []
    assert choose_rescues(COSTS, [], []) == []


def test_several_unheld_stages_are_rescued_in_order_without_emptying_a_stage():
    members = [member(f"p{i}", 3) for i in range(3)]
    rescues = choose_rescues([1.0] * 4, members, [BackupCopy(peer_id="p2", stage=1, version=4)])
    assert [(r.to_stage, r.from_stage) for r in rescues] == [(0, 3), (1, 3)]  # stage 2 waits: p-last stays on 3
    assert rescues[1].peer_id == "p2" and rescues[1].source == "local-backup"
    assert len({r.peer_id for r in rescues}) == 2


@settings(max_examples=300, deadline=None)
@given(swarms, st.lists(st.tuples(st.integers(0, 8), st.integers(0, 4), st.integers(0, 50)), max_size=4),
       st.randoms(use_true_random=False))
def test_rescues_hold_their_invariants_and_ignore_record_order(swarm, raw_backups, rng):
    num_stages, members = swarm
    costs = [1.0 + k for k in range(num_stages)]
    backups = [BackupCopy(peer_id=f"p{i:02d}", stage=stage % num_stages, version=version)
               for i, stage, version in raw_backups]
    rescues = choose_rescues(costs, members, backups)
    shuffled_members, shuffled_backups = list(members), list(backups)
    rng.shuffle(shuffled_members)
    rng.shuffle(shuffled_backups)
    assert choose_rescues(costs, shuffled_members, shuffled_backups) == rescues
    stages = {m.peer_id: m.stage for m in members}
    counts = [sum(m.stage == k for m in members) for k in range(num_stages)]
    assert len({r.peer_id for r in rescues}) == len(rescues), "a peer rescues at most one stage"
    for rescue in rescues:
        assert counts[rescue.to_stage] == 0 and stages[rescue.peer_id] == rescue.from_stage
        counts[rescue.from_stage] -= 1
        counts[rescue.to_stage] += 1
        assert counts[rescue.from_stage] >= 1, "a rescue never empties another stage"
        copies = [c for c in backups if c.stage == rescue.to_stage]
        if copies:
            assert rescue.backup_version == max(c.version for c in copies)
        else:
            assert rescue.keeper_id is None
    # stages left unheld are those no peer could be spared for
    if any(c == 0 for c in counts):
        assert all(c <= 1 for c in counts)


def test_rescue_choice_is_deterministic_across_many_shuffles():
    rng = random.Random(7)
    members = [member(f"p{i}", i % 3, flops=rng.uniform(1, 3)) for i in range(8) if i % 3 != 1]
    backups = [BackupCopy(peer_id="p0", stage=1, version=2)]
    expected = choose_rescues([1.0, 2.0, 3.0], members, backups)
    assert expected and expected[0].to_stage == 1
    for _ in range(20):
        rng.shuffle(members)
        assert choose_rescues([1.0, 2.0, 3.0], members, backups) == expected


# ---- pinned peers (issue #15: a peer pinned with --stage 0 was moved by a false rescue)


def test_a_pinned_peer_is_never_named_and_still_counts_as_its_stages_holder():
    members = [member("a", 0), member("b", 0)]
    assert choose_rescues(COSTS, members, [])[0].peer_id == "a"  # the lower peer id, all else equal
    (rescue,) = choose_rescues(COSTS, members, [], pinned={"a"})
    assert (rescue.peer_id, rescue.from_stage, rescue.to_stage) == ("b", 0, 1)  # a stays behind and holds stage 0
    assert choose_rescues(COSTS, members, [], pinned={"a", "b"}) == []


def test_a_pinned_keeper_lends_its_copy_but_does_not_move():
    members = [member("k", 1), member("x", 1)]
    backups = [BackupCopy(peer_id="k", stage=0, version=7)]
    assert choose_rescues(COSTS, members, backups)[0].source == "local-backup"
    (rescue,) = choose_rescues(COSTS, members, backups, pinned={"k"})
    assert (rescue.peer_id, rescue.keeper_id, rescue.source) == ("x", "k", "backup-donor")


@settings(max_examples=300, deadline=None)
@given(swarms, st.sets(st.integers(0, 8)), st.randoms(use_true_random=False))
def test_no_rescue_ever_moves_a_pinned_peer(swarm, raw_pinned, rng):
    num_stages, members = swarm
    costs = [1.0 + k for k in range(num_stages)]
    pinned = {f"p{i:02d}" for i in raw_pinned}
    rescues = choose_rescues(costs, members, [], pinned=pinned)
    assert not {r.peer_id for r in rescues} & pinned
    shuffled = list(members)
    rng.shuffle(shuffled)
    assert choose_rescues(costs, shuffled, [], pinned=sorted(pinned)) == rescues
    counts = [sum(m.stage == k for m in members) for k in range(num_stages)]
    for rescue in rescues:
        counts[rescue.from_stage] -= 1
        counts[rescue.to_stage] += 1
        assert counts[rescue.from_stage] >= 1, "a rescue never empties another stage"
    # a stage left unheld has no unpinned peer on a stage that keeps another holder
    if any(c == 0 for c in counts):
        stage_of = {m.peer_id: m.stage for m in members}
        for r in rescues:
            stage_of[r.peer_id] = r.to_stage
        assert all(counts[stage] <= 1 for peer, stage in stage_of.items() if peer not in pinned)
