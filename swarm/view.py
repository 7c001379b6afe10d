"""The swarm as this peer sees it: the latest peer records, refreshed from the DHT in the background.

The records are bound to their peer ids (``dht.registry.fetch_peers``), and the figures in them that
steer other peers' decisions are read through ``planner.claims``' bounds (:func:`bound_claims`), so
every consumer of the view (stage choice, rebalancing, backups, the router, the status pages) sees
a liar's FLOP/s and samples/s capped at a multiple of its peers' median.

A view holds the peers of one stage layout (``PeerRecord.layout_version`` and ``stage_layers``):
after a layer-wise re-plan (``planner.replanning``), peers still under the old layout and peers
under the new one number their stages differently, so each sees only its own layout's peers in
:attr:`SwarmView.records` (the pipeline, averaging, backups and rescues); :attr:`SwarmView.all_records`
has every record, for the layout decision itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
from collections.abc import Awaitable, Callable

import hivemind

from dht.clock import SYSTEM_CLOCK, Clock
from dht.link_figures import LinkFigure
from dht.records import PeerRecord
from dht.registry import fetch_peers
from planner.claims import cap_to_median
from planner.link_view import LinkClaim, LinkView

RATE_STATES = ("training", "paused")  # peers whose samples/s is a measurement of their stage

logger = logging.getLogger(__name__)
SLOW_READ = 4.0  # seconds; a DHT request waits up to 5 s for a silent node (dht/node.py wait_timeout)
# seconds a record missing from reads that may have missed it is kept after a read last showed it:
# a DHT node behind a saturated link (a peer at 1 Mbit/s) makes read after read wait out its timeout
# and come back with a few records or none, though every other peer still heartbeats (CI, 2026-11-26:
# stage 0 saw no stage-1 peer for 13 s and stopped). Crashes are found sooner by the failure detector.
CARRY_OVER = 30.0
SLOW_REFRESH_FACTOR = 3  # a refresh this many periods long is worth a warning (at most one a minute)
SLOW_WARNING_PERIOD = 60.0


class SwarmView:
    """Peer records of one run, refreshed every ``refresh_period`` seconds (jittered)."""

    def __init__(
        self, dht: hivemind.DHT, run_id: str, *, refresh_period: float = 1.0,
        on_change: Callable[[str, PeerRecord], None] = lambda kind, record: None,
        carry_over: float = CARRY_OVER, clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.dht = dht
        self.clock, self.carry_over = clock, carry_over
        # whether this peer itself heard ``peer_id`` answer just now (the failure detector's pings):
        # such a peer's record is kept over complete reads that lack it, for the carry-over, since
        # its heartbeats may be failing on a DHT node behind a saturated link, not because it is gone
        self.vouch: Callable[[str], bool] = lambda peer_id: False
        self.run_id = run_id
        self.refresh_period = refresh_period
        self.on_change = on_change  # "scale_out" / "scale_in" of a training peer, seen by a refresh
        self.records: list[PeerRecord] = []  # the records of this view's layout
        self.all_records: list[PeerRecord] = []  # the records of every layout
        self.layout_version = 0
        self.stage_layers: tuple[tuple[int, int], ...] = ()  # of a re-planned layout (version > 0)
        self.updated_at = 0.0
        self.read_started_at = -math.inf  # when the read that made the view began (``read_since``)
        self._paced_at = -math.inf  # when the last read for ``read_since`` began
        # refreshes in a row that finished before SLOW_READ: a read that waited out a DHT timeout may
        # have missed records that exist (a peer on a slow or cut link), so its absences prove nothing
        self.complete_reads = 0
        self._departed: dict[str, float] = {}  # peer id -> announce time of the record that departed
        self._last_seen: dict[str, float] = {}  # peer id -> the clock reading of the last read that showed it
        self.num_carried = 0  # records kept over reads that may have missed them, all reads
        self._task: asyncio.Task | None = None
        self._pending_read: asyncio.Future | None = None  # a read that callers of ``fresh`` share
        self._by_stage: dict[int, frozenset[str]] = {}  # stage -> peer ids, of ``_indexed``
        self._indexed: list[PeerRecord] | None = None  # the ``records`` list ``_by_stage`` was built from
        self._links = LinkView((), ())
        self._links_of: list[PeerRecord] | None = None  # the ``records`` list ``_links`` was built from

    async def refresh(self) -> list[PeerRecord]:
        started = self.clock()
        try:
            fetched = await fetch_peers(self.dht, self.run_id)
        except BaseException:
            self.complete_reads = 0
            raise
        return self.apply_read(fetched, seconds=self.clock() - started)

    def apply_read(self, fetched: list[PeerRecord], *, seconds: float) -> list[PeerRecord]:
        """Take one DHT read of the run's records (``seconds``: how long it took) as the view.

        A read that waited out a DHT timeout, or found no record at all, may have missed records that
        exist: it proves no absence. Records it lacks that a read showed within the last
        :attr:`carry_over` seconds are kept (a crash is the failure detector's to find). A complete
        read's absences count, except for peers :attr:`vouch` says answered this peer just now: a
        live peer whose heartbeats time out on a silent DHT node loses its record, not its place."""
        now = self.clock()
        self.complete_reads = self.complete_reads + 1 if seconds < SLOW_READ else 0
        for record in fetched:
            self._last_seen[record.peer_id] = now
        proves_absence = bool(self.complete_reads and fetched)
        read = len(fetched)
        fetched = carried_over(self.all_records, fetched, self._last_seen, since=now - self.carry_over,
                               keep=self.vouch if proves_absence else lambda peer_id: True)
        if carried := len(fetched) - read:
            self.num_carried += carried
            logger.debug(f"a read of {seconds:.1f}s found {read} records; kept {carried} it may have missed "
                         f"or whose peers answer")
        self._last_seen = {r.peer_id: self._last_seen[r.peer_id] for r in fetched}
        before = {(r.peer_id, r.stage): r for r in self.records if r.state == "training"}
        self.all_records = bound_claims(fetched)
        self.records = [r for r in self.all_records if self.in_layout(r)]
        after = {(r.peer_id, r.stage): r for r in self.records if r.state == "training"}
        for key in after.keys() - before.keys():
            self.on_change("scale_out", after[key])
        for key in before.keys() - after.keys():
            self.on_change("scale_in", before[key])
        self.updated_at, self.read_started_at = now, now - seconds
        live = {r.peer_id for r in self.records}
        self._departed = {p: at for p, at in self._departed.items() if p in live}  # its record expired: forget
        return self.records

    def set_layout(self, version: int, stage_layers: tuple[tuple[int, int], ...]) -> None:
        """Follow layout ``version`` from now on (its block ranges; those of version 0 are the run's)."""
        self.layout_version, self.stage_layers = version, tuple(stage_layers) if version else ()
        self.records = [r for r in self.all_records if self.in_layout(r)]

    def in_layout(self, record: PeerRecord) -> bool:
        """Whether ``record``'s peer trains under this view's layout."""
        return record.layout_version == self.layout_version and (
            self.layout_version == 0 or record.stage_layers == self.stage_layers)

    def peers_at(self, stage: int) -> frozenset[str]:
        """The peers whose records place them at ``stage`` of this view's layout, in any state: a set
        rebuilt once per read, for checks on every request (``swarm.stage_server``'s members-only
        pipeline)."""
        if self._indexed is not self.records:
            by_stage: dict[int, set[str]] = {}
            for record in self.records:
                by_stage.setdefault(record.stage, set()).add(record.peer_id)
            self._by_stage = {k: frozenset(v) for k, v in by_stage.items()}
            self._indexed = self.records
        return self._by_stage.get(stage, frozenset())

    async def read_since(self, at: float, *, min_interval: float,
                         sleep: Callable[[float], Awaitable[None]] = SYSTEM_CLOCK.sleep) -> None:
        """Wait for a DHT read that started at ``at`` (this view's clock) or later: a record stored
        just before ``at`` is then in the view. Reads start at most one per ``min_interval`` seconds
        (the rest of the interval is slept first), concurrent callers share them, at most two are
        awaited, and a failed read leaves the view as it was."""
        for _ in range(2):
            if self.read_started_at >= at:
                return
            if self._pending_read is None or self._pending_read.done():
                self._pending_read = asyncio.ensure_future(self._paced_read(min_interval, sleep))
            try:
                await asyncio.shield(self._pending_read)
            except Exception as e:
                logger.debug(f"an extra read of the swarm view failed: {e!r}")

    async def _paced_read(self, min_interval: float, sleep: Callable[[float], Awaitable[None]]) -> None:
        wait = self._paced_at + min_interval - self.clock()
        if wait > 0:
            await sleep(wait)
        self._paced_at = self.clock()
        await self.refresh()

    def links(self) -> LinkView:
        """The link estimates of this view's records (``planner.link_view``), rebuilt once per read."""
        if self._links_of is not self.records:
            claims = [claim for r in self.records for claim in link_claims(r.peer_id, r.links)]
            self._links = LinkView([r.peer_id for r in self.records], claims)
            self._links_of = self.records
        return self._links

    def members(self, stage: int, *, states: tuple[str, ...] = ("training",)) -> list[PeerRecord]:
        return [r for r in self.records if r.stage == stage and r.state in states and not self._has_departed(r)]

    def mark_departed(self, peer_id: str) -> None:
        """Treat ``peer_id`` as gone now, although its record may live on until it expires. A later
        record of the same peer (it joined again: a newer announce time) brings it back."""
        current = next((r.announced_at for r in self.records if r.peer_id == peer_id), 0.0)
        self._departed[peer_id] = current

    def restore(self, peer_id: str) -> None:
        """Undo :meth:`mark_departed` (the failure detector's false alarm: the peer answers again)."""
        self._departed.pop(peer_id, None)

    def is_gone(self, peer_id: str) -> bool:
        """Marked departed (a notice or the failure detector) and not back with a newer record."""
        if peer_id not in self._departed:
            return False
        record = next((r for r in self.records if r.peer_id == peer_id), None)
        return record is None or self._has_departed(record)

    def _has_departed(self, record: PeerRecord) -> bool:
        return record.peer_id in self._departed and record.announced_at <= self._departed[record.peer_id]

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._refresh_loop(), name="swarm-view")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _refresh_loop(self) -> None:
        warned = -math.inf
        while True:
            started = self.clock()
            try:
                await asyncio.wait_for(self.refresh(), timeout=10 * self.refresh_period)
            except Exception as e:  # a DHT hiccup must not kill the loop: keep the last view
                logger.debug(f"swarm view refresh failed: {e!r}")
            elapsed = self.clock() - started
            if elapsed > SLOW_REFRESH_FACTOR * self.refresh_period and self.clock() - warned > SLOW_WARNING_PERIOD:
                warned = self.clock()  # a DHT read takes a few round trips: on a slow link, over a second
                logger.warning(f"swarm view refresh took {elapsed:.2f}s, {SLOW_REFRESH_FACTOR}x its "
                               f"{self.refresh_period}s period or more (this peer sees others late)")
            await self.clock.sleep(self.refresh_period * random.uniform(0.8, 1.2))


def carried_over(previous: list[PeerRecord], fetched: list[PeerRecord], last_seen: dict[str, float], *,
                 since: float, keep: Callable[[str], bool]) -> list[PeerRecord]:
    """``fetched`` plus each ``previous`` record whose peer it lacks, a read showed at ``since`` or
    later (``last_seen``) and ``keep`` accepts, sorted by peer id like a read."""
    found = {r.peer_id for r in fetched}
    kept = [r for r in previous if r.peer_id not in found and last_seen.get(r.peer_id, float("-inf")) >= since
            and keep(r.peer_id)]
    return sorted([*fetched, *kept], key=lambda r: r.peer_id)


def link_claims(reporter: str, figures: tuple[LinkFigure, ...]) -> list[LinkClaim]:
    """``reporter``'s published link figures as the planner's claims (seconds, bytes/s; a goodput of
    0 as none)."""
    return [LinkClaim(reporter, f.peer_id, f.rtt_ms / 1000, f.mbit_per_s * 1e6 / 8 if f.mbit_per_s else None)
            for f in figures]


def bound_claims(records: list[PeerRecord]) -> list[PeerRecord]:
    """``records`` with FLOP/s capped by the swarm's median (a device figure: every record counts) and
    samples/s by the median of the same stage's working peers (``planner.claims.cap_to_median``).
    Deterministic: peers that see the same records see the same bounded ones."""
    flops = cap_to_median([r.flops for r in records])
    rates = [r.samples_per_s for r in records]
    for stage in {r.stage for r in records if r.stage >= 0}:
        group = [i for i, r in enumerate(records) if r.stage == stage and r.state in RATE_STATES]
        for i, rate in zip(group, cap_to_median([rates[i] for i in group]), strict=True):
            rates[i] = rate
    bounded = []
    for record, capped_flops, capped_rate in zip(records, flops, rates, strict=True):
        if (capped_flops, capped_rate) != (record.flops, record.samples_per_s):
            logger.debug(f"{record.peer_id[-6:]} claims {record.flops:.3g} FLOP/s and {record.samples_per_s:.3g} "
                         f"samples/s; counted as {capped_flops:.3g} and {capped_rate:.3g} (its peers' median bounds it)")
            record = dataclasses.replace(record, flops=capped_flops, samples_per_s=capped_rate)
        bounded.append(record)
    return bounded
