"""Which frozen versions a donor keeps for the callers still pulling them (issue #15, the donor's side).

A donor (``replication/server.py``) freezes one copy of its state per version it serves and keeps the
newest ``max_cached``. A lone holder trains on while it serves, and every manifest request that names
no version (another joiner, the stage's backup keeper, the bootstrap's samples) freezes a new one. On
an emulated 20 Mbit/s + 40 ms link a 2 s pull outlived its version: ``version 0 is not held here
(held: [1, 3])``, and the joiner died. On loopback the pull takes 0.07 s and the race never shows.

So a version a caller is pulling is *pinned* and not evicted while the pull goes on:

* a caller's pin is placed by its manifest request and renewed by each of its piece requests for a
  version still held; one pin per (caller, stage): a caller that moves to another version releases
  the one before;
* a pin lapses ``hold_timeout`` seconds after its caller's last request (a joiner that died or gave
  up holds nothing for long);
* at most ``max_pinned`` versions per stage are kept for pins beyond the newest ``max_cached``, those
  asked for most recently first, and at most ``max_callers`` pins are tracked at all. A hostile
  caller, or many, can hold at most ``max_pinned`` extra copies of the state, and only by asking for
  pieces again and again, which it could do anyway.

A joiner whose version goes anyway (the pins are taken, its pin lapsed) is told so by a
``VersionGoneError`` refusal and re-plans its pull on the newest version (``replication/transfer.py``).
Both are needed: the pin makes the common case (one joiner, one lone holder) cost nothing, the re-plan
makes the bounded pin safe.

Pure bookkeeping with an injected clock (seconds, monotonic), so the tests need no wall clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dht.clock import SYSTEM_CLOCK

__all__ = ["VersionPins"]


@dataclass(frozen=True)
class _Pin:
    version: int
    touched: float


class VersionPins:
    """The versions callers are pulling, per stage (see the module docstring).

    Args:
        hold_timeout: seconds a pin lasts after its caller's last request; longer than the gap
            between two requests of one pull (a few shard service times on the slowest link).
        max_pinned: versions per stage kept for pins beyond the newest ``max_cached`` (each is one
            more copy of the stage's state in memory); 0 turns pinning off.
        max_callers: pins tracked at most; the least recently renewed go first.
        clock: monotonic seconds.
    """

    def __init__(self, *, hold_timeout: float, max_pinned: int = 1, max_callers: int = 256,
                 clock: Callable[[], float] = SYSTEM_CLOCK) -> None:
        if not hold_timeout > 0 or max_pinned < 0 or max_callers < 1:
            raise ValueError("hold_timeout must be > 0, max_pinned >= 0 and max_callers >= 1")
        self.hold_timeout, self.max_pinned, self.max_callers, self.clock = hold_timeout, max_pinned, max_callers, clock
        self._pins: dict[tuple[str, int], _Pin] = {}  # (caller, stage) -> pin, least recently renewed first

    def __len__(self) -> int:
        self._expire(self.clock())
        return len(self._pins)

    def touch(self, caller: str, stage: int, version: int) -> None:
        """``caller`` is pulling ``version`` of ``stage`` now: pin it, or renew its pin."""
        now = self.clock()
        self._pins.pop((caller, stage), None)
        self._pins[caller, stage] = _Pin(version, now)
        self._expire(now)
        while len(self._pins) > self.max_callers:
            del self._pins[next(iter(self._pins))]

    def release(self, stage: int) -> None:
        """Forget every pin of ``stage`` (its versions were dropped: a backup this peer no longer keeps)."""
        for key in [key for key in self._pins if key[1] == stage]:
            del self._pins[key]

    def pinned(self, stage: int) -> list[int]:
        """The versions of ``stage`` pinned now, the most recently asked for first."""
        self._expire(self.clock())
        versions: list[int] = []
        for (_, pinned_stage), pin in reversed(self._pins.items()):
            if pinned_stage == stage and pin.version not in versions:
                versions.append(pin.version)
        return versions

    def keep(self, stage: int, held: list[int], *, max_cached: int) -> set[int]:
        """Of ``held`` (the versions of ``stage`` cached, least recently used first), those to keep:
        the newest ``max_cached``, and up to ``max_pinned`` more that callers are pulling."""
        recent = set(held[-max_cached:]) if max_cached > 0 else set()
        extra = [v for v in self.pinned(stage) if v in held and v not in recent][: self.max_pinned]
        return recent | set(extra)

    def _expire(self, now: float) -> None:
        while self._pins:
            key, pin = next(iter(self._pins.items()))
            if now - pin.touched <= self.hold_timeout:
                return
            del self._pins[key]
