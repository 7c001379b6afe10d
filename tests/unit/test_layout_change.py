"""A running swarm's layout change, on views built from records (peer/relayout.py): who re-plans and
when, who adopts another peer's layout, where each peer goes, what a joiner trains under; and the
layout fields of records and views (dht/records.py, swarm/view.py). The re-plan timer runs on a
FakeClock (``LayoutWatch``, the decision inside ``wait_layout_change``): no test waits."""

from __future__ import annotations

import asyncio

import pytest

from dht.records import ModelSpec, PeerRecord, RunSpec
from peer.backup import MIN_COMPLETE_READS, RescueWatch
from peer.memory_model import layer_memory_bytes, stage_memory_bytes, stage_overhead_bytes
from peer.relayout import LayoutWatch, adopted_layout, joiner_layout, new_stage_of, record_layout, replanned_layout
from planner.replanning import MemoryBudgetError
from swarm.view import SwarmView
from tests.unit.fake_clock import FakeClock

BASE = RunSpec(run_id="run", model=ModelSpec(num_layers=6), stage_layers=((0, 2), (2, 4), (4, 6)))
V1 = ((0, 3), (3, 6))


def record(peer_id: str, stage: int, *, version: int = 0, layers=(), layout_map=(), state: str = "training",
           flops: float = 1e9, memory_bytes: int = 0) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, role="reliable", state=state, stage=stage, flops=flops, announced_at=100.0,
                      layout_version=version, stage_layers=layers, layout_map=layout_map, memory_bytes=memory_bytes)


def view_of(records: list[PeerRecord], spec: RunSpec = BASE) -> SwarmView:
    view = SwarmView(None, "run")
    view.all_records = records
    view.set_layout(spec.layout_version, spec.stage_layers)
    view.complete_reads = MIN_COMPLETE_READS
    return view


def test_records_carry_their_layout_and_refuse_a_malformed_one() -> None:
    mine = record("a", 1, version=1, layers=V1, layout_map=(0, -1, 1))
    assert PeerRecord.from_wire(mine.to_wire()) == mine
    for bad in ({"stage_layers": [[0, 3], [2, 6]]}, {"stage_layers": [[0, "3"]]}, {"stage_layers": 7},
                {"layout_map": [0, 99]}, {"layout_map": "x"}, {"layout_version": -1}, {"layout_map": [True]},
                {"memory_bytes": -1}, {"memory_bytes": 1.5}, {"memory_bytes": "8G"}):
        with pytest.raises(ValueError):
            PeerRecord.from_wire({**mine.to_wire(), **bad})
    assert PeerRecord.from_wire({k: v for k, v in mine.to_wire().items()
                                 if k not in ("layout_version", "stage_layers", "layout_map")}).layout_version == 0


def test_a_layouts_spec_is_namespaced_and_checked() -> None:
    spec = BASE.with_layout(1, V1)
    assert (spec.namespace, spec.num_stages, BASE.namespace) == ("run@L1", 2, "run")
    with pytest.raises(ValueError):
        BASE.with_layout(1, ((0, 3), (3, 5)))  # does not cover the model's 6 layers
    assert RunSpec.from_wire(spec.to_wire()) == spec


def test_a_view_holds_its_own_layouts_peers_only() -> None:
    records = [record("a", 0), record("b", 1, version=1, layers=V1), record("c", 1, version=1, layers=((0, 2), (2, 6)))]
    view = view_of(records)
    assert [r.peer_id for r in view.records] == ["a"]
    view.set_layout(1, V1)
    assert [r.peer_id for r in view.records] == ["b"], "same version, other ranges: another layout"
    assert len(view.all_records) == 3


def watching(view: SwarmView, peer_id: str, lost: list[PeerRecord]) -> RescueWatch:
    """A watch that saw ``lost`` hold their stages, then saw them gone (at t = 100)."""
    watch = RescueWatch(view, BASE, peer_id=peer_id, settle=3.0)
    records = view.records
    view.records = records + lost
    watch.check(90.0)
    view.records = records
    watch.check(100.0)
    return watch


