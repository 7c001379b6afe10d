"""How a peer joins the swarm so that others can reach it, and says so in one line (docs/nat.md).

1. **Probe.** A client-mode DHT node runs as this peer's identity (``dht.node``); a few peers (the
   bootstraps, then peers whose records say "direct") dial it back from fresh libp2p nodes
   (``dht.reachability``). :func:`planner.reachability.judge` reads their answers.
2. **Relay slots.** Behind a NAT that keeps one mapping, it asks public peers for relay slots
   (``dht.relays``), two at most.
3. **The node.** The probe closes, and the peer's DHT node starts as :func:`planner.reachability.classify`
   says: "direct" as before; "relayed" reserving on its granted relays only (it waits until its
   ``/p2p-circuit`` address shows, else it falls back to unreachable); "unreachable" in client mode,
   as a client of stage 0 that averages in client mode (``--client-mode``, ``--stage 0``,
   ``--role unreliable``). The one line: "reachable at …" / "behind NAT: reachable through relay …"
   / "not reachable: will train as a client of stage 0 and average in client mode (why)".
4. **While it lives** (:meth:`ReachableNode.serve`): every peer answers dial-back checks; a direct
   one grants relay slots (``--relay-slots``); a relayed one renews its slots; a relayed or
   unreachable one keeps a connection to its pipeline neighbours that cannot dial it (the public
   ones, or all of them when nobody can dial it), since libp2p answers over a connection either side opened.

A peer listening on loopback only (a local swarm) skips all this: it is "direct", and its daemon
runs as before. Every other peer's daemon is told "private" reachability (``daemon_reachability``):
go-libp2p swaps a public node's relay service for another, dropping the reservations held on it,
whenever AutoNAT calls it public; pinned, the relay keeps its reservations and its limits, and hole
punching is on (docs/nat.md has the measurements).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import random
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import hivemind
from hivemind.dht.crypto import RSASignatureValidator

from dht.identity import PeerIdentity, open_identity
from dht.node import BootstrapError, DHTNodeConfig, open_dht, visible_maddrs
from dht.reachability import DialBackServer, call_dial_back, connect, connected_addrs, listen_ports, relay_maddrs
from dht.records import PeerRecord
from dht.registry import fetch_peers
from dht.relays import MBPS_PER_SLOT, RELAY_LEASE, RelaySlots, request_slot
from peer.config import PeerConfig
from peer.errors import UserError
from planner.reachability import DialBack, Verdict, classify, judge, relay_slots_for

logger = logging.getLogger(__name__)
NUM_CHECKERS = 3
CHECK_ATTEMPTS, CHECK_RETRY = 3, 2.0  # rounds of dial-back checks while no checker answers, seconds apart
NUM_RELAYS = 2
RELAY_WAIT = 15.0  # seconds a relayed peer waits for its reservation (it takes well under one)
DIAL_PERIOD = 2.0  # seconds between rounds of the neighbour dialer


@dataclass(frozen=True)
class Reach:
    """What a peer found out: its reachability (``planner.reachability``), why, the relays it may
    use (multiaddrs ending in ``/p2p/<relay id>``), and the dial-back verdict (None: not checked)."""

    kind: str
    why: str
    relays: tuple[str, ...] = ()
    verdict: Verdict | None = None
    own_ips: tuple[str, ...] = ()  # the addresses the probe listened on (its host's own)

    @property
    def forwarded_ip(self) -> str | None:
        """The public IP others dialled it back at, when that is not its own: a NAT that lets dials in
        (a full cone, a port forward, UPnP) stands between; None otherwise."""
        if self.kind != "direct" or self.verdict is None or not self.verdict.observed:
            return None
        ip = self.verdict.observed.rsplit(":", 1)[0]
        return None if ip in self.own_ips else ip

    @property
    def relay_ids(self) -> list[str]:
        return [maddr.rsplit("/p2p/", 1)[1] for maddr in self.relays]


def is_loopback_only(maddrs: Sequence[str]) -> bool:
    return all(m.startswith(("/ip4/127.", "/ip6/::1/")) for m in maddrs)


def should_check(config: PeerConfig) -> bool:
    return config.reachability == "auto" and not config.client_mode and not is_loopback_only(config.host_maddrs)


def bootstrap_ids(maddrs: Sequence[str]) -> list[str]:
    return [m.rsplit("/p2p/", 1)[1] for m in maddrs if "/p2p/" in m]


def spread(peer_ids: Sequence[str], salt: str) -> list[str]:
    """``peer_ids`` in an order of their own per ``salt``: askers spread over the peers they ask."""
    return sorted(peer_ids, key=lambda p: hashlib.sha256(f"{salt}:{p}".encode()).digest())


def public_peers(config: PeerConfig, records: Sequence[PeerRecord], own_id: str) -> list[str]:
    """Peers to ask: the bootstraps first, then peers whose records say others can dial them."""
    boots = [p for p in bootstrap_ids(config.bootstrap) if p != own_id]
    others = [r.peer_id for r in records if r.reachability == "direct" and r.peer_id != own_id and r.peer_id not in boots]
    return boots + spread(others, own_id)


async def probe(config: PeerConfig, node_config: DHTNodeConfig) -> Reach:
    """Steps 1-2 of the module docstring on a client-mode node of ``node_config``; closes it."""
    started = time.monotonic()
    dht, _ = await asyncio.to_thread(open_dht, dataclasses.replace(node_config, client_mode=True))
    try:
        p2p = await dht.replicate_p2p()
        own_id = dht.peer_id.to_base58()
        ports = listen_ports(visible_maddrs(dht))
        opened = time.monotonic()
        for attempt in range(CHECK_ATTEMPTS):  # nobody answered (a bootstrap still starting): ask again
            if attempt:
                await asyncio.sleep(CHECK_RETRY)
            candidates = public_peers(config, await fetch_peers(dht, config.run_id), own_id)
            answers = await ask_checkers(p2p, candidates, ports=ports)
            verdict = judge(answers, listen_ports=ports)
            if verdict.reachable is not None:
                break
        checked = time.monotonic()
        relays: list[str] = []
        if verdict.reachable is False and verdict.mapping != "changed":
            relays = await obtain_relays(p2p, config, candidates)
        kind, why = classify(verdict, num_relays=len(relays))
        if verdict.reachable is None:
            logger.warning(f"no peer could check whether others can dial this peer ({len(candidates)} asked); "
                           "taking it as reachable")
        logger.debug(f"reachability probe: node {opened - started:.2f}s, dial-backs {checked - opened:.2f}s "
                     f"{answers}, relays {time.monotonic() - checked:.2f}s {relays}: {kind} ({why})")
        own_ips = tuple(sorted({m.split("/")[2] for m in visible_maddrs(dht) if m.startswith(("/ip4/", "/ip6/"))}))
        return Reach(kind=kind, why=why, relays=tuple(relays), verdict=verdict, own_ips=own_ips)
    finally:
        await asyncio.to_thread(dht.shutdown)


async def ask_checkers(p2p: object, candidates: Sequence[str], *, ports: Sequence[int]) -> list[DialBack]:
    """Dial-back answers of :data:`NUM_CHECKERS` of ``candidates``, in order, at once; one that cannot
    check (busy, gone) is replaced by the next candidate."""
    answers: list[DialBack] = []
    pending = list(candidates)
    while pending and (need := NUM_CHECKERS - sum(a.reachable is not None for a in answers)) > 0:
        batch, pending = pending[:need], pending[need:]
        answers += await asyncio.gather(*(call_dial_back(p2p, c, ports=ports) for c in batch))
    return answers


async def obtain_relays(p2p: object, config: PeerConfig, candidates: Sequence[str]) -> list[str]:
    """Slots on up to :data:`NUM_RELAYS` of ``candidates``; their multiaddrs, as this node reached them."""
    granted: list[str] = []
    boots = {m.rsplit("/p2p/", 1)[1]: m for m in config.bootstrap if "/p2p/" in m}
    for relay in candidates:
        if len(granted) >= NUM_RELAYS:
            break
        if await request_slot(p2p, relay) is None:
            continue
        addrs = [a for a in (await connected_addrs(p2p)).get(relay, []) if "p2p-circuit" not in a]
        maddr = boots.get(relay) or (f"{addrs[0]}/p2p/{relay}" if addrs else None)
        if maddr is not None:
            granted.append(maddr)
    return granted


def node_config(config: PeerConfig, *, identity: PeerIdentity | None = None, reach: Reach | None = None) -> DHTNodeConfig:
    """The peer's DHT node: as ``--bootstrap``, ``--host-maddrs``... say, and as ``reach`` found."""
    local = is_loopback_only(config.host_maddrs)
    try:
        return DHTNodeConfig(initial_peers=config.bootstrap, host_maddrs=config.host_maddrs,
                             announce_maddrs=config.announce_maddrs, identity_path=config.identity_path,
                             client_mode=config.client_mode or (reach is not None and reach.kind == "unreachable"),
                             start_timeout=config.join_timeout, identity=identity,
                             relays=reach.relays if reach is not None and reach.kind == "relayed" else (),
                             daemon_reachability=None if local else "private", reuse_port=not dialled_at_own_address(reach))
    except ValueError as e:
        raise UserError(f"{e}; copy the bootstrap's address as run_bootstrap.py prints it.") from e


