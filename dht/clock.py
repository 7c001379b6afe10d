"""One peer's time: what every wait, deadline, period and timestamp of ``dht/``, ``swarm/`` and
``replication/`` reads (issue 34, "one clock"; ``peer/`` is next).

A clock gives three things:

- ``clock()`` (or ``clock.now()``): monotonic seconds, for deadlines, periods and durations. Calling
  the clock reads it, so a clock goes wherever a ``clock: Callable[[], float]`` went before;
- ``clock.dht_time()``: the DHT's wall-clock seconds, for record expirations and the timestamps other
  peers read (``announced_at``, ``averaged_at``);
- ``await clock.sleep(seconds)``: the only way our code waits for time to pass.

:data:`SYSTEM_CLOCK` is production's: ``time.monotonic``, the wall clock (what hivemind's
``get_dht_time`` reads) and ``asyncio.sleep``. A simulation gives each of its peers a clock on its virtual time
instead; nothing of ours then reads the machine's time behind its back, which
``tests/unit/test_one_clock.py`` checks.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic readings, the DHT's time, and a sleep (see the module's docstring)."""

    def __call__(self) -> float:
        """Monotonic seconds: the same as :meth:`now`."""

    def now(self) -> float:
        """Monotonic seconds, for deadlines, periods and durations."""

    def dht_time(self) -> float:
        """The DHT's wall-clock seconds, for expirations and timestamps other peers read."""

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (0 or less: yield to the loop once)."""


class SystemClock:
    """The machine's clocks: ``time.monotonic``, the wall clock and ``asyncio.sleep``."""

    def __call__(self) -> float:
        return time.monotonic()

    def now(self) -> float:
        return time.monotonic()

    def dht_time(self) -> float:
        return time.time()  # hivemind's get_dht_time is time.time; importing it would import hivemind

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    def __repr__(self) -> str:
        return "SystemClock()"


SYSTEM_CLOCK: Clock = SystemClock()
