"""The swarm as this peer sees it: the latest peer records, refreshed from the DHT in the background."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

import hivemind

from dht.records import PeerRecord
from dht.registry import fetch_peers

logger = logging.getLogger(__name__)


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
        self.records: list[PeerRecord] = []
        self.updated_at = 0.0
        self._departed: dict[str, float] = {}  # peer id -> announce time of the record that departed
        self._task: asyncio.Task | None = None

    async def refresh(self) -> list[PeerRecord]:
        before = {(r.peer_id, r.stage): r for r in self.records if r.state == "training"}
        self.records = await fetch_peers(self.dht, self.run_id)
        after = {(r.peer_id, r.stage): r for r in self.records if r.state == "training"}
        for key in after.keys() - before.keys():
            self.on_change("scale_out", after[key])
        for key in before.keys() - after.keys():
            self.on_change("scale_in", before[key])
        self.updated_at = time.monotonic()
        live = {r.peer_id for r in self.records}
        self._departed = {p: at for p, at in self._departed.items() if p in live}  # its record expired: forget
        return self.records

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
