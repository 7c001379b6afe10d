"""The peer's side of ``/murmuration/status/1.0.0``: answer any libp2p peer with this peer's status.

The protocol is registered on hivemind's P2P under its exact protocol id (hivemind hands the name
to the go daemon unchanged), so any standard libp2p implementation can open it:
``python -m peer.status`` does so from py-libp2p, with no daemon at all.

Wire format (the frame of :mod:`dht.wire` with no tensors)::

    request:  [uint32 big-endian length][msgpack map {"want": "status", "tensors": []}]
    reply:    [uint32 big-endian length][msgpack map {"ok": true, "protocol": ..., "status": {...}}]

The request is bounded by the header limit of :mod:`dht.wire` (64 KiB) and must carry no tensors; a
malformed, oversized or unknown request is refused with ``{"ok": false, "error": ...}`` and logged,
and the peer goes on serving. The caller hangs up after reading the reply.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from hivemind.p2p import P2P

from dht.rpc import HandlerService, serve_request
from dht.wire import ProtocolError

logger = logging.getLogger(__name__)
STATUS_PROTOCOL = "/murmuration/status/1.0.0"
STATUS_TIMEOUT = 5.0


class StatusProtocol(HandlerService):
    """Serves ``rpc_status`` on a hivemind P2P with the dict that ``status_fn`` returns."""

    handler_name = STATUS_PROTOCOL

    def __init__(self, p2p: P2P, status_fn: Callable[[], dict[str, Any]]) -> None:
        self.p2p, self.status_fn = p2p, status_fn
        self.num_served = self.num_refused = 0

    async def _serve_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.rpc_status(info, reader, writer)

    def _count(self, outcome: str) -> None:
        self.num_served += outcome == "ok"
        self.num_refused += outcome == "refused"

    async def rpc_status(self, _info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def process(header: dict[str, Any], _tensors: list) -> tuple[dict[str, Any], list]:
            if header.get("want") != "status":
                raise ProtocolError(f"unknown status request {header.get('want')!r:.40}; expected want='status'")
            return {"ok": True, "protocol": STATUS_PROTOCOL, "status": self.status_fn()}, []

        await serve_request(reader, writer, process, max_payload_bytes=0, timeout=STATUS_TIMEOUT,
                            what="status", on_outcome=self._count)
