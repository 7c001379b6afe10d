"""The dial-back check: a peer asks a few others to dial it back, to learn whether it can be reached.

Petals' design (``petals/server/reachability.py``): the checker dials from a *fresh* libp2p node, a
second p2p daemon that listens nowhere and holds no connection, so a connection the asker opened
itself (libp2p reuses connections in either direction) cannot make the answer yes.

Protocol ``murmuration.dial_back`` (the frame of :mod:`dht.wire`, no tensors)::

    request:  {"ports": [tcp port, ...]}          the ports the asker listens on, at most MAX_PORTS
    reply:    {"ok": true, "reachable": bool, "observed": "ip:port"}

Bounded so that nobody can make a checker dial where it likes: the checker dials only the asker's
own peer id (the one its stream authenticated), only at the IP address that stream came from, at
most :data:`MAX_PORTS` ports; a request over a relayed connection (no address seen) is declined; one
check per asker per ``per_peer_period``, at most ``max_per_minute`` in all and ``max_concurrent`` at
once; each dial is cut at ``dial_timeout``. The reply also says which ``ip:port`` the asker's
connection came from, which tells the asker its public address and whether its NAT keeps one
mapping (``planner.reachability.judge``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any

from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.utils.multiaddr import Multiaddr

from dht.clock import SYSTEM_CLOCK
from dht.rpc import HandlerService, Declined, PeerUnavailableError, RemoteError, call_peer, serve_request
from dht.wire import ProtocolError
from planner.reachability import DialBack

logger = logging.getLogger(__name__)
DIAL_BACK_HANDLER = "murmuration.dial_back"
MAX_PORTS = 4
DIAL_TIMEOUT = 5.0  # seconds a checker waits for the dial: several round trips of a slow home link
# the checker's fresh node: no listening, no relay, no NAT service, a DHT client (Petals' STRIPPED_PROBE_ARGS)
PROBE_OPTIONS = dict(dht_mode="client", use_relay=False, auto_nat=False, nat_port_map=False, no_listen=True,
                     startup_timeout=30)


def observed_address(addr: Any) -> tuple[str, str] | None:
    """(IP protocol, IP) of a connection's remote multiaddr; None if relayed or not IP/TCP."""
    text = str(addr)
    parts = text.strip("/").split("/")
    if "p2p-circuit" in parts or len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp":
        return None
    return parts[0], parts[1]


def check_ports(ports: Any) -> list[int]:
    """The ``ports`` of a request, validated (remote input: ``ValueError`` on anything else)."""
    if not isinstance(ports, list) or not 1 <= len(ports) <= MAX_PORTS:
        raise ValueError(f"ports must be a list of 1-{MAX_PORTS} TCP ports")
    if not all(isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= 65535 for p in ports):
        raise ValueError("ports must be TCP ports (1-65535)")
    return sorted(set(ports))


async def dial_fresh(peer_id: PeerID, maddrs: Sequence[str], *, timeout: float) -> tuple[bool, str]:
    """Dial ``peer_id`` at ``maddrs`` from a new p2p daemon that holds no connection; (dialled, why not)."""
    probe = await P2P.create(**PROBE_OPTIONS)
    try:
        await asyncio.wait_for(probe._client.connect(peer_id, [Multiaddr(m) for m in maddrs]), timeout)
        return True, ""
    except asyncio.TimeoutError:
        return False, f"no answer within {timeout:g}s"
    except (ControlFailure, P2PDaemonError, OSError) as e:
        return False, str(e).splitlines()[0][:200]
    finally:
        await probe.shutdown()


