"""How a serving peer reacts to the swarm's membership events (seed 003 §IV primitives).

The failure detector, the membership notices and the swarm view each report what they learn; a
:class:`MembershipEvents` turns each report into the local handling (the router stops or resumes
sending to a peer) and an event in the log, and gossips a failure this peer found out itself. It
belongs to one :class:`~peer.session.StageSession`, which sets ``router``, ``detector`` and
``notices`` as it opens them.
"""

from __future__ import annotations

import asyncio
import logging
import time

from dht.records import PeerRecord
from peer.event_log import EventLog
from swarm.failure_detector import FailureDetector
from swarm.membership import MembershipNotices
from swarm.router import Router
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
RUMOUR_CHECK_TIMEOUT = 0.5  # seconds a peer waits for a ping answer before it believes a crash rumour


class MembershipEvents:
    """The handlers a stage session gives its detector, notices and view.

    Args:
        view: the peer's swarm view.
        metrics: the peer's event log.
    """

    def __init__(self, view: SwarmView, metrics: EventLog) -> None:
        self.view, self.metrics = view, metrics
        self.router: Router | None = None  # to the next stage (none on the last)
        self.detector: FailureDetector | None = None
        self.notices: MembershipNotices | None = None
        self._background_tasks: set[asyncio.Task] = set()

    def on_notice(self, notice: dict) -> None:
        self.metrics.write("notice", **notice)
        if notice.get("kind") == "leave":
            self.peer_down(notice["peer_id"], "notice")

    def peer_down(self, peer_id: str, how: str) -> None:
        """``peer_id`` is gone (scale-in, seed 003 §IV): send it nothing new (see swarm/router.py) and,
        if this peer's own detector found out, tell the others."""
        started = time.perf_counter()  # the detector or the notice already marked it departed in the view
        if self.router is not None:
            self.router.peer_down(peer_id)
        handle_ms = (time.perf_counter() - started) * 1e3  # the local handling, no network I/O
        self.metrics.write("peer_down", peer_id=peer_id, how=how, handle_ms=handle_ms)
        self.metrics.write("primitive", kind="scale_in", peer_id=peer_id, how=how, handle_ms=handle_ms)
        if how == "detector" and self.notices is not None:
            self._background(self.notices.gossip_failure(peer_id), "gossip")

    def on_view_change(self, kind: str, record: PeerRecord) -> None:
        """Seed 003 §IV scale-out / scale-in as a view refresh sees them (a peer starts or stops
        training at a stage). The router and the detector read the view, so handling is bookkeeping:
        a peer back at work is no longer avoided."""
        started = time.perf_counter()
        if kind == "scale_out" and self.router is not None and record.stage == self.router.next_stage:
            self.router.link_up(record.peer_id)
        self.metrics.write("primitive", kind=kind, peer_id=record.peer_id, stage=record.stage, how="view",
                           handle_ms=(time.perf_counter() - started) * 1e3)

    def on_link(self, kind: str, peer_id: str) -> None:
        """Seed 003 §IV disconnect-link / connect-link: a neighbour missed a ping (route around it for
        now, without declaring it down) or answers again (route to it again)."""
        started = time.perf_counter()
        if self.router is not None:
            if kind == "disconnect_link":
                self.router.link_down(peer_id)
            else:
                self.router.link_up(peer_id)
        self.metrics.write("primitive", kind=kind, peer_id=peer_id, handle_ms=(time.perf_counter() - started) * 1e3)

    def on_rumour(self, peer_id: str, sender: str) -> None:
        """Another peer says ``peer_id`` crashed: believe it only if it does not answer us either."""
        detector = self.detector
        if detector is None or peer_id in detector.down or not any(r.peer_id == peer_id for r in self.view.records):
            return

        async def verify() -> None:
            if not await detector.check(peer_id, timeout=RUMOUR_CHECK_TIMEOUT):
                detector.declare_down(peer_id, "gossip")
            else:
                logger.info(f"{sender[-6:]} said {peer_id[-6:]} failed, but it answers us")
        self._background(verify(), "verify-rumour")

    def _background(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background_tasks.add(task)
        task.add_done_callback(self._background_tasks.discard)
