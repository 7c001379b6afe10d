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
import random
import time
from collections.abc import Callable

import hivemind

from dht.records import PeerRecord
from dht.registry import fetch_peers
from planner.claims import cap_to_median

RATE_STATES = ("training", "paused")  # peers whose samples/s is a measurement of their stage

logger = logging.getLogger(__name__)
SLOW_READ = 4.0  # seconds; a DHT request waits up to 5 s for a silent node (dht/node.py wait_timeout)


class SwarmView:
    """Peer records of one run, refreshed every ``refresh_period`` seconds (jittered)."""

    def __init__(
        self, dht: hivemind.DHT, run_id: str, *, refresh_period: float = 1.0,
        on_change: Callable[[str, PeerRecord], None] = lambda kind, record: None,
    ) -> None:
        self.dht = dht
        self.run_id = run_id
        self.refresh_period = refresh_period
        self.on_change = on_change  # "scale_out" / "scale_in" of a training peer, seen by a refresh
        self.records: list[PeerRecord] = []  # the records of this view's layout
        self.all_records: list[PeerRecord] = []  # the records of every layout
        self.layout_version = 0
        self.stage_layers: tuple[tuple[int, int], ...] = ()  # of a re-planned layout (version > 0)
        self.updated_at = 0.0
        # refreshes in a row that finished before SLOW_READ: a read that waited out a DHT timeout may
        # have missed records that exist (a peer on a slow or cut link), so its absences prove nothing
        self.complete_reads = 0
        self._departed: dict[str, float] = {}  # peer id -> announce time of the record that departed
        self._task: asyncio.Task | None = None

    async def refresh(self) -> list[PeerRecord]:
        before = {(r.peer_id, r.stage): r for r in self.records if r.state == "training"}
        started = time.monotonic()
        try:
            self.all_records = bound_claims(await fetch_peers(self.dht, self.run_id))
            self.records = [r for r in self.all_records if self.in_layout(r)]
        except BaseException:
            self.complete_reads = 0
            raise
        self.complete_reads = self.complete_reads + 1 if time.monotonic() - started < SLOW_READ else 0
        after = {(r.peer_id, r.stage): r for r in self.records if r.state == "training"}
        for key in after.keys() - before.keys():
            self.on_change("scale_out", after[key])
        for key in before.keys() - after.keys():
            self.on_change("scale_in", before[key])
        self.updated_at = time.monotonic()
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
        while True:
            started = time.monotonic()
            try:
                await asyncio.wait_for(self.refresh(), timeout=10 * self.refresh_period)
            except Exception as e:  # a DHT hiccup must not kill the loop: keep the last view
                logger.debug(f"swarm view refresh failed: {e!r}")
            elapsed = time.monotonic() - started
            if elapsed > self.refresh_period:
                logger.warning(f"swarm view refresh took {elapsed:.2f}s, longer than its {self.refresh_period}s period")
            await asyncio.sleep(self.refresh_period * random.uniform(0.8, 1.2))


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
