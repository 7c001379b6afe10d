"""A clock a test moves by hand, for the components that take ``clock`` (``dht.clock.SYSTEM_CLOCK`` by
default): a :class:`dht.clock.Clock` whose time passes only when the test, or a sleep on it, says so."""

from __future__ import annotations

import asyncio


class FakeClock:
    """Monotonic seconds that pass only when the test says so: ``clock()`` reads ``now``.

    Pass it as ``clock=`` to ``BackupKeeper``, ``RescueWatch``, ``Router``, ``StageConfirmation`` or
    ``LayoutWatch``, then :meth:`advance` it between steps instead of sleeping.
    """

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def dht_time(self) -> float:
        """The DHT's seconds: this clock's, from the same origin (a test's records expire on it)."""
        return self.now

    async def sleep(self, seconds: float) -> None:
        """A sleep on this clock: it moves ``seconds`` forward at once and yields to the loop once."""
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)

    def advance(self, seconds: float) -> None:
        """Move ``seconds`` forward (a monotonic clock never goes back).

        Raises:
            ValueError: ``seconds`` is negative.
        """
        if seconds < 0:
            raise ValueError(f"a monotonic clock does not go back ({seconds} s)")
        self.now += seconds