class DialBackServer(HandlerService):
    """Answers ``murmuration.dial_back`` on a hivemind P2P (every peer runs one)."""

    handler_name = DIAL_BACK_HANDLER

    def __init__(self, p2p: P2P, *, dial_timeout: float = DIAL_TIMEOUT, max_per_minute: int = 12,
                 max_concurrent: int = 2, per_peer_period: float = 10.0,
                 dial: Callable[..., Any] = dial_fresh, clock: Callable[[], float] = SYSTEM_CLOCK) -> None:
        self.p2p, self.dial_timeout, self.dial, self.clock = p2p, dial_timeout, dial, clock
        self.max_per_minute, self.max_concurrent, self.per_peer_period = max_per_minute, max_concurrent, per_peer_period
        self._recent: collections.deque[float] = collections.deque()  # when each check of the last minute began
        self._last_by_peer: dict[str, float] = {}
        self._running = 0
        self.num_checks = self.num_reachable = self.num_declined = 0

    async def _serve_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.rpc_dial_back(info, reader, writer)

    async def rpc_dial_back(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def process(header: dict[str, Any], _tensors: list) -> tuple[dict[str, Any], list]:
            return await self._check(info.peer_id, info.addr, header), []

        await serve_request(reader, writer, process, max_payload_bytes=0, timeout=self.dial_timeout + 30.0,
                            what="dial_back")

    async def _check(self, peer_id: PeerID, addr: Any, header: dict[str, Any]) -> dict[str, Any]:
        ports = check_ports(header.get("ports"))
        seen = observed_address(addr)
        if seen is None:
            raise Declined("your connection reached me through a relay: I cannot see your address")
        self._admit(peer_id.to_base58())
        protocol, ip = seen
        targets = [f"/{protocol}/{ip}/tcp/{port}" for port in ports]
        self._running += 1
        try:
            reachable, why = await self.dial(peer_id, targets, timeout=self.dial_timeout)
        finally:
            self._running -= 1
        self.num_checks += 1
        self.num_reachable += reachable
        port = str(addr).strip("/").split("/")[3]
        logger.debug(f"dial-back of {peer_id.to_base58()[-6:]} at {ip} ports {ports}: "
                     f"{'reachable' if reachable else 'not reachable: ' + why}")
        return {"ok": True, "reachable": reachable, "observed": f"{ip}:{port}"}

    def _admit(self, peer_id: str) -> None:
        """Rate limits: raise Declined when this check would exceed one."""
        now = self.clock()
        while self._recent and now - self._recent[0] >= 60.0:
            self._recent.popleft()
        last = self._last_by_peer.get(peer_id)
        reason = ("busy: checking others" if self._running >= self.max_concurrent
                  else "busy: too many checks this minute" if len(self._recent) >= self.max_per_minute
                  else f"checked you {now - last:.0f}s ago" if last is not None and now - last < self.per_peer_period
                  else "")
        if reason:
            self.num_declined += 1
            raise Declined(reason)
        self._recent.append(now)
        self._last_by_peer[peer_id] = now
        if len(self._last_by_peer) > 4096:  # forget the oldest: the table stays bounded
            for old in sorted(self._last_by_peer, key=self._last_by_peer.get)[:1024]:
                del self._last_by_peer[old]


async def call_dial_back(p2p: P2P, checker: str, *, ports: Sequence[int], timeout: float = DIAL_TIMEOUT + 10.0) -> DialBack:
    """Ask ``checker`` to dial this node back; ``DialBack(reachable=None)`` if it could not check."""
    try:
        reply, _ = await call_peer(p2p, checker, DIAL_BACK_HANDLER, {"ports": list(ports)}, timeout=timeout,
                                   max_payload_bytes=0)
    except (PeerUnavailableError, RemoteError) as e:
        logger.debug(f"dial-back check by {checker[-6:]} failed: {e}")
        return DialBack(reachable=None)
    reachable, observed = reply.get("reachable"), reply.get("observed", "")
    if not isinstance(reachable, bool) or not isinstance(observed, str) or len(observed) > 64:
        logger.debug(f"dial-back check by {checker[-6:]}: a malformed reply {reply!r:.200}")
        return DialBack(reachable=None)
    return DialBack(reachable=reachable, observed=observed)


def listen_ports(maddrs: Sequence[str]) -> list[int]:
    """The TCP ports of a node's own (non-relay) multiaddrs."""
    ports = set()
    for maddr in maddrs:
        parts = str(maddr).strip("/").split("/")
        if "p2p-circuit" not in parts and len(parts) >= 4 and parts[2] == "tcp" and parts[3].isdigit():
            ports.add(int(parts[3]))
    return sorted(ports)[:MAX_PORTS]


def relay_maddrs(maddrs: Sequence[str]) -> list[str]:
    """The relayed (``/p2p-circuit``) addresses among a node's multiaddrs."""
    return [m for m in maddrs if "/p2p-circuit" in str(m)]


async def connected_addrs(p2p: P2P) -> dict[str, list[str]]:
    """peer id → the remote addresses of this node's open connections to it."""
    return {info.peer_id.to_base58(): [str(a) for a in info.addrs] for info in await p2p.list_peers()}


async def connect(p2p: P2P, peer_id: str, *, timeout: float) -> bool:
    """Open a connection to ``peer_id`` (the daemon finds its addresses), or keep the one it has;
    hivemind has no public call for that, so this is the daemon client's own ``connect``."""
    try:
        await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer_id), []), timeout)
        return True
    except (asyncio.TimeoutError, ControlFailure, P2PDaemonError, OSError, ProtocolError) as e:
        logger.debug(f"could not connect to {peer_id[-6:]}: {e!r}")
        return False
