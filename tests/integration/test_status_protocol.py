"""/murmuration/status/1.0.0 on real hivemind P2P: answers the status, refuses bad requests, keeps serving.

The py-libp2p side of the protocol is tested against a live peer in tests/e2e/test_status_client.py
(py-libp2p cannot be imported next to hivemind).
"""

from __future__ import annotations

import asyncio
import logging
import struct

import msgpack
import pytest
from hivemind.p2p import PeerID

from dht.rpc import PeerUnavailableError, RemoteError, call_peer
from peer.status.protocol import STATUS_PROTOCOL, StatusProtocol

pytestmark = pytest.mark.parametrize("dht_nodes", [2], indirect=True)


async def raw_exchange(p2p, peer_id: str, payload: bytes) -> bytes:
    """Send raw bytes on the status protocol, hang up our side, and read whatever comes back."""
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), STATUS_PROTOCOL)
    try:
        writer.write(payload)
        await writer.drain()
        (length,) = struct.unpack(">I", await asyncio.wait_for(reader.readexactly(4), 10))
        return await asyncio.wait_for(reader.readexactly(length), 10)
    finally:
        writer.close()


def test_status_answers_and_survives_malformed_requests(dht_nodes, caplog):
    (server_dht, _), (client_dht, _) = dht_nodes

    async def main():
        server_p2p, client_p2p = await server_dht.replicate_p2p(), await client_dht.replicate_p2p()
        server_id = server_dht.peer_id.to_base58()
        calls = []

        def status() -> dict:
            calls.append(1)
            return {"peer_id": server_id, "stage": 1, "step": len(calls)}

        async with StatusProtocol(server_p2p, status) as protocol:
            reply, _ = await call_peer(client_p2p, server_id, STATUS_PROTOCOL, {"want": "status"}, timeout=10, max_payload_bytes=0)
            assert reply["status"] == {"peer_id": server_id, "stage": 1, "step": 1}
            assert reply["protocol"] == STATUS_PROTOCOL
            with pytest.raises(RemoteError, match="unknown status request 'everything'"):
                await call_peer(client_p2p, server_id, STATUS_PROTOCOL, {"want": "everything"}, timeout=10, max_payload_bytes=0)
            not_a_map = msgpack.packb([1, 2, 3])
            answer = msgpack.unpackb(await raw_exchange(client_p2p, server_id, struct.pack(">I", len(not_a_map)) + not_a_map))
            assert answer["ok"] is False and answer["error"]
            oversized = await raw_exchange(client_p2p, server_id, struct.pack(">I", 10**9))
            assert msgpack.unpackb(oversized)["ok"] is False
            with_tensors = msgpack.packb({"want": "status", "tensors": [["float32", [1000]]]})
            answer = msgpack.unpackb(await raw_exchange(client_p2p, server_id, struct.pack(">I", len(with_tensors)) + with_tensors))
            assert answer["ok"] is False
            assert protocol.num_refused == 4
            reply, _ = await call_peer(client_p2p, server_id, STATUS_PROTOCOL, {"want": "status"}, timeout=10, max_payload_bytes=0)
            assert reply["status"]["step"] == 2 and protocol.num_served == 2  # still serving, and refusals never asked for status
        with pytest.raises((PeerUnavailableError, RemoteError)):  # unregistered on shutdown
            await call_peer(client_p2p, server_id, STATUS_PROTOCOL, {"want": "status"}, timeout=5, max_payload_bytes=0)

    with caplog.at_level(logging.WARNING, logger="dht.rpc"):
        asyncio.run(main())
    assert sum("refused a status request" in r.getMessage() for r in caplog.records) == 4
