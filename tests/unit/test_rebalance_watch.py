"""peer.rebalance: when a peer is the one to move to the bottleneck stage, on an injected clock (a
view built from records, no DHT; no test waits on the wall clock)."""

from __future__ import annotations

import asyncio

import pytest

from dht.records import PeerRecord, RunSpec
from peer.errors import UserError
from peer.rebalance import RebalanceWatch
from swarm.view import SwarmView
from tests.unit.fake_clock import FakeClock

SPEC = RunSpec(run_id="run")  # two stages of equal cost
PERIOD = 10.0


def record(peer_id: str, stage: int, *, state: str = "training", pinned: bool = False) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, role="reliable", state=state, stage=stage, flops=1e9, pinned=pinned)


def watch(peer_id: str, records: list[PeerRecord], clock: FakeClock) -> RebalanceWatch:
    view = SwarmView(None, "run")
    view.records = records
    return RebalanceWatch(view, SPEC, peer_id=peer_id, period=PERIOD, min_gain=0.2, clock=clock)


UNBALANCED = [record("a", 0), record("b", 0), record("c", 0), record("d", 1)]  # stage 1 is the bottleneck


def test_only_the_named_peer_moves_and_only_after_settling_two_periods():
    clock = FakeClock(100.0)
    watches = {p: watch(p, UNBALANCED, clock) for p in "abcd"}
    clock.advance(2 * PERIOD - 0.5)
    assert all(w.check(is_training=True) is None for w in watches.values()), "nobody moves before settling"
    clock.advance(0.5)
    moves = {p: w.check(is_training=True) for p, w in watches.items()}
    named = [p for p, move in moves.items() if move is not None]
    assert len(named) == 1 and moves[named[0]].to_stage == 1 and moves[named[0]].from_stage == 0
    assert named[0] in "abc"
    assert watches[named[0]].check(is_training=False) is None, "a paused or leaving peer does not move"


def test_peers_whose_records_say_pinned_are_never_named():
    clock = FakeClock(100.0)
    records = [record("a", 0, pinned=True), record("b", 0, pinned=True), record("c", 0), record("d", 1)]
    watches = {p: watch(p, records, clock) for p in "abcd"}
    clock.advance(2 * PERIOD)
    moves = {p: w.check(is_training=True) for p, w in watches.items()}
    assert [p for p, move in moves.items() if move is not None] == ["c"]
    all_pinned = [record(p, 0, pinned=True) for p in "abc"] + [record("d", 1)]
    pinned_watches = [watch(p, all_pinned, clock) for p in "abcd"]
    clock.advance(2 * PERIOD)
    assert all(w.check(is_training=True) is None for w in pinned_watches)


def test_nobody_moves_while_a_peer_joins_or_when_the_swarm_is_balanced():
    clock = FakeClock()
    joining = UNBALANCED + [record("e", -1, state="joining")]
    clock.advance(3 * PERIOD)
    assert all(watch(p, joining, clock).check(is_training=True) is None for p in "abcd")
    balanced = [record("a", 0), record("b", 1)]
    first = watch("a", balanced, clock)
    clock.advance(3 * PERIOD)
    assert first.check(is_training=True) is None


def named_peer() -> str:
    clock = FakeClock()
    watches = {p: watch(p, UNBALANCED, clock) for p in "abcd"}
    clock.advance(2 * PERIOD)
    return next(p for p, w in watches.items() if w.check(is_training=True) is not None)


def test_wait_skips_a_move_that_does_not_fit_the_peers_memory(monkeypatch):
    clock = FakeClock()
    w = watch(named_peer(), UNBALANCED, clock)
    looks = []

    async def one_period(seconds: float) -> None:  # the clock moves a period per look: no wall-clock wait
        looks.append(seconds)
        clock.advance(seconds)
        if len(looks) > 10:
            raise TimeoutError("the watch kept looking")

    def check_memory(stage: int) -> None:
        if len(looks) < 4:
            raise UserError(f"Stage {stage} needs more memory than this peer has.")

    monkeypatch.setattr("peer.rebalance.asyncio.sleep", one_period)
    move = asyncio.run(w.wait(lambda: True, check_memory))
    assert move.to_stage == 1 and len(looks) == 4 and set(looks) == {PERIOD}  # settled at 2, refused at 2 and 3


def test_a_negative_min_gain_is_refused_by_the_planner():
    clock = FakeClock(1e6)
    w = RebalanceWatch(SwarmView(None, "run"), SPEC, peer_id="a", period=PERIOD, min_gain=-0.1, clock=clock)
    w.view.records = UNBALANCED
    clock.advance(3 * PERIOD)
    with pytest.raises(ValueError):
        w.check(is_training=True)


def test_every_check_that_counted_is_reported_with_the_swarm_s_move():
    clock, seen = FakeClock(), []
    w = RebalanceWatch(SwarmView(None, "run"), SPEC, peer_id="d", period=PERIOD, min_gain=0.2, clock=clock,
                       on_check=seen.append)
    w.view.records = UNBALANCED
    assert w.check(is_training=True) is None and seen == []  # not settled: no check counted
    clock.advance(2 * PERIOD)
    assert w.check(is_training=True) is None  # the move is another peer's...
    assert len(seen) == 1 and seen[0].to_stage == 1 and seen[0].peer_id != "d"  # ...but the check is reported