def test_the_peers_left_replan_once_the_unrescuable_stage_settled() -> None:
    records = [record("a", 0), record("c", 2, flops=2e9)]
    view = view_of(records)
    never_held = RescueWatch(view, BASE, peer_id="a", settle=3.0)
    never_held.check(100.0)
    assert never_held.unrescuable == {}, "a stage never seen held is not lost: the swarm is still forming"
    watch = watching(view, "a", [record("b", 1)])
    assert watch.unrescuable == {1: 100.0}, "no stage can spare a peer"
    assert replanned_layout(view, BASE, watch, peer_id="a", stage=0, now=105.0, after=8.0, max_in_flight=4) is None, "not yet"
    change = replanned_layout(view, BASE, watch, peer_id="a", stage=0, now=108.0, after=8.0, max_in_flight=4)
    assert change.spec.stage_layers == ((0, 2), (2, 6)) and change.spec.layout_version == 1
    assert (change.layout_map, change.stage, change.unheld, change.reason) == ((0, -1, 1), 0, (1,), "replanned")
    other = replanned_layout(view, BASE, watch, peer_id="c", stage=2, now=108.0, after=8.0, max_in_flight=4)
    assert other.spec == change.spec and other.stage == 1, "every survivor computes the same layout"


def test_a_replan_gives_no_peer_more_layers_than_its_record_offers_memory_for() -> None:
    def room_for(num_layers: int) -> int:
        """Memory for the last ``num_layers`` blocks (the heaviest: the head's) and what any stage needs
        beyond its blocks (the fixed overhead, held outputs, the backward's working set)."""
        return stage_overhead_bytes(BASE, max_in_flight=4) + sum(layer_memory_bytes(BASE, max_in_flight=4)[-num_layers:])

    # by capacity the faster "c" would take layers 2-5; it offers room for three layers only
    view = view_of([record("a", 0), record("c", 2, flops=2e9, memory_bytes=room_for(3))])
    watch = watching(view, "a", [record("b", 1)])
    change = replanned_layout(view, BASE, watch, peer_id="a", stage=0, now=108.0, after=8.0, max_in_flight=4)
    assert change.spec.stage_layers == ((0, 3), (3, 6))
    assert stage_memory_bytes(change.spec, 1, max_in_flight=4) <= room_for(3)
    # with room for two layers on each survivor, no split of six fits: the peer waits for a volunteer
    tight = view_of([record("a", 0, memory_bytes=room_for(2)), record("c", 2, memory_bytes=room_for(2))])
    watch = watching(tight, "a", [record("b", 1)])
    with pytest.raises(MemoryBudgetError):
        replanned_layout(tight, BASE, watch, peer_id="a", stage=0, now=108.0, after=8.0, max_in_flight=4)
    # a claim below what a peer's current stage needs counts as that need: it cannot block every re-plan
    liar = view_of([record("a", 0), record("c", 2, memory_bytes=1)])
    watch = watching(liar, "a", [record("b", 1)])
    change = replanned_layout(liar, BASE, watch, peer_id="a", stage=0, now=108.0, after=8.0, max_in_flight=4)
    assert change.spec.stage_layers == ((0, 4), (4, 6)), "c keeps the two layers it holds, a takes the rest"


def test_a_stage_that_can_be_rescued_is_not_replanned() -> None:
    view = view_of([record("a", 0), record("b", 0), record("c", 2)])
    watch = watching(view, "a", [record("x", 1)])
    assert watch.unrescuable == {}
    assert replanned_layout(view, BASE, watch, peer_id="a", stage=0, now=200.0, after=8.0, max_in_flight=4) is None