def dialled_at_own_address(reach: Reach | None) -> bool:
    """Whether others dial the node at its own address (a public host, a port forward, loopback), so
    it may dial out from fresh ports (``dht.node``: no simultaneous opens); behind a NAT, relayed
    or not, it dials from its listening port, as hole punching and a full cone's mapping need. The
    probe (``reach`` None) keeps it too: its answers tell whether the NAT keeps that port."""
    return reach is not None and reach.kind == "direct" and reach.forwarded_ip is None


def as_client(config: PeerConfig) -> PeerConfig:
    """What an unreachable peer may be: a client of stage 0 that averages in client mode."""
    if config.stage > 0:
        logger.warning(f"--stage {config.stage} is not for this peer: nobody can dial it, so it serves stage 0")
    return dataclasses.replace(config, client_mode=True, role="unreliable", stage=0)


def announced_at(config: PeerConfig, ip: str) -> PeerConfig:
    """A peer others dial at ``ip``, its NAT's address: it listens on a port fixed now (a free one
    for ``tcp/0``) and announces ``ip`` with that port, which a NAT that lets dials in forwards."""
    port = next((int(m.split("/")[4]) for m in config.host_maddrs if m.split("/")[3:4] == ["tcp"]
                 and m.split("/")[4] != "0"), 0) or free_port()
    host_maddrs = tuple(m.replace("/tcp/0", f"/tcp/{port}", 1) for m in config.host_maddrs)
    protocol = "ip6" if ":" in ip else "ip4"
    return dataclasses.replace(config, host_maddrs=host_maddrs, announce_maddrs=(f"/{protocol}/{ip}/tcp/{port}",))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def describe(reach: Reach, maddrs: Sequence[str]) -> str:
    """The one line a peer says at start about how others reach it."""
    if reach.kind == "direct":
        return f"reachable at {' '.join(m for m in maddrs if 'p2p-circuit' not in m)}"
    if reach.kind == "relayed":
        mapping = reach.verdict.mapping if reach.verdict is not None else "unknown"
        return (f"behind NAT: reachable through relay {' '.join(relay_maddrs(maddrs)[:2])} (its NAT keeps "
                f"{'one mapping: hole punching can connect peers behind NATs' if mapping == 'kept' else 'an unknown mapping'})")
    return f"not reachable: will train as a client of stage 0 and average in client mode ({reach.why})"


