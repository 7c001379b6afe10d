"""A peer's heartbeat: its record stored in the DHT every ``--heartbeat-period`` seconds.

A store that waits on a congested link must not hold the next one back. On an emulated 20 Mbit/s
uplink full of activations (issue #15) a DHT store took up to its whole timeout every 15–30 s; with
one store after the other, the next began only after that timeout, and the record, which lives
``--heartbeat-ttl`` seconds from its last store, came within a second of expiring. So every period
starts a store of its own, whatever the ones before are doing: each may take up to ``ttl - period``
seconds, and at most :data:`MAX_IN_FLIGHT` wait at once (a peer whose every store hangs does not pile
up tasks). Stores are idempotent: the DHT keeps the value with the latest expiration, the newest.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)
MAX_IN_FLIGHT = 3  # heartbeat stores waiting at once; a period that finds this many skips its own
SLOW_WARNING_PERIOD = 60.0  # seconds between warnings of slow heartbeats


class Heartbeat:
    """Calls ``publish`` (store this peer's record) every ``period`` seconds, jittered by ``rng``,
    until ``stop``; ``clock`` and ``sleep`` are injected so a test drives it without the wall clock."""

    def __init__(self, publish: Callable[[], Awaitable[object]], *, period: float, ttl: float,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.publish, self.period, self.ttl = publish, period, ttl
        self.clock, self.rng, self.sleep = clock, rng if rng is not None else random.Random(), sleep
        self.in_flight: set[asyncio.Task] = set()
        self.num_started = self.num_skipped = self.num_failed = 0
        self._warned = -math.inf

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                if len(self.in_flight) < MAX_IN_FLIGHT:
                    task = asyncio.create_task(self._beat(), name="heartbeat")
                    self.in_flight.add(task)
                    task.add_done_callback(self.in_flight.discard)
                    self.num_started += 1
                else:
                    self.num_skipped += 1
                    logger.debug(f"{MAX_IN_FLIGHT} heartbeats still waiting on the DHT: this one skipped")
                await self.sleep(self.period * self.rng.uniform(0.8, 1.2))
        finally:
            for task in list(self.in_flight):
                task.cancel()

    async def _beat(self) -> None:
        started = self.clock()
        try:
            await asyncio.wait_for(self.publish(), timeout=self.ttl - self.period)
        except Exception as e:
            self.num_failed += 1
            logger.warning(f"heartbeat failed: {e!r}")
        elapsed = self.clock() - started
        # a slow link makes a DHT store take longer than the period: news only when it nears the
        # record's lifetime (others would drop this peer), and then once a minute
        if elapsed > self.ttl / 3 and self.clock() - self._warned > SLOW_WARNING_PERIOD:
            self._warned = self.clock()
            logger.warning(f"heartbeat took {elapsed:.2f}s; records live {self.ttl:.0f}s: on a slow link raise "
                           f"--heartbeat-ttl")