def test_the_other_survivors_adopt_the_replanned_layout_and_go_where_its_map_says() -> None:
    proposer = record("a", 0, version=1, layers=V1, layout_map=(0, -1, 1))
    view = view_of([proposer, record("c", 2)])  # "a" moved on; "c" still under the run's layout
    change = adopted_layout(view, BASE, BASE, peer_id="c", stage=2)
    assert (change.spec.stage_layers, change.stage, change.proposer, change.reason) == (V1, 1, "a", "adopted")
    assert adopted_layout(view_of([proposer, record("b", 1), record("c", 2)]), BASE, BASE, peer_id="c", stage=2) is None, \
        "the layout drops stage 1, which this peer sees held"
    for layers, layout_map in ((((0, 6),), (0, -1, -1)), (V1, (0, 0, 1)), (V1, (0, -1))):
        hostile = record("h", 0, version=1, layers=layers, layout_map=layout_map)
        assert adopted_layout(view_of([hostile, record("a", 0), record("c", 2)]), BASE, BASE, peer_id="c",
                              stage=2) is None, (layers, layout_map)


def test_a_peer_the_proposer_missed_goes_where_its_layers_went() -> None:
    assert new_stage_of(BASE, BASE.with_layout(1, V1), (0, -1, 1), 1) == 0  # layers 2-3: middle is layer 2
    assert new_stage_of(BASE, BASE.with_layout(1, V1), (), 2) == 1


def test_a_joiner_trains_under_the_newest_layout_held() -> None:
    assert joiner_layout(view_of([record("a", 0)]), BASE) == BASE
    newer = [record("a", 0, version=1, layers=V1), record("b", 1, version=1, layers=V1), record("z", 0)]
    assert joiner_layout(view_of(newer), BASE) == BASE.with_layout(1, V1)
    syncing_only = [record("a", 0, version=1, layers=V1, state="syncing"), record("z", 0)]
    assert joiner_layout(view_of(syncing_only), BASE) == BASE, "only layouts of working peers count"
    assert record_layout(record("x", 0, version=1, layers=((0, 3), (3, 5))), BASE) is None, "not this model's layout"


def test_a_competing_replan_keeps_the_numbering_and_a_peer_cut_off_follows_the_swarm() -> None:
    mine = BASE.with_layout(1, ((0, 3), (3, 6)))
    smaller = record("b", 1, version=1, layers=((0, 2), (2, 6)), layout_map=(0, -1, 1))
    change = adopted_layout(view_of([smaller, record("a", 1, version=1, layers=((0, 3), (3, 6)))], mine), mine, BASE,
                            peer_id="a", stage=1)
    assert (change.spec.stage_layers, change.stage, change.layout_map) == (((0, 2), (2, 6)), 1, (0, 1))
    # "c" held stage 1 when the others, not seeing it, dropped stage 1: alone now, it follows them
    moved = [record("a", 0, version=1, layers=V1, layout_map=(0, -1, 1)),
             record("b", 1, version=1, layers=V1, layout_map=(0, -1, 1))]
    change = adopted_layout(view_of([*moved, record("c", 1)]), BASE, BASE, peer_id="c", stage=1)
    assert change.spec.stage_layers == V1 and change.stage == 0, "its layers 2-3 start in new stage 0"


def watching_lost_stage_1(clock: FakeClock, pinged: list[str], answering: set[str], *,
                          replan_after: float = 8.0) -> LayoutWatch:
    """Peer "a"'s layout watch on ``clock``, in a swarm whose stage 1 ("b") was lost at t = 100 and
    that no peer can rescue; its pings of ``answering`` peers are answered (every ping noted in ``pinged``)."""
    view = view_of([record("a", 0), record("c", 2, flops=2e9)])

    async def is_answering(peer_id: str) -> bool:
        pinged.append(peer_id)
        return peer_id in answering

    return LayoutWatch(view, BASE, BASE, watching(view, "a", [record("b", 1)]), peer_id="a", stage=0,
                       replan_after=replan_after, is_answering=is_answering, max_in_flight=4, clock=clock)