@dataclass
class ReachableNode:
    """The peer's DHT node and what it found out about its reachability (:func:`join_swarm`)."""

    dht: hivemind.DHT
    validator: RSASignatureValidator
    reach: Reach
    config: PeerConfig  # the peer's config, as its reachability allows (:func:`as_client`)
    maddrs: tuple[str, ...]
    services: list = field(default_factory=list)
    tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def line(self) -> str:
        return describe(self.reach, self.maddrs)

    async def serve(self, p2p: object, view: object, stage: Callable[[], int], *, metrics: object = None) -> None:
        """Step 4 of the module docstring, until :meth:`shutdown`; :func:`keep_neighbours` writes its
        events to ``metrics`` (an ``EventLog``)."""
        on_event = metrics.write if metrics is not None else (lambda event, **fields: None)
        self.services.append(DialBackServer(p2p))
        slots = relay_slots_for(self.config.max_upload_mbps, slots=self.config.relay_slots, per_slot_mbps=MBPS_PER_SLOT)
        if self.reach.kind == "direct" and slots > 0 and not is_loopback_only(self.config.host_maddrs):
            self.services.append(RelaySlots(p2p, slots=slots))
        for service in self.services:
            await service.start()
        if self.reach.kind == "relayed":
            self.tasks.append(asyncio.create_task(renew_slots(p2p, self.reach.relay_ids), name="relay-leases"))
        if self.reach.kind != "direct":
            only_direct = self.reach.kind == "relayed"  # peers behind NATs reach it through its relay
            self.tasks.append(asyncio.create_task(keep_neighbours(p2p, view, stage, only_direct=only_direct,
                                                                  on_event=on_event), name="neighbours"))

    async def shutdown(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for service in self.services:
            await service.shutdown()
        self.dht.shutdown()


async def join_swarm(config: PeerConfig) -> ReachableNode:
    """Steps 1-3 of the module docstring: the peer's running DHT node, and how others reach it.

    Raises:
        UserError: an address is not a multiaddr, or no bootstrap answered within ``--join-timeout``.
    """
    identity = PeerIdentity.generate() if config.identity_path is None else None
    reach = Reach(kind="unreachable" if config.client_mode else "direct",
                  why="--client-mode" if config.client_mode else "not checked")
    try:
        if should_check(config):
            reach = await probe(config, node_config(config, identity=identity))
            if config.identity_path is not None:
                identity = open_identity(config.identity_path)[0]  # the probe checked it is free
        if reach.kind == "unreachable":
            config = as_client(config)
        elif reach.forwarded_ip is not None and not config.announce_maddrs:
            config = announced_at(config, reach.forwarded_ip)
        dht, validator = await asyncio.to_thread(open_dht, node_config(config, identity=identity, reach=reach))
        if reach.kind == "relayed" and not await wait_for_relay(dht):
            await asyncio.to_thread(dht.shutdown)
            reach = Reach(kind="unreachable", why="no relay accepted its reservation", verdict=reach.verdict)
            config = as_client(config)
            dht, validator = await asyncio.to_thread(open_dht, node_config(config, identity=identity, reach=reach))
    except BootstrapError as e:
        raise UserError(f"Cannot reach the swarm: {e}; check that the bootstrap is running and its multiaddr is right.") from e
    maddrs = tuple(str(m) for m in await asyncio.to_thread(dht.get_visible_maddrs, True))
    node = ReachableNode(dht=dht, validator=validator, reach=reach, config=config, maddrs=maddrs[:6])
    logger.info(f"joined the DHT as {dht.peer_id.to_base58()} ({config.resolved_role}); {node.line}")
    return node


async def wait_for_relay(dht: hivemind.DHT, *, timeout: float = RELAY_WAIT) -> bool:
    """Whether a ``/p2p-circuit`` address (a reservation on a relay) shows within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if relay_maddrs([str(m) for m in await asyncio.to_thread(dht.get_visible_maddrs, True)]):
            return True
        await asyncio.sleep(0.2)
    return False


async def renew_slots(p2p: object, relays: Sequence[str], *, lease: float = RELAY_LEASE) -> None:
    """Renew this peer's relay slots every third of a lease; say once when a relay stops granting it."""
    lost: set[str] = set()
    while True:
        await asyncio.sleep(lease / 3 * random.uniform(0.8, 1.0))
        for relay in relays:
            if await request_slot(p2p, relay) is None:
                if relay not in lost:
                    logger.warning(f"relay {relay[-6:]} no longer grants this peer a slot: peers with no connection "
                                   f"to it may not reach it through that relay")
                lost.add(relay)
            elif relay in lost:
                lost.discard(relay)
                logger.info(f"relay {relay[-6:]} grants this peer a slot again")


def neighbours(records: Sequence[PeerRecord], own_id: str, stage: int) -> list[PeerRecord]:
    """The training peers of stages ``stage - 1`` to ``stage + 1``: the pipeline neighbours."""
    return sorted((r for r in records if abs(r.stage - stage) <= 1 and r.state == "training" and r.peer_id != own_id),
                  key=lambda r: r.peer_id)


def connection_kind(addrs: Sequence[str] | None) -> str | None:
    """"direct", "relayed" (only through a relay) or None (no connection), from a peer's connection addresses."""
    if not addrs:
        return None
    return "relayed" if all("/p2p-circuit" in a for a in addrs) else "direct"


async def keep_neighbours(p2p: object, view: object, stage: Callable[[], int], *, only_direct: bool,
                          on_event: Callable[..., None]) -> None:
    """Keep a connection open to each pipeline neighbour that cannot be reached otherwise (only those
    others can dial, if ``only_direct``: the rest reach this peer through its relay), and tell
    ``on_event`` of each connection it opened ("dialled") and each neighbour's connection becoming
    direct or relayed ("connection": a direct one to a peer behind another NAT is a punched hole)."""
    own_id, kinds = p2p.peer_id.to_base58(), {}
    while True:
        if stage() >= 0:
            connected = await connected_addrs(p2p)
            for record in neighbours(view.records, own_id, stage()):
                kind = connection_kind(connected.get(record.peer_id))
                if kind is None and (record.reachability == "direct" or not only_direct):
                    if await connect(p2p, record.peer_id, timeout=5.0):
                        on_event("dialled", peer_id=record.peer_id)
                        kind = connection_kind((await connected_addrs(p2p)).get(record.peer_id))
                if kind is not None and kinds.get(record.peer_id) != kind:
                    kinds[record.peer_id] = kind
                    on_event("connection", peer_id=record.peer_id, kind=kind, reachability=record.reachability)
        await asyncio.sleep(DIAL_PERIOD * random.uniform(0.8, 1.2))


async def open_public_services(p2p: object, *, relay_slots: int) -> list:
    """A public node's side (the bootstrap): dial-back checks, and ``relay_slots`` relay slots."""
    services = [DialBackServer(p2p)] + ([RelaySlots(p2p, slots=relay_slots)] if relay_slots > 0 else [])
    for service in services:
        await service.start()
    return services
