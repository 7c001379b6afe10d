"""What a peer says of itself: its DHT record (heartbeat after heartbeat) and the snapshot its
windows read (``peer.status``), both taken from the peer's attributes at one moment.

``peer.lifecycle.Peer`` owns the attributes; these read them and nothing else, so the peer's life
and what it shows of it stay apart.
"""

from __future__ import annotations

import math
import time
from typing import Any

from dht.records import PeerRecord
from dht.wire import TRAFFIC
from peer.status.local import SOFTWARE_VERSION
from peer.status.snapshot import PeerSnapshot, ServiceCounters, describe_activity


def peer_record(peer: Any, stage: int | None = None) -> PeerRecord:
    """The DHT record of ``peer`` (``peer.lifecycle.Peer``) now, at ``stage`` (default: the one it holds)."""
    counters = peer.stage.counters if peer.stage else None
    backup = peer.keeper.backup if peer.keeper else None
    layout = peer.spec is not None and peer.spec.layout_version
    return PeerRecord(
        peer_id=peer.peer_id, role=peer.role, state=peer.state.value,
        stage=stage if stage is not None else peer.stage.index, flops=peer.flops,
        samples_per_s=counters.samples_per_s if counters else 0.0, num_samples=counters.num_samples if counters else 0,
        version=peer.stage.version if peer.stage else 0, announced_at=peer.announced_at,
        loss=counters.last_loss if counters else math.nan,
        val_loss=peer.session.val_loss if peer.session is not None and not peer.session.is_closed else math.nan,
        backup_stage=backup.stage if backup else -1, backup_version=backup.version if backup else 0,
        maddrs=peer.maddrs, params_digest=peer.averaged_round[1], averaged_at=peer.averaged_round[0],
        software_version=SOFTWARE_VERSION, bytes_sent=TRAFFIC.bytes_sent, bytes_received=TRAFFIC.bytes_received,
        layout_version=peer.spec.layout_version if peer.spec else 0, memory_bytes=peer.memory_budget,
        pinned=peer.config.stage >= 0, stage_layers=peer.spec.stage_layers if layout else (),
        **(peer.layout_change.record_fields(peer.peer_id) if layout and peer.layout_change else {}),
        links=peer.ctx.links.summary() if peer.ctx is not None else (), reachability=peer.node.reach.kind)


def peer_snapshot(peer: Any) -> PeerSnapshot:
    """The :class:`PeerSnapshot` of ``peer`` (``peer.lifecycle.Peer``) now."""
    stage, session = peer.stage, peer.session if peer.session is not None and not peer.session.is_closed else None
    counters = stage.counters if stage is not None else None
    checkpoint = session.checkpoint_progress if session is not None else None
    checkpoint = checkpoint or peer.checkpoint_progress
    sync = peer.loader.progress if peer.loader is not None else None
    return PeerSnapshot(
        time=time.time(), run_id=peer.config.run_id, role=peer.role, client_mode=bool(peer.config.client_mode),
        state=peer.state, activity=_activity(peer), peer_id=peer.peer_id,
        stage=stage.index if stage is not None else -1, num_stages=peer.spec.num_stages if peer.spec else None,
        step=stage.version if stage is not None else 0,
        num_samples=counters.num_samples if counters else 0,
        num_microbatches=counters.num_microbatches if counters else 0,
        loss=counters.last_loss if counters else math.nan,
        val_loss=session.val_loss if session is not None else math.nan,
        bytes_sent=TRAFFIC.bytes_sent, bytes_received=TRAFFIC.bytes_received,
        uptime_s=time.monotonic() - peer.started_at, flops=peer.flops,
        sync=sync.as_dict() if sync is not None else None,
        checkpoint=checkpoint.as_dict() if checkpoint is not None else None,
        bans=peer.reputation.num_bans if peer.reputation is not None else 0,
        strikes=peer.reputation.num_strikes if peer.reputation is not None else 0,
        services=session.counters() if session is not None else ServiceCounters(),
    )


def _activity(peer: Any) -> str:
    index = peer.stage.index if peer.stage is not None else -1
    unheld = [k for k in range(peer.spec.num_stages) if k != index and not peer.view.members(k)] if peer.view else []
    return describe_activity(peer.state, stage=index, joined=bool(peer.peer_id), unheld=unheld)
