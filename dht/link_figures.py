"""The link figures a peer publishes in its record: round-trip time and goodput to a few peers.

Each :class:`LinkFigure` says what one peer measured of its link to another (``swarm.links``): the
smoothed round-trip time in ms and, where large transfers came from that peer, the goodput in Mbit/s.
A record carries at most :data:`MAX_LINK_FIGURES` of them, each rounded and capped, so one record
cannot grow without bound; a reader (the planner, the router) treats them as one peer's word: a
claim, capped and smoothed like the others, never a fact about the other end.
On the wire: ``[[peer_id, rtt_ms, mbit_per_s or None], ...]``, left out when empty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_LINK_FIGURES = 8
MAX_RTT_MS = 60_000.0
MAX_MBIT_PER_S = 100_000.0


@dataclass(frozen=True)
class LinkFigure:
    peer_id: str
    rtt_ms: float
    mbit_per_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, str) or not 1 <= len(self.peer_id) <= 128:
            raise ValueError("a link figure's peer_id must be a string of 1-128 characters")
        if not _in_range(self.rtt_ms, MAX_RTT_MS):
            raise ValueError(f"a link figure's rtt_ms must be in [0, {MAX_RTT_MS:.0f}], got {self.rtt_ms!r}")
        if self.mbit_per_s is not None and not _in_range(self.mbit_per_s, MAX_MBIT_PER_S):
            raise ValueError(f"a link figure's mbit_per_s must be in [0, {MAX_MBIT_PER_S:.0f}] or None")

    @classmethod
    def capped(cls, peer_id: str, *, rtt_ms: float, mbit_per_s: float | None) -> LinkFigure:
        """A figure from measured values: rounded (0.1 ms, 0.01 Mbit/s) and capped to the valid range."""
        return cls(peer_id, round(min(max(rtt_ms, 0.0), MAX_RTT_MS), 1),
                   None if mbit_per_s is None else round(min(max(mbit_per_s, 0.0), MAX_MBIT_PER_S), 2))

    def to_wire(self) -> list:
        return [self.peer_id, self.rtt_ms, self.mbit_per_s]


def links_from_wire(wire: Any) -> tuple[LinkFigure, ...]:
    """Parse a record's ``links``; ValueError on anything but at most MAX_LINK_FIGURES well-formed figures."""
    if not isinstance(wire, (list, tuple)) or len(wire) > MAX_LINK_FIGURES:
        raise ValueError(f"links must be a list of at most {MAX_LINK_FIGURES} figures")
    figures = []
    for item in wire:
        if isinstance(item, LinkFigure):
            figures.append(item)
            continue
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise ValueError("a link figure must be [peer_id, rtt_ms, mbit_per_s or null]")
        figures.append(LinkFigure(*item))
    return tuple(figures)


def _in_range(value: Any, high: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0 <= value <= high)
