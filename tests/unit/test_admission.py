"""The members-only pipeline's gate (swarm.admission): only the previous stage's peers, each at a
bounded rate; an unknown sender makes the view read again at most once per recheck age."""

from __future__ import annotations

import asyncio

import pytest

from dht.records import PeerRecord
from swarm.admission import NOT_MEMBER, RATE_LIMITED, Admission, RateLimit
from swarm.view import SwarmView
from tests.unit.fake_clock import FakeClock


def record(peer_id: str, stage: int, state: str = "training") -> PeerRecord:
    return PeerRecord(peer_id=peer_id, role="reliable", state=state, stage=stage, flops=1e9, announced_at=100.0)


class ScriptedView(SwarmView):
    """A view whose DHT reads return the records the test lines up (``reads``), counted."""

    def __init__(self, clock: FakeClock, records: list[PeerRecord]) -> None:
        super().__init__(None, "run", clock=clock)
        self.apply_read(records, seconds=0.0)
        self.reads: list[list[PeerRecord]] = []
        self.num_reads = 0

    async def refresh(self) -> list[PeerRecord]:
        self.num_reads += 1
        return self.apply_read(self.reads.pop(0) if self.reads else self.all_records, seconds=0.0)


def test_only_peers_of_the_previous_stage_are_admitted():
    clock = FakeClock(10.0)
    view = ScriptedView(clock, [record("up", 0, "syncing"), record("same", 1), record("down", 2)])
    gate = Admission(view, 1, clock=clock)

    async def main():
        assert await gate.check("up") == ""
        for sender in ("same", "down", "stranger"):
            assert await gate.check(sender) == NOT_MEMBER

    asyncio.run(main())
    assert gate.refused[NOT_MEMBER] == 3


def test_nobody_feeds_stage_zero():
    clock = FakeClock(10.0)
    view = ScriptedView(clock, [record("a", 0), record("b", 1)])
    assert asyncio.run(Admission(view, 0, clock=clock).check("a")) == NOT_MEMBER
    assert view.num_reads == 0  # no read could change that


def test_an_unknown_sender_is_looked_up_once_more_and_a_newcomer_is_found():
    clock = FakeClock(10.0)
    view = ScriptedView(clock, [record("old", 0)])
    gate = Admission(view, 1, recheck_age=0.5, clock=clock)
    clock.advance(0.6)
    view.reads = [[record("old", 0), record("new", 0)]]  # the newcomer declared itself since the last read
    assert asyncio.run(gate.check("new")) == ""
    assert view.num_reads == 1


def fake_sleep(clock: FakeClock, slept: list[float]):
    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.advance(seconds)
    return sleep


def test_a_newcomer_whose_record_lands_just_after_a_read_is_found_by_the_next():
    """CI 2026-11-27: stage 1 read the view, stage 0's newcomer stored its record a moment later and
    sent its first microbatch within the recheck age: it waits for a read that began after it came."""
    clock, slept = FakeClock(10.0), []
    view = ScriptedView(clock, [record("old", 0)])
    gate = Admission(view, 1, recheck_age=0.5, clock=clock, sleep=fake_sleep(clock, slept))

    async def main() -> None:
        clock.advance(0.05)
        assert await gate.check("stranger") == NOT_MEMBER  # one more read, at 10.05, did not show it
        clock.advance(0.05)
        view.reads = [[record("old", 0), record("new", 0)]]  # the newcomer stored its record since
        assert await gate.check("new") == ""

    asyncio.run(main())
    assert view.num_reads == 2 and slept == [pytest.approx(0.45)]  # the second read waited out the recheck age


