"""What a stage session is given: the peer's long-lived context, and what it may ask of the peer.

:class:`PeerContext` outlives every :class:`~peer.session.StageSession` of a peer (its DHT node, its
view, its event log, its link figures...); :class:`SessionHost` is the peer's side of the contract
(``peer.lifecycle.Peer`` implements it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from dht.clock import SYSTEM_CLOCK, Clock
from dht.records import RunSpec
from dht.reputation import Reputation
from peer.backup import BackupKeeper
from peer.config import PeerConfig
from peer.event_log import EventLog
from swarm.data import Tokens
from swarm.links import LinkMeter


@dataclass
class PeerContext:
    """What a peer holds from joining to leaving, and each of its stage sessions uses.

    Attributes:
        config: the peer's config; role: "reliable" or "unreliable".
        peer_id: its libp2p id; dht, p2p: its DHT node and libp2p handle.
        view: its view of the swarm's records.
        base_spec: the run spec as the run published it (before any layer-wise re-plan).
        keeper: the backup of another stage it may keep, across sessions.
        metrics: its event log.
        reputation: strikes and bans of misbehaving peers, or None (``--ban-strikes 0``).
        faults: test-only misbehaviour (``peer.faults``).
        tokens: the training data as the run tokenizer's ids (stage 0 samples from them).
        clock: the peer's one clock (``dht.clock``): monotonic readings (``clock()``), the DHT's
            time and sleeps, for everything its sessions time.
        links: what it measured of its links to the peers it talks to (``swarm.links``), across
            sessions: pings, pipeline traffic and state pulls feed it, its record publishes it.
    """

    config: PeerConfig
    role: str
    peer_id: str
    dht: object
    p2p: object
    view: object
    base_spec: RunSpec
    keeper: BackupKeeper
    metrics: EventLog
    reputation: Reputation | None
    faults: dict[str, str]
    tokens: Tokens
    clock: Clock = SYSTEM_CLOCK
    links: LinkMeter = field(default_factory=LinkMeter)


class SessionHost(Protocol):
    """What a stage session asks of the peer that runs it."""

    def is_working(self) -> bool:
        """Does the peer hold its stage's live state (training or paused)?"""

    def is_training(self) -> bool:
        """Is it training (not paused, not leaving)?"""

    def is_paused(self) -> bool:
        """Is it paused?"""

    def toggle_pause(self) -> None:
        """Pause, or resume (``--pause-file``)."""

    def check_memory(self, stage_index: int) -> None:
        """Raise ``UserError`` if ``stage_index`` does not fit this peer's memory budget."""

    def leaving(self) -> None:
        """The session is about to announce that the peer leaves its stage."""

    def averaged(self, at: float, digest: str) -> None:
        """The stage's replicas averaged at ``at`` to parameters with ``digest``."""

    async def heartbeat(self) -> None:
        """Publish the peer's record now."""
