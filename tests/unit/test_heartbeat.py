"""peer.heartbeat: a DHT store stuck on a congested link does not hold the next heartbeats back, and
stores that all hang do not pile up (issue #15). The loop's sleep is injected: each period is one
turn of the event loop, no wall clock."""

from __future__ import annotations

import asyncio
import random

from peer.heartbeat import MAX_IN_FLIGHT, Heartbeat


def drive(publish, periods: int, *, ttl: float = 6.0) -> Heartbeat:
    """Run a heartbeat for ``periods`` periods; returns it (its counters) after it stopped."""

    async def main() -> Heartbeat:
        stop = asyncio.Event()
        turns = 0

        async def one_period(_: float) -> None:
            nonlocal turns
            turns += 1
            for _ in range(3):  # let the stores started so far run as far as they can
                await asyncio.sleep(0)
            if turns >= periods:
                stop.set()

        heartbeat = Heartbeat(publish, period=1.0, ttl=ttl, rng=random.Random(0), sleep=one_period)
        await heartbeat.run(stop)
        await asyncio.sleep(0)  # the cancelled stores finish cancelling
        return heartbeat

    return asyncio.run(main())


def test_a_store_that_hangs_does_not_hold_the_next_heartbeats_back():
    stored, stuck = [], asyncio.Event()

    async def publish() -> None:
        if not stored and not stuck.is_set():
            stuck.set()
            await asyncio.Event().wait()  # the first store waits on a congested link (until its timeout)
        stored.append(1)

    heartbeat = drive(publish, periods=10)
    assert heartbeat.num_started == 10 and len(stored) == 9  # every later period stored the record
    assert not heartbeat.in_flight  # the stuck one was cancelled when the loop stopped


def test_stores_that_all_hang_are_bounded_and_the_loop_goes_on():
    async def publish() -> None:
        await asyncio.Event().wait()

    heartbeat = drive(publish, periods=10)
    assert heartbeat.num_started == MAX_IN_FLIGHT and heartbeat.num_skipped == 10 - MAX_IN_FLIGHT


def test_a_failed_store_is_counted_and_the_next_period_tries_again():
    calls = []

    async def publish() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("the DHT could not reach its nearest nodes")

    heartbeat = drive(publish, periods=4)
    assert heartbeat.num_failed == 1 and len(calls) == 4
