"""Creating and joining the hivemind DHT; the only place that constructs ``hivemind.DHT``.

A node gets an RSA record key (for signed records) next to its libp2p identity. Both can persist in
files so that a bootstrap node keeps its peer id, multiaddr and record ownership across restarts.
The identity key is created here, not by the p2p daemon, so that this process can bind its records
to its peer id (:mod:`dht.identity`); the daemon is started from it.

Behind a NAT (docs/nat.md) a node reserves a slot on the relays it was granted (``relays``): the
daemon's auto-relay with exactly those as static relays. hivemind 1.1.12's ``P2P.create`` has no
argument for the daemon's ``-relayDiscovery`` flag, and with discovery on, go-libp2p's auto-relay
waits for 4 relay candidates or 3 minutes before it reserves (measured: 195 s in a swarm of two
public peers); so the DHT's own process adds ``-relayDiscovery=0`` to its daemon's command line
(:class:`_NodeDHT`), which makes the reservation take well under a second.

A node that others dial at its own address (``reuse_port=False``) dials out from a fresh port, not
its listening one (go-libp2p's ``SO_REUSEPORT``, on by default, which hole punching behind a NAT
needs). With it, two peers that dial each other within one round trip (two new neighbours pinging
each other at once) meet in one TCP connection by simultaneous open, where both sides start the
security handshake as its initiator: both dials fail ("noise: message is too short", 4 of 4 tries
on an emulated 160 ms round trip) and libp2p then refuses every dial to that address for 5 s ("dial
backoff"), so each declared the other down (CI 2026-11-28). From fresh ports the two dials are two
connections and both succeed (4 of 4).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, P2PDaemonError
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr

from dht.identity import PeerIdentity, open_identity, register_identity
from dht.registry import RunRecordValidator

logger = logging.getLogger(__name__)


class BootstrapError(RuntimeError):
    """The node could not join the swarm through any of the given bootstrap addresses."""


@dataclass(frozen=True, kw_only=True)
class DHTNodeConfig:
    """How a node listens and whom it joins through.

    Attributes:
        initial_peers: bootstrap multiaddrs (``/ip4/.../tcp/.../p2p/<id>``); empty starts a new swarm.
        host_maddrs: addresses to listen on; ``/ip4/0.0.0.0/tcp/0`` picks a free port on all interfaces.
        announce_maddrs: addresses to tell others, when they differ from the listening ones (NAT).
        identity_path: file holding the libp2p key (created if missing) so the peer id survives restarts.
            The RSA key for signed records is kept next to it as ``<identity_path>.rsa``.
        client_mode: if True the node does not accept incoming connections (behind NAT, no relay).
        start_timeout: seconds to wait for the node to start and reach a bootstrap peer.
        relays: multiaddrs (``.../p2p/<id>``) of the relays to reserve a slot on (behind a NAT); empty: none.
        daemon_reachability: what the daemon's AutoNAT is told: "private" pins the relay service the
            daemon starts with and turns hole punching on (docs/nat.md says why every peer of ours
            says "private"); None leaves it to AutoNAT.
        identity: run as this identity instead of ``identity_path``'s or a fresh one (the same
            peer id for a reachability probe and the node after it); hivemind's "is this identity
            taken" check is then skipped.
        reuse_port: dial out from the listening port (go-libp2p's default; hole punching needs it);
            False for a node others dial at its own address (the module docstring says why).
    """

    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    identity_path: str | None = None
    client_mode: bool = False
    start_timeout: float = 30.0
    relays: tuple[str, ...] = ()
    daemon_reachability: str | None = None
    identity: PeerIdentity | None = None
    reuse_port: bool = True

    def __post_init__(self) -> None:
        if self.daemon_reachability not in (None, "public", "private"):
            raise ValueError(f"daemon_reachability must be None, public or private, not {self.daemon_reachability!r}")
        for addr in (*self.initial_peers, *self.host_maddrs, *self.announce_maddrs, *self.relays):
            try:
                Multiaddr(addr)
            except Exception as e:  # multiaddr raises several unrelated types
                raise ValueError(f"{addr!r} is not a multiaddr ({e})") from None
        if self.start_timeout <= 0:
            raise ValueError("start_timeout must be positive seconds")


def open_dht(config: DHTNodeConfig) -> tuple[hivemind.DHT, RSASignatureValidator]:
    """Start a DHT node and join the swarm.

    Returns:
        the running DHT and the validator holding this node's record key.

    Raises:
        BootstrapError: no bootstrap peer answered within ``config.start_timeout``.
    """
    private_key = _load_record_key(config.identity_path)
    validator = RSASignatureValidator(private_key)
    identity, is_new = (config.identity, True) if config.identity is not None else open_identity(config.identity_path)
    kwargs = _p2p_options(config)
    if is_new or not identity.is_rsa:
        kwargs["check_if_identity_free"] = False  # nobody has it yet; hivemind's check reads RSA keys only
    temporary_dir = None
    identity_path = config.identity_path if config.identity is None else None
    if identity_path is None:  # a throw-away identity (or one given): the daemon reads it from a private file at start
        temporary_dir = tempfile.mkdtemp(prefix="murmuration-id-")
        identity_path = os.path.join(temporary_dir, "identity")
        fd = os.open(identity_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.to_bytes())
    dht = _NodeDHT(
        initial_peers=list(config.initial_peers) or None,
        host_maddrs=list(config.host_maddrs),
        client_mode=config.client_mode,
        record_validators=[validator, RunRecordValidator()],
        start=False,
        bootstrap_timeout=min(5.0, config.start_timeout),
        wait_timeout=min(5.0, config.start_timeout),
        identity_path=identity_path,
        # the daemon's own start may take the whole join time: it took over hivemind's 15 s for a peer
        # starting beside two training swarms on 2 cores (CI 2026-11-28)
        startup_timeout=config.start_timeout,
        **kwargs,
    )
    dht.static_relays, dht.reuse_port = bool(config.relays), config.reuse_port
    try:
        dht.run_in_background(await_ready=True, timeout=config.start_timeout)
    except (P2PDaemonError, TimeoutError, RuntimeError) as e:
        dht.shutdown()
        where = ", ".join(config.initial_peers) or "(no bootstrap)"
        raise BootstrapError(f"could not join the swarm through {where}: {first_line(e)}") from e
    finally:
        if temporary_dir is not None:
            shutil.rmtree(temporary_dir, ignore_errors=True)
    _check_peer_id(dht, identity)
    register_identity(dht, identity)
    return dht, validator


def _p2p_options(config: DHTNodeConfig) -> dict:
    """hivemind.DHT's options for the daemon, beyond what every node passes."""
    kwargs: dict = {}
    if config.announce_maddrs:
        kwargs["announce_maddrs"] = list(config.announce_maddrs)
    if config.relays:
        kwargs.update(use_auto_relay=True, trusted_relays=list(config.relays))
    if config.daemon_reachability is not None:
        kwargs["force_reachability"] = config.daemon_reachability
    return kwargs


class _NodeDHT(hivemind.DHT):
    """A ``hivemind.DHT`` whose daemon reserves on its trusted relays only (``-relayDiscovery=0``,
    with ``static_relays``) and dials from fresh ports unless ``reuse_port`` (the module docstring).

    Both are set in the DHT's own process (``run`` is called there, after the fork): the flag on the
    command line of the daemon started with ``trustedRelays``, go-libp2p's ``LIBP2P_TCP_REUSEPORT``
    in the environment the daemon inherits. The parent process is left as it was.
    """

    static_relays = False
    reuse_port = True

    def run(self) -> None:
        if self.static_relays:
            make_args = P2P._make_process_args

            def with_static_relays(*args: object, **kwargs: object) -> list[str]:
                if "trustedRelays" in kwargs:  # the node's daemon (not hivemind's identity-check daemon)
                    kwargs["relayDiscovery"] = False
                return make_args(*args, **kwargs)

            P2P._make_process_args = staticmethod(with_static_relays)
        if not self.reuse_port:
            os.environ["LIBP2P_TCP_REUSEPORT"] = "false"
        super().run()


def _check_peer_id(dht: hivemind.DHT, identity: PeerIdentity) -> None:
    if dht.peer_id.to_base58() != identity.peer_id:  # our peer id derivation and the daemon's disagree: a bug
        dht.shutdown()
        raise RuntimeError(f"the p2p daemon runs as {dht.peer_id}, not as the identity given ({identity.peer_id})")


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """Multiaddrs (with ``/p2p/<peer id>``) that other peers can use to reach this node."""
    return [str(addr) for addr in dht.get_visible_maddrs()]


def _load_record_key(identity_path: str | None) -> RSAPrivateKey:
    if identity_path is None:
        return RSAPrivateKey()
    path = identity_path + ".rsa"
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    if os.path.exists(path):
        with open(path, "rb") as f:
            key.__setstate__({"_private_key": f.read()})
        return key
    fresh = RSAPrivateKey()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(fresh.to_bytes())
    return fresh


def first_line(error: BaseException) -> str:
    """An error's first line (at most 300 characters), or its type's name when it says nothing."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]
