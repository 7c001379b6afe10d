"""Membership notices between peers: a leaving peer tells the others directly, not only via the DHT.

Heartbeat records in the DHT expire after a TTL and views re-read them about once a second, so a
departure is seen late. A peer that leaves (Ctrl+C, SIGTERM) therefore sends a small ``leave``
notice to every peer in its view, concurrently and under a short deadline. A receiver drops the
sender from its :class:`~swarm.view.SwarmView` at once, so routers stop choosing it even before its
record expires (DESIGN §1 step 7, seed 003 §IV scale-in).

A notice is accepted only about the peer that sends it (libp2p authenticates the stream's remote
peer id), so nobody can announce someone else's departure.

The same protocol carries the failure detector's traffic (:mod:`swarm.failure_detector`): ``ping``
(answered at once) and ``failed`` — a rumour that a third peer crashed. A rumour is never taken on
trust: ``on_rumour`` hands it to the detector, which pings the named peer itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from hivemind.p2p import P2P

from dht.clock import SYSTEM_CLOCK
from dht.reputation import Reputation
from dht.rpc import Declined, PeerUnavailableError, RemoteError, call_peer, serve_request
from dht.wire import ProtocolError
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
NOTICE_TIMEOUT = 1.0
KINDS = ("leave", "ping", "failed")
MAX_PEER_ID_CHARS = 128


def membership_handler(run_id: str) -> str:
    return f"{run_id}.membership"


class MembershipNotices:
    """Serves ``rpc_notify`` and sends this peer's own leave notice."""

    def __init__(
        self, p2p: P2P, view: SwarmView, *, run_id: str, peer_id: str,
        on_notice: Callable[[dict[str, Any]], None] = lambda notice: None,
        on_rumour: Callable[[str, str], None] = lambda peer_id, sender: None,
        reputation: Reputation | None = None, clock: Callable[[], float] = SYSTEM_CLOCK,
    ) -> None:
        self.p2p, self.view, self.run_id, self.peer_id, self.clock = p2p, view, run_id, peer_id, clock
        self.on_notice, self.on_rumour, self.reputation = on_notice, on_rumour, reputation
        self.num_refused = 0

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(membership_handler(self.run_id), self.rpc_notify)

    async def shutdown(self) -> None:
        try:
            await self.p2p.remove_binary_stream_handler(membership_handler(self.run_id))
        except Exception as e:  # the daemon may already be gone
            logger.debug(f"could not remove the membership handler: {e!r}")

    async def rpc_notify(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = info.peer_id.to_base58()  # authenticated by libp2p: a notice speaks only for its sender
        banned = self.reputation is not None and self.reputation.is_banned(sender)

        def count(outcome: str) -> None:
            if outcome == "refused":
                self.num_refused += 1
                if self.reputation is not None:
                    self.reputation.strike(sender, "sent a malformed membership notice")

        async def process(header: dict[str, Any], _tensors: list) -> tuple[dict[str, Any], list]:
            kind = header.get("kind")
            if kind not in KINDS:
                raise ProtocolError(f"unknown notice kind {kind!r:.40}")
            if kind == "ping":  # answered even to a banned peer: a ban stops work, it must not look like death
                return {"ok": True}, []
            if banned:  # whose rumours and notices count for nothing until the ban ends
                raise Declined("this peer has banned the sender for a while")
            if kind == "failed":
                peer = header.get("peer")
                if not isinstance(peer, str) or not 1 <= len(peer) <= MAX_PEER_ID_CHARS:
                    raise ProtocolError("a failure rumour must name a peer id")
                if peer != self.peer_id:  # a rumour of our own death is plainly false
                    self.on_rumour(peer, sender)
                return {"ok": True}, []
            self.view.mark_departed(sender)
            logger.info(f"{sender[-6:]} announced its {header['kind']}")
            self.on_notice({"kind": header["kind"], "peer_id": sender})
            return {"ok": True}, []

        await serve_request(reader, writer, process, max_payload_bytes=0, timeout=NOTICE_TIMEOUT,
                            what="membership", on_outcome=count)

    async def announce_leave(self) -> int:
        """Tell every peer in the view that this peer leaves; returns how many acknowledged."""
        targets = [r.peer_id for r in self.view.records if r.peer_id != self.peer_id]
        started = self.clock()
        results = await asyncio.gather(*(self._notify(peer_id, "leave") for peer_id in targets))
        logger.info(f"told {sum(results)}/{len(targets)} peers that this peer leaves ({self.clock() - started:.2f}s)")
        return sum(results)

    async def gossip_failure(self, failed: str) -> int:
        """Tell every other peer in the view that ``failed`` crashed; returns how many acknowledged."""
        targets = [r.peer_id for r in self.view.records if r.peer_id not in (self.peer_id, failed)]
        results = await asyncio.gather(*(self._notify(peer_id, "failed", peer=failed) for peer_id in targets))
        return sum(results)

    async def _notify(self, peer_id: str, kind: str, **fields: Any) -> bool:
        try:
            await call_peer(self.p2p, peer_id, membership_handler(self.run_id), {"kind": kind, **fields},
                            timeout=NOTICE_TIMEOUT, max_payload_bytes=0)
            return True
        except (PeerUnavailableError, RemoteError) as e:
            logger.debug(f"could not notify {peer_id[-6:]}: {e}")
            return False
