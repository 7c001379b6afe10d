"""Relay slots: a public peer relays for a bounded number of peers behind NATs (docs/nat.md).

Every hivemind daemon runs libp2p's circuit relay v2 service. Which peers reserve a slot on which
relay is decided here: a peer behind a NAT asks public peers for a slot before it starts its node
with those relays as its only ones (``dht.node.DHTNodeConfig.relays``), and renews the slot while
it lives. A relay grants at most ``slots`` at once; a slot not renewed within ``lease`` seconds is
free again. The bound is kept by honest peers: the daemon itself accepts up to 128 reservations
from anyone, and what one relayed connection may carry is capped by the daemon's relay (128 KiB
each way and 2 minutes per connection: it carries the DHT's small requests and the hole punch's
coordination, never the training's bytes).

Protocol ``murmuration.relay_slot`` (the frame of :mod:`dht.wire`, no tensors)::

    request:  {"want": "slot"}       a slot for the caller's own peer id, or the renewal of the one it holds
    reply:    {"ok": true, "lease": seconds}   or {"ok": false, "error": ..., "code": "full"}
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from hivemind.p2p import P2P

from dht.clock import SYSTEM_CLOCK
from dht.rpc import HandlerService, Declined, PeerUnavailableError, RemoteError, call_peer, serve_request
from dht.wire import ProtocolError

logger = logging.getLogger(__name__)
RELAY_SLOT_HANDLER = "murmuration.relay_slot"
RELAY_LEASE = 60.0  # seconds a slot is held without a renewal
SLOT_TIMEOUT = 10.0
# What one relayed peer may cost its relay's upload at most: the daemon's relay allows 16 connections
# per peer, each carrying 128 KiB each way per 2 minutes; relayed both ways, that is 16 × 256 KiB / 120 s.
MBPS_PER_SLOT = 16 * 256 * 1024 * 8 / 120 / 1e6  # ≈ 0.28 Mbit/s


class SlotsFull(Declined):
    code = "full"


class RelaySlots(HandlerService):
    """Grants relay slots on a hivemind P2P, at most ``slots`` live leases at once."""

    handler_name = RELAY_SLOT_HANDLER

    def __init__(self, p2p: P2P, *, slots: int, lease: float = RELAY_LEASE,
                 clock: Callable[[], float] = SYSTEM_CLOCK) -> None:
        if slots < 0 or lease <= 0:
            raise ValueError("slots must be >= 0 and lease positive seconds")
        self.p2p, self.slots, self.lease, self.clock = p2p, slots, lease, clock
        self.leases: dict[str, float] = {}  # peer id -> when its lease ends (clock)
        self.num_refused = 0

    def holders(self) -> list[str]:
        """The peers holding a live slot now, sorted."""
        now = self.clock()
        for peer_id in [p for p, end in self.leases.items() if end <= now]:
            del self.leases[peer_id]
        return sorted(self.leases)

    def grant(self, peer_id: str) -> float:
        """Grant or renew ``peer_id``'s slot; its lease in seconds. ``SlotsFull`` if none is free."""
        holders = self.holders()
        if peer_id not in holders and len(holders) >= self.slots:
            self.num_refused += 1
            raise SlotsFull(f"all {self.slots} relay slots are taken")
        if peer_id not in holders:
            logger.info(f"relaying for {peer_id[-6:]} ({len(holders) + 1} of {self.slots} relay slots)")
        self.leases[peer_id] = self.clock() + self.lease
        return self.lease

    async def _serve_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.rpc_relay_slot(info, reader, writer)

    async def rpc_relay_slot(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def process(header: dict[str, Any], _tensors: list) -> tuple[dict[str, Any], list]:
            if header.get("want") != "slot":
                raise ProtocolError(f"unknown relay request {header.get('want')!r:.40}; expected want='slot'")
            return {"ok": True, "lease": self.grant(info.peer_id.to_base58())}, []

        await serve_request(reader, writer, process, max_payload_bytes=0, timeout=SLOT_TIMEOUT, what="relay_slot")


async def request_slot(p2p: P2P, relay: str, *, timeout: float = SLOT_TIMEOUT) -> float | None:
    """Ask ``relay`` for a slot (or renew it); the lease in seconds, or None if refused or unreachable."""
    try:
        reply, _ = await call_peer(p2p, relay, RELAY_SLOT_HANDLER, {"want": "slot"}, timeout=timeout,
                                   max_payload_bytes=0)
    except (PeerUnavailableError, RemoteError) as e:
        logger.debug(f"no relay slot on {relay[-6:]}: {e}")
        return None
    lease = reply.get("lease")
    if not isinstance(lease, (int, float)) or isinstance(lease, bool) or not 0 < lease <= 3600:
        logger.debug(f"relay {relay[-6:]} answered a malformed lease {lease!r:.40}")
        return None
    return float(lease)
