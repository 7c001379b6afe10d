"""SwarmView's membership filters: departed peers vanish at once and come back only with a new record."""

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
