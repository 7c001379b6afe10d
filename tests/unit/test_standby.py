"""Standing by (peer.standby, issue #18): a global plan that leaves peers idle names them STANDBY, they
hold no stage, the next plans still place them, and a later plan that names a stage brings one back.

The swarm of tests/unit/test_plan_watch.py: a and b (fast, region 0) on stage 0, c and d (region 1,
20 Mbit/s and 120 ms away) on stage 1. The plan here keeps region 0 and idles region 1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import types

from dht.layouts import STANDBY, assigned_stage, make_assignment
from dht.records import PeerRecord
from peer.config import PeerConfig
from peer.plan_adoption import judge_proposal, proposed_change
from peer.plan_watch import swarm_snapshot
from peer.relayout import LayoutChange, adopted_layout
from peer.relayout import HANDOFF_GRACE
from peer.standby import awaited_stages, stand_by, unheld_stage
from planner.adoption import Adoption, layout_plan
from tests.unit.test_plan_adoption import MEMBERS, PERIOD, TURN_OF_A, member_view, proposal_record
from tests.unit.fake_clock import FakeClock
from tests.unit.test_plan_watch import SPEC

KEEP = {"a": 0, "b": 1}  # region 0's two peers take one stage each; c and d idle
SETTLE = 3.0


def region_plan() -> Adoption:
    snapshot, _ = swarm_snapshot(member_view(), SPEC, max_in_flight=8)
    plan = layout_plan(SPEC.stage_layers, KEEP, snapshot)
    return Adoption(plan=plan, current=1.0, planned=2.0, moves=(), move_seconds=0.0, payback_seconds=0.0,
                    adopt=True, reason="faster")


def standby_record(peer_id: str, change) -> PeerRecord:
    """``peer_id``'s record once it stands by under ``change``'s layout."""
    mine = next(r for r in MEMBERS if r.peer_id == peer_id)
    return dataclasses.replace(mine, state="standby", stage=STANDBY, layout_version=change.spec.layout_version,
                               stage_layers=change.spec.stage_layers)


def test_a_plan_names_the_peers_it_leaves_idle_and_a_proposer_it_idles_stands_by_itself() -> None:
    change, why = proposed_change(region_plan(), member_view(), SPEC, SPEC, peer_id="a", now=TURN_OF_A, period=PERIOD)
    assert why == "" and change.stage == 0
    assert {p: assigned_stage(change.assignment, p) for p in "abcd"} == {"a": 0, "b": 1, "c": STANDBY, "d": STANDBY}
    record = proposal_record(change)
    assert PeerRecord.from_wire(record.to_wire()) == record  # STANDBY travels in the assignment

    idled = Adoption(**{**region_plan().__dict__, "plan": layout_plan(SPEC.stage_layers, {"b": 0, "c": 1},
                                                                       swarm_snapshot(member_view(), SPEC, max_in_flight=8)[0])})
    own, _ = proposed_change(idled, member_view(), SPEC, SPEC, peer_id="a", now=TURN_OF_A, period=PERIOD)
    assert own.stage == STANDBY and assigned_stage(own.assignment, "a") == STANDBY


def test_followers_the_plan_idles_stand_by_and_a_standby_proposers_record_still_leads() -> None:
    change, _ = proposed_change(region_plan(), member_view(), SPEC, SPEC, peer_id="a", now=TURN_OF_A, period=PERIOD)
    view = member_view([proposal_record(change), *MEMBERS[1:]])
    view.set_layout(0, SPEC.stage_layers)
    followed = {p: adopted_layout(view, SPEC, SPEC, peer_id=p, stage=s, accepted=lambda r: r.peer_id == "a").stage
                for p, s in (("b", 0), ("c", 1), ("d", 1))}
    assert followed == {"b": 1, "c": STANDBY, "d": STANDBY}
    # a proposer the plan idles publishes "standby" with the assignment: the others still find it
    leader = dataclasses.replace(proposal_record(change), state="standby", stage=STANDBY)
    view = member_view([leader, *MEMBERS[1:]])
    view.set_layout(0, SPEC.stage_layers)
    assert adopted_layout(view, SPEC, SPEC, peer_id="b", stage=0, accepted=lambda r: True).stage == 1
    # ... but a standby record without an assignment leads nobody anywhere
    view = member_view([standby_record("a", change), *MEMBERS[1:]])
    view.set_layout(0, SPEC.stage_layers)
    assert adopted_layout(view, SPEC, SPEC, peer_id="b", stage=0, accepted=lambda r: True) is None


def test_peers_standing_by_are_in_the_next_snapshot_without_a_stage_and_a_plan_naming_them_is_judged_with_them() -> None:
    change, _ = proposed_change(region_plan(), member_view(), SPEC, SPEC, peer_id="a", now=TURN_OF_A, period=PERIOD)
    spec = change.spec
    a, b = (dataclasses.replace(r, stage=KEEP[r.peer_id], layout_version=1, stage_layers=spec.stage_layers)
            for r in MEMBERS[:2])
    view = member_view([a, b, standby_record("c", change), standby_record("d", change)])
    view.set_layout(1, spec.stage_layers)
    snapshot, stage_of = swarm_snapshot(view, spec, max_in_flight=8)
    assert sorted(d.peer_id for d in snapshot.devices) == ["a", "b", "c", "d"] and stage_of == {"a": 0, "b": 1}
    # a next plan that puts c on stage 1 instead of b: judged with c serving it (were c left out as a
    # peer holding no stage, stage 1 would have no member and the plan would be refused for that)
    back = dataclasses.replace(a, layout_version=2, layout_assignment=make_assignment({"a": 0, "b": STANDBY, "c": 1, "d": STANDBY}))
    verdict = judge_proposal(back, view, spec, SPEC, max_in_flight=8)
    assert "below" in verdict, verdict  # c is slower than b and 120 ms from a: the swarm would slow down
    swap = dataclasses.replace(back, layout_assignment=make_assignment({"a": 0, "b": STANDBY, "c": STANDBY, "d": STANDBY}))
    assert "no reliable member" in judge_proposal(swap, view, spec, SPEC, max_in_flight=8)
    mine = dataclasses.replace(standby_record("c", change))
    view = member_view([back, b, mine, standby_record("d", change)])
    view.set_layout(1, spec.stage_layers)
    returned = adopted_layout(view, spec, SPEC, peer_id="c", stage=STANDBY, accepted=lambda r: True)
    assert returned.stage == 1 and returned.spec.layout_version == 2
    assert adopted_layout(view, spec, SPEC, peer_id="d", stage=STANDBY, accepted=lambda r: True).stage == STANDBY
    # a re-plan (not a global plan) while it stands by: it takes the thinnest stage of the new layout
    replanned = dataclasses.replace(a, layout_version=2, stage_layers=((0, 4),), layout_map=(0, 0))
    view = member_view([replanned, standby_record("c", change)])
    view.set_layout(1, spec.stage_layers)
    assert adopted_layout(view, spec, SPEC, peer_id="c", stage=STANDBY).stage == 0


class Recorded:
    """An event log that keeps its events (peer.event_log.EventLog's ``write``)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def write(self, event: str, **fields) -> None:
        self.events.append((event, fields))


class Host:
    """What stand_by reads of a peer: its view, layout and heartbeat (counted)."""

    def __init__(self, view, spec, *, on_adopt=None) -> None:
        self.config = PeerConfig(bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/QmX",))
        self.view, self.spec, self.base_spec, self.peer_id = view, spec, SPEC, "c"
        self.keeper = None  # no backup duty here (tests/unit/test_planner_backup.py has those)
        self.metrics = Recorded()
        self.beats: list[int] = []
        self.adopted: list = []
        self.on_adopt = on_adopt or (lambda: None)

    async def heartbeat(self, stage: int | None = None) -> None:
        self.beats.append(stage)

    def adopt_layout(self, change) -> None:
        self.adopted.append(change)
        self.spec = change.spec
        self.on_adopt()


def test_a_standby_peer_heartbeats_and_returns_when_a_plan_names_its_stage_or_stays_when_idled_again() -> None:
    change, _ = proposed_change(region_plan(), member_view(), SPEC, SPEC, peer_id="a", now=TURN_OF_A, period=PERIOD)
    spec = change.spec
    a, b = (dataclasses.replace(r, stage=KEEP[r.peer_id], layout_version=1, stage_layers=spec.stage_layers)
            for r in MEMBERS[:2])

    def host_with(proposal: PeerRecord, **kwargs) -> Host:
        view = member_view([proposal, b, standby_record("c", change), standby_record("d", change)])
        view.set_layout(1, spec.stage_layers)
        return Host(view, spec, **kwargs)

    named = host_with(dataclasses.replace(a, layout_version=2, layout_assignment=make_assignment({"a": 0, "b": 1, "c": 1})))
    judged: list[str] = []

    async def follow(record: PeerRecord) -> str:
        judged.append(record.peer_id)
        return ""

    returned = asyncio.run(asyncio.wait_for(stand_by(named, asyncio.Event(), judge=follow), 10))
    assert returned.stage == 1 and returned.spec.layout_version == 2 and named.beats == [STANDBY] and judged == ["a"]

    stop = asyncio.Event()
    idled = host_with(dataclasses.replace(a, layout_version=2, layout_assignment=make_assignment({"a": 0, "b": 1, "c": STANDBY})),
                      on_adopt=stop.set)
    assert asyncio.run(asyncio.wait_for(stand_by(idled, stop, judge=follow), 10)) is None
    assert [c.spec.layout_version for c in idled.adopted] == [2] and idled.beats == [STANDBY]
    assert [(e, f["version"], f["stage"]) for e, f in idled.metrics.events] == [("relayout", 2, STANDBY)]
    assert named.metrics.events == []  # named a stage: the lifecycle writes its event once the stage is built

    stop = asyncio.Event()
    stop.set()
    assert asyncio.run(stand_by(host_with(a), stop)) is None  # stopped: leaves without a stage


def test_the_idle_peer_offers_no_stage_in_its_record_and_says_it_stands_by() -> None:
    from peer.self_report import peer_record
    from peer.status.snapshot import PeerState, describe_activity
    peer = types.SimpleNamespace(stage=None, keeper=None, spec=SPEC, peer_id="c", role="reliable", state=PeerState.STANDBY,
                                 flops=1e9, announced_at=1.0, session=None, maddrs=(), averaged_round=(0.0, ""),
                                 memory_budget=0, config=PeerConfig(bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/QmX",)),
                                 layout_change=None, ctx=None, node=types.SimpleNamespace(reach=types.SimpleNamespace(kind="direct")))
    record = peer_record(peer, STANDBY)
    assert (record.state, record.stage, record.version) == ("standby", STANDBY, 0)
    assert PeerRecord.from_wire(record.to_wire()) == record
    assert describe_activity(PeerState.STANDBY, stage=-1, joined=True, unheld=[]).startswith("standing by")


def test_no_second_proposal_while_a_proposer_the_plan_idled_stands_by_under_its_new_layout() -> None:
    # d proposed, the plan idled it: it left this layout's members (the turns moved on to a), but its
    # record under layout 1 says a change is under way (in the first e2e run a second peer proposed 3 s later)
    change, _ = proposed_change(region_plan(), member_view(), SPEC, SPEC, peer_id="a", now=TURN_OF_A, period=PERIOD)
    proposer = dataclasses.replace(standby_record("d", change), layout_assignment=change.assignment)
    view = member_view(MEMBERS[:3])
    view.all_records = [*MEMBERS[:3], proposer]
    turn_of_a = 9 * PERIOD + 1.0  # a, b, c take turns: the 9th is a's
    blocked, why = proposed_change(region_plan(), view, SPEC, SPEC, peer_id="a", now=turn_of_a, period=PERIOD)
    assert blocked is None and "stands by under a newer layout" in why, why
    view.all_records = list(MEMBERS[:3])
    assert proposed_change(region_plan(), view, SPEC, SPEC, peer_id="a", now=turn_of_a, period=PERIOD)[0] is not None


def test_peers_standing_by_take_a_lost_stage_once_it_stayed_unheld_one_each_in_peer_id_order() -> None:
    change, _ = proposed_change(region_plan(), member_view(), SPEC, SPEC, peer_id="a", now=TURN_OF_A, period=PERIOD)
    spec = change.spec
    a = dataclasses.replace(MEMBERS[0], stage=0, layout_version=1, stage_layers=spec.stage_layers)
    standing = [standby_record(p, change) for p in ("b", "c", "d")]  # b (stage 1's only holder) left: 1 is lost
    view = member_view([a, *standing])
    view.set_layout(1, spec.stage_layers)
    since = {p: {} for p in "bcd"}

    def takes(peer_id: str, now: float):
        return unheld_stage(view, spec, peer_id=peer_id, unheld_since=since[peer_id], now=now, settle=SETTLE)

    assert [takes(p, 10.0) for p in "bcd"] == [None, None, None]  # first seen unheld
    assert [takes(p, 10.0 + SETTLE) for p in "bcd"] == [1, None, None], "the first standing by in id order, alone"
    view.records = [a, dataclasses.replace(standing[0], state="syncing", stage=1), *standing[1:]]
    assert [takes(p, 20.0) for p in "bcd"] == [None, None, None] and since["c"] == {}  # held again: the clock restarts
    view.records = standing  # a left as well: both stages lost, one peer standing by for each
    view.all_records = list(standing)
    assert [takes(p, 30.0) for p in "bcd"] == [None, None, None]
    assert [takes(p, 30.0 + SETTLE) for p in "bcd"] == [0, 1, None]
    late = member_view(standing)
    late.complete_reads = 0  # reads that waited out DHT timeouts prove no absence
    assert unheld_stage(late, spec, peer_id="b", unheld_since={0: 0.0}, now=100.0, settle=SETTLE) is None
    joining = member_view([*standing, dataclasses.replace(MEMBERS[0], peer_id="j", state="joining", stage=-1)])
    assert unheld_stage(joining, spec, peer_id="b", unheld_since={0: 0.0, 1: 0.0}, now=100.0, settle=SETTLE) is None


def test_a_stage_the_plan_names_for_a_peer_on_its_way_waits_for_it_not_taken_by_one_standing_by() -> None:
    """In an e2e run the proposer, idled by its plan, took the plan's one stage from the seed 5 s
    after its move, while the two peers the plan named for it were still judging the proposal."""
    change, _ = proposed_change(region_plan(), member_view(), SPEC, SPEC, peer_id="a", now=TURN_OF_A, period=PERIOD)
    spec = change.spec
    proposer = dataclasses.replace(standby_record("d", change), layout_assignment=change.assignment)
    standing = [standby_record("c", change), proposer]
    view = member_view(standing)
    view.set_layout(1, spec.stage_layers)
    view.all_records = [*MEMBERS[:2], *standing]  # a and b still train under layout 0: on their way
    assert awaited_stages(view, spec, SPEC) == {0, 1}
    since = {}

    def takes(now: float, awaited):
        return unheld_stage(view, spec, peer_id="c", unheld_since=since, now=now, settle=SETTLE, awaited=awaited)

    assert takes(10.0, awaited_stages(view, spec, SPEC)) is None
    assert takes(10.0 + SETTLE, awaited_stages(view, spec, SPEC)) is None, "a and b are on their way"
    view.all_records = [MEMBERS[1], *standing]  # a's record expired (it crashed): stage 0 is lost
    assert takes(10.0 + SETTLE, awaited_stages(view, spec, SPEC)) == 0
    since.clear()
    view.all_records = [*MEMBERS[:2], *standing]  # or a never comes (it refused): taken after the grace
    assert takes(10.0, awaited_stages(view, spec, SPEC)) is None
    assert takes(10.0 + HANDOFF_GRACE, awaited_stages(view, spec, SPEC)) == 0


def test_a_standby_peer_returns_to_take_a_stage_nobody_holds() -> None:
    change, _ = proposed_change(region_plan(), member_view(), SPEC, SPEC, peer_id="a", now=TURN_OF_A, period=PERIOD)
    spec = change.spec
    a = dataclasses.replace(MEMBERS[0], stage=0, layout_version=1, stage_layers=spec.stage_layers)
    view = member_view([a, standby_record("c", change), standby_record("d", change)])  # stage 1 has nobody
    view.set_layout(1, spec.stage_layers)
    clock = FakeClock(0.0)
    host = Host(view, spec)
    host.config = PeerConfig(bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/QmX",), heartbeat_ttl=2 * SETTLE)  # settles in SETTLE

    async def advancing() -> LayoutChange:
        task = asyncio.create_task(stand_by(host, asyncio.Event(), clock=clock, period=0.0))
        looks = 0
        while not task.done():
            clock.advance(1.0)
            looks += 1
            await asyncio.sleep(0)
        assert looks >= SETTLE, "not before the settle time"
        return task.result()

    taken = asyncio.run(asyncio.wait_for(advancing(), 30))
    assert (taken.stage, taken.reason, taken.spec) == (1, "standby_rescue", spec) and host.beats[0] == STANDBY


def test_a_follower_counts_the_proposer_that_left_its_layout_on_the_stage_the_plan_gives_it() -> None:
    # a proposes region 0's plan and moves: a holds stage 1 alone under layout 1, so b's view of
    # layout 0 no longer lists it. Left out, stage 1 would have no member and b would refuse.
    plan = layout_plan(SPEC.stage_layers, {"a": 1, "b": 0}, swarm_snapshot(member_view(), SPEC, max_in_flight=8)[0])
    adoption = Adoption(**{**region_plan().__dict__, "plan": plan})
    change, _ = proposed_change(adoption, member_view(), SPEC, SPEC, peer_id="a", now=TURN_OF_A, period=PERIOD)
    proposal = proposal_record(change)
    view = member_view(MEMBERS[1:])
    view.all_records = [proposal, *MEMBERS[1:]]
    assert judge_proposal(proposal, view, SPEC, SPEC, max_in_flight=8) == ""
    snapshot, stage_of = swarm_snapshot(view, SPEC, max_in_flight=8, extra=[proposal])
    assert "a" in snapshot.index_by_peer_id and "a" not in stage_of  # in the plan's estimate, not the running one