def test_a_flood_of_strangers_costs_at_most_one_read_per_recheck_age():
    clock, slept = FakeClock(10.0), []
    view = ScriptedView(clock, [record("old", 0)])
    gate = Admission(view, 1, recheck_age=0.5, clock=clock, sleep=fake_sleep(clock, slept))

    async def flood(count: int, name: str) -> list[str]:
        return await asyncio.gather(*(gate.check(f"{name}{n}") for n in range(count)))

    clock.advance(1.0)
    assert set(asyncio.run(flood(100, "stranger"))) == {NOT_MEMBER}
    assert view.num_reads == 1 and not slept  # one read, shared by all 100
    clock.advance(0.4)
    assert set(asyncio.run(flood(100, "other"))) == {NOT_MEMBER}
    assert view.num_reads == 2 and slept == [pytest.approx(0.1)]  # the next read waited for its turn
    assert clock() == pytest.approx(11.5)


def test_a_member_over_its_rate_is_limited_and_recovers():
    clock = FakeClock(10.0)
    view = ScriptedView(clock, [record("up", 0), record("other", 0)])
    gate = Admission(view, 1, max_per_second=10.0, clock=clock)  # bursts of 20

    async def send(sender: str, count: int) -> list[str]:
        return [await gate.check(sender) for _ in range(count)]

    assert asyncio.run(send("up", 20)) == [""] * 20
    assert asyncio.run(send("up", 1)) == [RATE_LIMITED]
    assert asyncio.run(send("other", 1)) == [""]  # one sender's flood is its own
    clock.advance(0.5)
    assert asyncio.run(send("up", 6)) == [""] * 5 + [RATE_LIMITED]
    assert gate.refused[RATE_LIMITED] == 2


def test_no_limit_with_a_rate_of_zero():
    clock = FakeClock(10.0)
    gate = Admission(ScriptedView(clock, [record("up", 0)]), 1, max_per_second=0.0, clock=clock)

    async def send() -> list[str]:
        return [await gate.check("up") for _ in range(10_000)]

    assert asyncio.run(send()) == [""] * 10_000


def test_the_rate_limit_forgets_the_least_recent_senders_first():
    clock = FakeClock()
    limit = RateLimit(1.0, burst=1.0, clock=clock, max_senders=2)
    assert limit.allow("a") and limit.allow("b") and not limit.allow("a")
    assert limit.allow("c")  # "b" is forgotten ...
    assert limit.allow("b")  # ... and comes back with a full bucket; "a" was the least recent now
    assert limit.allow("a")
    with pytest.raises(ValueError):
        RateLimit(0.0)


def test_a_sender_that_keeps_pushing_after_refusals_earns_strikes_and_a_ban():
    from dht.reputation import Reputation
    from swarm.admission import TURNED_AWAY_PER_STRIKE

    clock = FakeClock(10.0)
    reputation = Reputation(max_strikes=8, clock=clock)
    gate = Admission(ScriptedView(clock, [record("up", 0)]), 1, reputation=reputation, clock=clock)

    async def send(sender: str, count: int) -> None:
        for _ in range(count):
            await gate.check(sender)

    asyncio.run(send("newcomer", TURNED_AWAY_PER_STRIKE - 1))  # an honest newcomer turned away a few times
    assert reputation.num_strikes_of("newcomer") == 0
    asyncio.run(send("flooder", 8 * TURNED_AWAY_PER_STRIKE))
    assert reputation.is_banned("flooder") and not reputation.is_banned("newcomer")


def test_a_sender_turned_away_once_waits_for_no_read_again():
    """Its first request waits for a read; the ones after are refused at once from the view (whose
    own refresh finds a newcomer refused once), so a flood is refused as fast as it comes."""
    clock, slept = FakeClock(10.0), []
    view = ScriptedView(clock, [record("old", 0)])
    gate = Admission(view, 1, recheck_age=0.5, clock=clock, sleep=fake_sleep(clock, slept))

    async def send(count: int) -> list[str]:
        return [await gate.check("stranger") for _ in range(count)]

    clock.advance(1.0)
    assert asyncio.run(send(100)) == [NOT_MEMBER] * 100
    assert view.num_reads == 1 and not slept and clock() == 11.0
    view.apply_read([record("old", 0), record("stranger", 0)], seconds=0.0)  # the view's own refresh
    assert asyncio.run(send(1)) == [""]