def test_the_layout_watch_replans_replan_after_seconds_after_the_stage_was_lost() -> None:
    clock, pinged = FakeClock(100.0), []
    layout_watch = watching_lost_stage_1(clock, pinged, set())
    clock.advance(7.5)
    assert asyncio.run(layout_watch.check()) is None and pinged == [], "not yet: nobody pinged"
    clock.advance(0.5)
    change = asyncio.run(layout_watch.check())
    assert change is not None and (change.reason, change.unheld) == ("replanned", (1,))
    assert change.spec.stage_layers == ((0, 2), (2, 6))
    assert pinged == ["b"], "the lost stage's last holder is pinged before the re-plan"


def test_the_layout_watch_does_not_replan_while_a_lost_holder_answers_a_ping() -> None:
    clock, pinged, answering = FakeClock(100.0), [], {"b"}
    layout_watch = watching_lost_stage_1(clock, pinged, answering)
    clock.advance(100.0)
    assert asyncio.run(layout_watch.check()) is None and asyncio.run(layout_watch.check()) is None
    assert pinged == ["b", "b"], "asked again at each look"
    answering.clear()  # its record was missing from the view, and now it is really gone
    assert asyncio.run(layout_watch.check()).reason == "replanned"


def test_the_layout_watch_replans_only_on_complete_reads_and_when_asked_to() -> None:
    clock, pinged = FakeClock(100.0), []
    layout_watch = watching_lost_stage_1(clock, pinged, set())
    clock.advance(100.0)
    layout_watch.view.complete_reads = MIN_COMPLETE_READS - 1  # this peer's own reads are slow: no evidence
    assert asyncio.run(layout_watch.check()) is None
    layout_watch.view.complete_reads = MIN_COMPLETE_READS
    assert asyncio.run(layout_watch.check()) is not None
    never = watching_lost_stage_1(clock, pinged, set(), replan_after=0.0)  # --replan-after 0: never re-plan
    clock.advance(1000.0)
    assert asyncio.run(never.check()) is None


def test_the_layout_watch_adopts_another_peers_layout_whatever_the_clock_says() -> None:
    view = view_of([record("a", 0, version=1, layers=V1, layout_map=(0, -1, 1)), record("c", 2)])

    async def is_answering(peer_id: str) -> bool:
        raise AssertionError("an adopted layout pings nobody")

    clock = FakeClock(0.0)
    layout_watch = LayoutWatch(view, BASE, BASE, RescueWatch(view, BASE, peer_id="c", settle=3.0, clock=clock),
                               peer_id="c", stage=2, replan_after=8.0, is_answering=is_answering, max_in_flight=4,
                               clock=clock)
    change = asyncio.run(layout_watch.check())
    assert (change.reason, change.proposer, change.stage) == ("adopted", "a", 1)


def test_a_peer_whose_replan_dropped_a_stage_that_was_not_lost_joins_the_others_where_it_is_needed() -> None:
    """CI: both survivors re-planned at once; "c" had also dropped "a"'s stage (its record and pings
    were missing for a while) and went to one stage, "a" to two. "c" takes the two-stage layout, at
    the stage nobody holds in it; "a" stays."""
    one = BASE.with_layout(1, ((0, 6),))
    a = record("a", 0, version=1, layers=V1, layout_map=(0, -1, 1))
    c = record("c", 0, version=1, layers=((0, 6),), layout_map=(-1, -1, 0))
    change = adopted_layout(view_of([a, c], one), one, BASE, peer_id="c", stage=0)
    assert change is not None and change.spec.stage_layers == V1 and change.spec.layout_version == 1
    assert change.stage == 1 and change.layout_map == () and change.proposer == "a"
    two = BASE.with_layout(1, V1)
    assert adopted_layout(view_of([a, c], two), two, BASE, peer_id="a", stage=0) is None
