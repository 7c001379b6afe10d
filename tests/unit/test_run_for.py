"""``--run-for`` counts from the start of training across stages and standing by
(``peer.entry.stop_or_after``, which ``peer.lifecycle.Peer`` serves under)."""

from __future__ import annotations

import asyncio

from peer.entry import stop_or_after


def test_the_event_is_set_by_the_time_or_by_stop_and_never_sets_stop():
    async def scenario():
        stop = asyncio.Event()
        async with stop_or_after(stop, 0.01) as leave:
            await asyncio.wait_for(leave.wait(), 5.0)  # the time ran out
            assert not stop.is_set()  # so a Ctrl+C now is a first one: a graceful leave
        async with stop_or_after(stop, 0) as leave:  # 0: never by time
            await asyncio.sleep(0.02)
            assert not leave.is_set()
            stop.set()
            await asyncio.wait_for(leave.wait(), 5.0)

    asyncio.run(scenario())

