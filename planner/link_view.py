"""The swarm's links as the planner and the router read them: from the figures peers publish (issue #18).

Every peer publishes what it measured of its links to a few peers it talks to (``dht.link_figures``:
the smoothed round-trip time and, where large transfers came from that peer, the goodput). Each
figure is one peer's word about a link it shares with another: a claim. :class:`LinkView` turns the
claims into one estimate per pair of peers, with rules that bound what a liar gains:

* **Both ends reported the link: the worse of the two** (the longer round trip, the lower goodput).
  A liar cannot make a link look better than the honest peer at its other end measured it. It can
  make its own links look worse, which only steers work away from itself (as computing slowly would).
* **One end reported it: that figure, bounded** by the swarm's figures: a round trip no shorter than
  the lower median of the reporters' own median round trips over :data:`MAX_CLAIM_RATIO`, a goodput
  no higher than :data:`MAX_CLAIM_RATIO` times the lower median of their median goodputs. Each
  reporter has one vote in those medians, however many figures it sends, so with fewer than half of
  the reporters lying the bounds lie within the honest peers' figures (``planner.claims``). The price:
  a genuinely fast link that only one end measured counts as that bound.
* **Neither end reported it: unknown**; :meth:`LinkView.matrix` fills it with the same lower
  medians (the typical link of this swarm), or :data:`DEFAULT_RTT_S` / :data:`DEFAULT_BYTES_PER_S`
  when nobody has measured anything yet.

A figure about an unknown peer, or a peer's figure about itself, is ignored; a peer listing one
link twice counts its worse figure. Pure: every peer that reads the same records, in any order,
gets the same estimates. Smoothing over time happens where the figures are measured
(``swarm.links``: RFC 6298 round trips, median goodputs); records are the latest word.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from planner.claims import MAX_CLAIM_RATIO, lower_median
from planner.snapshot import LinkMatrix

DEFAULT_RTT_S = 0.05  # a link nobody measured, in a swarm where nobody measured any
DEFAULT_BYTES_PER_S = 50e6 / 8  # 50 Mbit/s: a home link


@dataclass(frozen=True)
class LinkClaim:
    """What ``reporter`` published of its link to ``other``: round trip in seconds, goodput in bytes/s
    (None: no large transfer measured)."""

    reporter: str
    other: str
    rtt_s: float
    bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rtt_s) and self.rtt_s >= 0):
            raise ValueError(f"rtt_s must be finite and >= 0, got {self.rtt_s!r}")
        if self.bytes_per_s is not None and not (math.isfinite(self.bytes_per_s) and self.bytes_per_s > 0):
            raise ValueError(f"bytes_per_s must be finite and > 0 or None, got {self.bytes_per_s!r}")


@dataclass(frozen=True)
class LinkEstimate:
    """One pair's link: round trip (s) and goodput (bytes/s); None where no figure exists."""

    rtt_s: float | None
    bytes_per_s: float | None


class LinkView:
    """Pairwise link estimates from published claims, bounded as the module docstring says."""

    def __init__(self, peer_ids: Iterable[str], claims: Iterable[LinkClaim], *, max_ratio: float = MAX_CLAIM_RATIO) -> None:
        if max_ratio < 1:
            raise ValueError(f"max_ratio must be at least 1, got {max_ratio}")
        self.peer_ids = tuple(sorted(set(peer_ids)))
        known = set(self.peer_ids)
        worst: dict[tuple[str, str], LinkClaim] = {}  # (reporter, other) -> the reporter's worse figure
        for claim in claims:
            if claim.reporter == claim.other or claim.reporter not in known or claim.other not in known:
                continue
            key = (claim.reporter, claim.other)
            worst[key] = _worse(worst[key], claim) if key in worst else claim
        self._claims = worst
        typical_rtt = _median_of_medians(worst.values(), lambda c: c.rtt_s)
        typical_rate = _median_of_medians(worst.values(), lambda c: c.bytes_per_s)
        self.typical = LinkEstimate(typical_rtt if typical_rtt is not None else DEFAULT_RTT_S,
                                    typical_rate if typical_rate is not None else DEFAULT_BYTES_PER_S)
        # a one-sided figure implies the typical one was measured, so the defaults never bound anything
        self.rtt_floor, self.rate_cap = self.typical.rtt_s / max_ratio, self.typical.bytes_per_s * max_ratio

    def estimate(self, a: str, b: str) -> LinkEstimate:
        """The link between ``a`` and ``b`` (symmetric)."""
        ab, ba = self._claims.get((a, b)), self._claims.get((b, a))
        if ab is not None and ba is not None:
            both = _worse(ab, ba)
            return LinkEstimate(both.rtt_s, both.bytes_per_s)
        one = ab or ba
        if one is None:
            return LinkEstimate(None, None)
        return LinkEstimate(max(one.rtt_s, self.rtt_floor),
                            None if one.bytes_per_s is None else min(one.bytes_per_s, self.rate_cap))

    def known_or_typical(self, a: str, b: str) -> tuple[float, float]:
        """(round trip, goodput) between ``a`` and ``b``, the typical link's figure for each one unknown."""
        link = self.estimate(a, b)
        return (link.rtt_s if link.rtt_s is not None else self.typical.rtt_s,
                link.bytes_per_s if link.bytes_per_s is not None else self.typical.bytes_per_s)

    def transfer_seconds(self, a: str, b: str, num_bytes: float) -> float:
        """Round trip plus ``num_bytes`` of serialisation between ``a`` and ``b`` (:meth:`known_or_typical`)."""
        rtt, rate = self.known_or_typical(a, b)
        return rtt + num_bytes / rate

    def matrix(self, peer_ids: Sequence[str]) -> LinkMatrix:
        """The planner's matrices (``planner.snapshot``) over ``peer_ids`` in that order: one-way
        latency (half the round trip) and goodput, unknown pairs at the typical link's figures."""
        size = len(peer_ids)
        latency = np.zeros((size, size))
        bandwidth = np.full((size, size), np.inf)
        for i, a in enumerate(peer_ids):
            for j in range(i + 1, size):
                rtt, rate = self.known_or_typical(a, peer_ids[j])
                latency[i, j] = latency[j, i] = rtt / 2
                bandwidth[i, j] = bandwidth[j, i] = rate
        return LinkMatrix(latency_delay=latency, bandwidth=bandwidth)


def _worse(a: LinkClaim, b: LinkClaim) -> LinkClaim:
    rates = [c.bytes_per_s for c in (a, b) if c.bytes_per_s is not None]
    return LinkClaim(a.reporter, a.other, max(a.rtt_s, b.rtt_s), min(rates) if rates else None)


def _median_of_medians(claims: Iterable[LinkClaim], figure) -> float | None:
    """The lower median over reporters of each reporter's median ``figure`` (one vote per reporter)."""
    by_reporter: dict[str, list[float]] = {}
    for claim in claims:
        value = figure(claim)
        if value is not None:
            by_reporter.setdefault(claim.reporter, []).append(value)
    if not by_reporter:
        return None
    return lower_median([statistics.median(values) for _, values in sorted(by_reporter.items())])
