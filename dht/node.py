"""Creating and joining the hivemind DHT; the only place that constructs ``hivemind.DHT``.

A node gets an RSA record key (for signed records) next to its libp2p identity. Both can persist in
files so that a bootstrap node keeps its peer id, multiaddr and record ownership across restarts.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2PDaemonError
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr

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
    """

    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    identity_path: str | None = None
    client_mode: bool = False
    start_timeout: float = 30.0

    def __post_init__(self) -> None:
        for addr in (*self.initial_peers, *self.host_maddrs, *self.announce_maddrs):
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
    kwargs = {}
    if config.identity_path is not None:
        kwargs["identity_path"] = config.identity_path
    if config.announce_maddrs:
        kwargs["announce_maddrs"] = list(config.announce_maddrs)
    dht = hivemind.DHT(
        initial_peers=list(config.initial_peers) or None,
        host_maddrs=list(config.host_maddrs),
        client_mode=config.client_mode,
        record_validators=[validator, RunRecordValidator()],
        start=False,
        bootstrap_timeout=min(5.0, config.start_timeout),
        wait_timeout=min(5.0, config.start_timeout),
        **kwargs,
    )
    try:
        dht.run_in_background(await_ready=True, timeout=config.start_timeout)
    except (P2PDaemonError, TimeoutError, RuntimeError) as e:
        dht.shutdown()
        where = ", ".join(config.initial_peers) or "(no bootstrap)"
        raise BootstrapError(f"could not join the swarm through {where}: {_first_line(e)}") from e
    return dht, validator


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


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]
