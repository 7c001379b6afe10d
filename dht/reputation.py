"""Bans: a peer that keeps failing or sending garbage is shunned for a while.

Every handler and every caller of ours reports misbehaviour of a remote peer as a *strike*: a
request refused as malformed or hostile, a call that failed, a reply that did not check out. A peer
with ``max_strikes`` strikes within ``window`` seconds is banned for ``ban_seconds``: the streams it
opens to us are closed unanswered and nobody here routes to it. Strikes are local (each peer judges only what it saw
itself), so a liar cannot get an honest peer banned by others; a ban expires, so a peer whose
network hiccuped comes back. The default thresholds let a peer that merely crashed and restarted,
or that sent a few bad requests during an upgrade, through.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from dht.clock import SYSTEM_CLOCK

logger = logging.getLogger(__name__)
MAX_TRACKED_PEERS = 4096  # strike records beyond this are pruned to the window


class Reputation:
    """Strikes per remote peer id, and the bans they earn."""

    def __init__(
        self, *, max_strikes: int = 8, window: float = 30.0, ban_seconds: float = 120.0,
        clock: Callable[[], float] = SYSTEM_CLOCK,
        on_ban: Callable[[str, str], None] = lambda peer_id, reason: None,
    ) -> None:
        if max_strikes < 1 or window <= 0 or ban_seconds <= 0:
            raise ValueError("need max_strikes >= 1, window > 0 and ban_seconds > 0")
        self.max_strikes, self.window, self.ban_seconds, self.clock = max_strikes, window, ban_seconds, clock
        self.on_ban = on_ban
        self._strikes: dict[str, collections.deque[float]] = {}
        self._banned_until: dict[str, float] = {}
        self.num_bans = 0
        self.num_strikes = 0

    def strike(self, peer_id: str, reason: str, *, weight: int = 1) -> bool:
        """Count one misbehaviour of ``peer_id``; returns True if it is banned now.

        ``weight`` > 1 counts it as that many strikes at once: for proof of lying (a state piece that
        does not match its digest), as opposed to a failure an honest peer can have (a timeout).
        """
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
            raise ValueError(f"a strike weighs a positive integer, got {weight!r}")
        now = self.clock()
        if self.is_banned(peer_id):
            return True
        self.num_strikes += weight
        if len(self._strikes) > MAX_TRACKED_PEERS:
            self.forget_stale()
        strikes = self._strikes.setdefault(peer_id, collections.deque())
        strikes.extend([now] * weight)
        while strikes and strikes[0] < now - self.window:
            strikes.popleft()
        if len(strikes) < self.max_strikes:
            return False
        del self._strikes[peer_id]
        self._banned_until[peer_id] = now + self.ban_seconds
        self.num_bans += 1
        logger.warning(f"banned {peer_id[-6:]} for {self.ban_seconds:.0f}s: {len(strikes)} strikes in "
                       f"{self.window:.0f}s, the last: {reason[:200]}")
        self.on_ban(peer_id, reason)
        return True

    def is_banned(self, peer_id: str) -> bool:
        until = self._banned_until.get(peer_id)
        if until is None:
            return False
        if until <= self.clock():
            del self._banned_until[peer_id]
            return False
        return True

    def num_strikes_of(self, peer_id: str) -> int:
        """Strikes ``peer_id`` has within the window now (0 once banned: a ban clears them)."""
        strikes = self._strikes.get(peer_id)
        if not strikes:
            return 0
        return sum(1 for at in strikes if at >= self.clock() - self.window)

    def banned(self) -> list[str]:
        return [peer_id for peer_id in list(self._banned_until) if self.is_banned(peer_id)]

    def forget_stale(self) -> None:
        """Drop strike records older than the window (bounded memory under many callers)."""
        horizon = self.clock() - self.window
        for peer_id in [p for p, s in self._strikes.items() if not s or s[-1] < horizon]:
            del self._strikes[peer_id]
