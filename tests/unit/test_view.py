"""SwarmView's membership filters: departed peers vanish at once and come back only with a new record;
a read that may have missed records (slow, or empty) proves no absence."""

from __future__ import annotations

from dht.records import PeerRecord
from swarm.view import SwarmView


def record(peer_id: str, stage: int, *, state: str = "training", announced_at: float = 100.0) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, role="reliable", state=state, stage=stage, flops=1e9, announced_at=announced_at)


def test_members_are_training_peers_of_the_stage():
    view = SwarmView(None, "run")
    view.records = [record("a", 0), record("b", 1), record("c", 1, state="syncing"), record("d", 1, state="leaving")]
    assert [r.peer_id for r in view.members(1)] == ["b"]
    assert [r.peer_id for r in view.members(1, states=("training", "syncing"))] == ["b", "c"]


def test_a_departed_peer_is_excluded_until_it_announces_itself_again():
    view = SwarmView(None, "run")
    view.records = [record("a", 0), record("b", 0)]
    view.mark_departed("b")
    assert [r.peer_id for r in view.members(0)] == ["a"]
    view.records = [record("a", 0), record("b", 0)]  # its old record is still in the DHT
    assert [r.peer_id for r in view.members(0)] == ["a"]
    view.records = [record("a", 0), record("b", 0, announced_at=200.0)]  # it rejoined
    assert [r.peer_id for r in view.members(0)] == ["a", "b"]


def test_marking_an_unknown_peer_does_not_hide_its_future_record():
    view = SwarmView(None, "run")
    view.mark_departed("ghost")
    view.records = [record("ghost", 0, announced_at=5.0)]
    assert [r.peer_id for r in view.members(0)] == ["ghost"]


def test_a_slow_read_keeps_the_records_it_missed_for_the_carry_over():
    clock = [0.0]
    view = SwarmView(None, "run", carry_over=30.0, clock=lambda: clock[0])
    changes = []
    view.on_change = lambda kind, r: changes.append((kind, r.peer_id))
    view.apply_read([record("a", 0), record("b", 1)], seconds=0.5)
    assert view.complete_reads == 1
    clock[0] = 20.0
    view.apply_read([record("a", 0)], seconds=5.0)  # waited out a silent DHT node: "b" may exist
    assert [r.peer_id for r in view.members(1)] == ["b"] and view.complete_reads == 0 and view.num_carried == 1
    clock[0] = 25.0
    view.apply_read([], seconds=0.2)  # fast, but found nothing at all: no proof either
    assert [r.peer_id for r in view.records] == ["a", "b"] and view.num_carried == 3
    clock[0] = 31.0
    view.apply_read([record("a", 0)], seconds=5.0)  # "b" last shown at 0.0, 31 s ago
    assert [r.peer_id for r in view.records] == ["a"]
    assert sorted(changes[:2]) == [("scale_out", "a"), ("scale_out", "b")] and changes[2:] == [("scale_in", "b")]


def test_a_complete_read_drops_a_missing_record_at_once():
    clock = [0.0]
    view = SwarmView(None, "run", clock=lambda: clock[0])
    view.apply_read([record("a", 0), record("b", 1)], seconds=0.5)
    clock[0] = 1.0
    view.apply_read([record("a", 0)], seconds=0.5)
    assert [r.peer_id for r in view.records] == ["a"] and view.num_carried == 0


def test_a_carried_record_is_replaced_by_a_newer_one():
    clock = [0.0]
    view = SwarmView(None, "run", clock=lambda: clock[0])
    view.apply_read([record("a", 0), record("b", 1)], seconds=0.5)
    clock[0] = 5.0
    view.apply_read([record("b", 0, announced_at=200.0)], seconds=6.0)  # "b" moved to stage 0; "a" carried
    assert [(r.peer_id, r.stage) for r in view.records] == [("a", 0), ("b", 0)]


def test_a_complete_read_keeps_a_missing_peer_this_peer_still_hears_for_the_carry_over():
    clock = [0.0]
    view = SwarmView(None, "run", carry_over=30.0, clock=lambda: clock[0])
    answering = {"b"}
    view.vouch = lambda peer_id: peer_id in answering
    view.apply_read([record("a", 0), record("b", 1), record("c", 1)], seconds=0.5)
    clock[0] = 10.0
    view.apply_read([record("a", 0)], seconds=0.5)  # "b" and "c" lapsed; only "b" answers pings
    assert [r.peer_id for r in view.members(1)] == ["b"] and view.num_carried == 1
    clock[0] = 31.0
    view.apply_read([record("a", 0)], seconds=0.5)  # "b" was last in a read 31 s ago
    assert [r.peer_id for r in view.records] == ["a"]
    view.apply_read([record("a", 0), record("b", 1)], seconds=0.5)  # its heartbeats landed again
    answering.clear()
    clock[0] = 32.0
    view.apply_read([record("a", 0)], seconds=0.5)  # it stopped answering too: gone at once
    assert [r.peer_id for r in view.records] == ["a"]
