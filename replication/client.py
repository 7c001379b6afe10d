"""The joiner's calls to one donor: probe, manifest, a run of pieces (``replication/server.py`` answers).

Each call is one request/response over a hivemind P2P binary stream (``dht.rpc.call_peer``) under a
deadline; every reply is checked to be what was asked for before anything uses it. What a donor
can do wrong is one of ``DONOR_FAULTS``; the caller drops that donor and re-plans its work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import P2P

from dht.clock import SYSTEM_CLOCK
from dht.reputation import Reputation
from dht.rpc import PeerUnavailableError, RemoteError, call_peer
from dht.wire import ProtocolError
from replication.config import TransferConfig
from replication.layout import StateLayout
from replication.manifest import Manifest, ManifestError, piece_size_for
from replication.server import manifest_handler, padded_bytes, probe_handler, shard_handler, unpack_bytes

__all__ = ["DONOR_FAULTS", "Session", "call_manifest", "call_pieces", "call_probe"]

DONOR_FAULTS = (PeerUnavailableError, RemoteError, ProtocolError, ManifestError)


@dataclass(frozen=True)
class Session:
    """What every call of one pull shares."""

    p2p: P2P
    run_id: str
    stage: int
    config: TransferConfig
    reputation: Reputation | None = None  # strikes donors caught lying (replication/fetcher.py)
    expected: StateLayout | None = None  # the layout the run spec implies: any other manifest is refused
    clock: Callable[[], float] = SYSTEM_CLOCK  # what the pull's plan and timings read (dht.clock)


async def call_probe(p2p: P2P, peer_id: str, *, run_id: str, nbytes: int, timeout: float,
                     clock: Callable[[], float] = SYSTEM_CLOCK) -> float:
    """Seconds for one probe of ``nbytes`` zero bytes from ``peer_id`` (stream set-up included)."""
    started = clock()
    reply, tensors = await call_peer(p2p, peer_id, probe_handler(run_id), {"nbytes": nbytes},
                                     timeout=timeout, max_payload_bytes=padded_bytes(nbytes))
    if reply.get("nbytes") != nbytes:
        raise ProtocolError(f"{peer_id[-6:]} answered a probe of {nbytes} bytes with something else")
    unpack_bytes(tensors, nbytes)
    return clock() - started


async def call_manifest(session: Session, peer_id: str, *, piece_bytes: int, version: int | None) -> Manifest:
    """The donor's manifest at the piece size ``piece_size_for`` gives its state and ``piece_bytes``
    (of ``version`` if given), checked to be what we asked for and, with ``session.expected``, to
    describe exactly that layout (capped by it while parsed: nothing is sized from a larger claim).

    Raises:
        ManifestError: the manifest is malformed, of something else, or of another layout.
    """
    header: dict[str, Any] = {"stage": session.stage, "shard_bytes": piece_bytes}
    if version is not None:
        header["version"] = version
    config, expected = session.config, session.expected
    reply, _ = await call_peer(session.p2p, peer_id, manifest_handler(session.run_id), header,
                               timeout=config.request_timeout, max_payload_bytes=0)
    limits = config.manifest_limits if expected is None else expected.limits(config.manifest_limits)
    manifest = Manifest.from_wire(reply.get("manifest"), limits=limits)
    # the donor doubles the piece size until the manifest is small; the result is deterministic
    wanted = (session.run_id, session.stage, piece_size_for(manifest.total_bytes, piece_bytes))
    if (manifest.run_id, manifest.stage, manifest.shard_bytes) != wanted or version not in (None, manifest.version):
        raise ManifestError(f"{peer_id[-6:]} sent a manifest for something else than {wanted} v{version}")
    if expected is not None:
        expected.check_manifest(manifest)
    return manifest


async def call_pieces(
    session: Session, peer_id: str, manifest: Manifest, first: int, count: int, *, timeout: float
) -> memoryview:
    """Pieces ``first`` .. ``first + count - 1`` of ``manifest`` from ``peer_id``, as one byte range
    (its length checked, its digests not yet)."""
    start, end = manifest.shard_range(first)[0], manifest.shard_range(first + count - 1)[1]
    header = {"stage": session.stage, "version": manifest.version, "shard_bytes": manifest.shard_bytes,
              "index": first, "count": count}
    reply, tensors = await call_peer(session.p2p, peer_id, shard_handler(session.run_id), header,
                                     timeout=timeout, max_payload_bytes=padded_bytes(end - start))
    if reply.get("index") != first or reply.get("nbytes") != end - start:
        raise ProtocolError(f"{peer_id[-6:]} answered pieces {first}+{count} with something else")
    return unpack_bytes(tensors, end - start)
