"""Who may push work into a stage: the members-only pipeline.

A stage's forward handler serves only peers whose current signed records place them at the stage
before it (stage 0's peers own the data and feed stage 1; nobody feeds stage 0), each at a bounded
rate. Anybody else is refused before a byte of its request is read, with a reason and a count.

The check is a set lookup (``SwarmView.peers_at``, rebuilt once per view read), not a DHT read per
call. A sender missing from it may have joined since the last read, so an unknown sender waits for
a DHT read that began after its request arrived before the refusal stands (callers share the read,
and reads for this start at most one per ``recheck_age`` seconds, so a flood of strangers costs one
read per ``recheck_age``): an honest newcomer declared its record before its first microbatch
(``peer.lifecycle``), so the read finds it. A sender turned away before waits for no read again (the
view's own refresh, every second, finds a newcomer that was refused once): a stranger that keeps
pushing is refused at once, and earns its strikes at the rate it pushes. (A read that only had to be
younger than ``recheck_age`` missed a newcomer whose record landed just after it:
tests/e2e/test_compression.py, CI 2026-11-27.)

Being in the records is not a strong credential in an open swarm (anybody may publish a record that
claims stage k - 1 under its own bound identity; ``docs/security.md``); the rate limit bounds what
such a member can push, and its misbehaviour is struck and banned as before.

A sender that keeps pushing after it was turned away is struck once per ``TURNED_AWAY_PER_STRIKE``
refusals, so a flood earns a ban (its streams are then held unread for a while and closed
unanswered: ``swarm.stage_server``'s tarpit) while an honest newcomer turned away a few times before the view found it never comes near.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable

from dht.clock import SYSTEM_CLOCK
from dht.reputation import Reputation
from swarm.view import SwarmView

NOT_MEMBER, RATE_LIMITED = "not_member", "rate_limited"  # refusal codes a sender's router sees
MAX_FORWARDS_PER_SECOND = 200.0  # per sender: far above what one honest upstream peer sends (tens per second)
RECHECK_AGE = 0.5  # seconds: an unknown sender makes the view re-read the DHT if it is older than this
MAX_TRACKED_SENDERS = 4096
TURNED_AWAY_PER_STRIKE = 50  # refusals of one sender per reputation strike (a ban needs --ban-strikes strikes)


class RateLimit:
    """A token bucket per sender: ``rate`` requests per second, bursts of ``burst``; bounded memory
    (the least recently seen senders are forgotten first, which only ever refills their bucket)."""

    def __init__(self, rate: float, *, burst: float | None = None, clock: Callable[[], float] = SYSTEM_CLOCK,
                 max_senders: int = MAX_TRACKED_SENDERS) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self.rate, self.burst, self.clock, self.max_senders = rate, burst if burst is not None else rate, clock, max_senders
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()  # sender -> (tokens, at)

    def allow(self, sender: str) -> bool:
        """Whether ``sender`` may send one more request now (and take its token if so)."""
        now = self.clock()
        tokens, at = self._buckets.pop(sender, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[sender] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > self.max_senders:
            self._buckets.popitem(last=False)
        return allowed


class Admission:
    """The members-only gate of stage ``stage``'s forward handler (see the module docstring).

    Args:
        view: this peer's view of the swarm (its layout's records).
        stage: the stage served; its senders are the peers at ``stage - 1``.
        max_per_second: requests per second one sender may make (0: no limit).
        recheck_age: see the module docstring.
        reputation: where a sender that keeps pushing after refusals is struck (None: nowhere).
    """

    def __init__(self, view: SwarmView, stage: int, *, max_per_second: float = MAX_FORWARDS_PER_SECOND,
                 recheck_age: float = RECHECK_AGE, reputation: Reputation | None = None,
                 clock: Callable[[], float] = SYSTEM_CLOCK,
                 sleep: Callable[[float], Awaitable[None]] = SYSTEM_CLOCK.sleep) -> None:
        self.view, self.stage, self.recheck_age, self.reputation = view, stage, recheck_age, reputation
        self.clock, self.sleep = clock, sleep
        self.limit = RateLimit(max_per_second, burst=2 * max_per_second, clock=clock) if max_per_second > 0 else None
        self.refused: collections.Counter[str] = collections.Counter()  # reason code -> requests refused
        self._turned_away: collections.OrderedDict[str, int] = collections.OrderedDict()  # sender -> refusals

    def is_member(self, sender: str) -> bool:
        return self.stage > 0 and sender in self.view.peers_at(self.stage - 1)

    async def check(self, sender: str) -> str:
        """"" if ``sender`` may push a request now, else the refusal's code (counted in :attr:`refused`)."""
        if not self.is_member(sender):
            if self.stage > 0 and sender not in self._turned_away:  # once per sender: a refused one waits no more
                await self.view.read_since(self.clock(), min_interval=self.recheck_age, sleep=self.sleep)
            if not self.is_member(sender):
                return self._turn_away(sender, NOT_MEMBER)
        if self.limit is not None and not self.limit.allow(sender):
            return self._turn_away(sender, RATE_LIMITED)
        return ""

    def _turn_away(self, sender: str, code: str) -> str:
        self.refused[code] += 1
        count = self._turned_away.pop(sender, 0) + 1
        self._turned_away[sender] = count
        if len(self._turned_away) > MAX_TRACKED_SENDERS:
            self._turned_away.popitem(last=False)
        if count % TURNED_AWAY_PER_STRIKE == 0 and self.reputation is not None:
            self.reputation.strike(sender, f"kept sending forward requests after {count} refusals ({code})")
        return code
