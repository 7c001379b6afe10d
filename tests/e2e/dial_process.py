"""A DHT node that dials one other node at an agreed moment, for the simultaneous-dial test of
tests/e2e/test_internet.py. Run as ``python -m tests.e2e.dial_process ADDRESS REUSE_PORT`` inside a
host of the emulated internet: it listens on ``ADDRESS``, prints one JSON line (its peer id and
multiaddr), reads one (the other's peer id, multiaddr and the wall-clock time to dial at), dials
``DIALS`` times half a second apart (the first at that time, the others see libp2p's dial backoff
if it failed), and prints one JSON line per dial: whether it connected, and the error's text."""

from __future__ import annotations

import asyncio
import json
import sys
import time

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from dht.node import DHTNodeConfig, open_dht

DIALS = 3


async def main(address: str, reuse_port: bool) -> None:
    dht, _ = await asyncio.to_thread(open_dht, DHTNodeConfig(host_maddrs=(f"/ip4/{address}/tcp/0",), reuse_port=reuse_port))
    try:
        p2p = await dht.replicate_p2p()
        maddr = next(str(m) for m in dht.get_visible_maddrs() if address in str(m))
        print(json.dumps({"peer_id": dht.peer_id.to_base58(), "maddr": maddr.split("/p2p/")[0]}), flush=True)
        other = json.loads(await asyncio.to_thread(sys.stdin.readline))
        await asyncio.sleep(max(0.0, other["at"] - time.time()))
        for _ in range(DIALS):
            started = time.time()
            try:
                await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(other["peer_id"]), [Multiaddr(other["maddr"])]), 10)
                print(json.dumps({"connected": True, "seconds": time.time() - started}), flush=True)
            except Exception as e:  # the daemon's ControlFailure, a timeout: reported, not raised
                print(json.dumps({"connected": False, "seconds": time.time() - started, "error": repr(e)}), flush=True)
            await asyncio.sleep(0.5)
    finally:
        await asyncio.to_thread(dht.shutdown)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2] == "1"))
