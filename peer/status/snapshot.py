"""What a peer is and does at one moment: the one thing every window onto it reads.

The peer (``peer.lifecycle.Peer``) builds a :class:`PeerSnapshot` about once a second, and at every
change of its :class:`PeerState`; the health page, ``/status.json``, ``/metrics``, the terminal view
and the libp2p status protocol read only the newest one. A snapshot is frozen plain data, so a window
can read it from any coroutine or thread, and a test builds one directly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class PeerState(Enum):
    """Where a peer is in its life; the value is what its DHT record and ``/status.json`` carry.

    joining → syncing → training (⇄ paused) → leaving; a move to another stage goes training →
    leaving → syncing → training again; a global plan that leaves the peer idle, training → standby
    → syncing (when a later plan names a stage for it) → training.
    """

    JOINING = "joining"  # in the DHT, measuring itself, choosing a stage
    SYNCING = "syncing"  # loading its stage's state (from holders, a backup, a checkpoint or the seed)
    TRAINING = "training"  # serving its stage
    PAUSED = "paused"  # holds its stage and state, takes no new work (SIGUSR1, --pause-file)
    STANDBY = "standby"  # holds no stage: the global plan leaves it idle (peer.standby)
    LEAVING = "leaving"  # announced its leave; finishing in-flight work

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ServiceCounters:
    """Counters of the services of the stage a peer serves (all zero before it serves one).

    Attributes:
        held_graphs: microbatches whose forward ran here and await their backward.
        requests_in_progress: forward requests being served now.
        in_flight_to_next_stage: microbatches sent to the next stage, not yet answered.
        averaging_rounds, averaging_failures: in-stage averaging rounds completed and failed.
        route_failures: sends to the next stage that failed.
        unrouted: microbatches no peer of the next stage took (stage 0).
        refused: bad requests refused by the stage server, the membership notices and replication.
        spot_checks: spot checks of the next stage by outcome (match, mismatch, skipped).
        exchanges, exchanges_partial, exchanges_alone: gradient exchanges with co-replicas: all, those
            missing a co-replica, and steps taken alone (``swarm.gradient_sync``).
    """

    held_graphs: int = 0
    requests_in_progress: int = 0
    in_flight_to_next_stage: int = 0
    averaging_rounds: int = 0
    averaging_failures: int = 0
    route_failures: int = 0
    unrouted: int = 0
    refused: int = 0
    spot_checks: Mapping[str, int] = field(default_factory=dict)
    exchanges: int = 0
    exchanges_partial: int = 0
    exchanges_alone: int = 0


@dataclass(frozen=True)
class PeerSnapshot:
    """One peer at one moment.

    Attributes:
        time: unix seconds when it was taken.
        run_id, role, client_mode: from the peer's config.
        state: its :class:`PeerState`.
        activity: what it does now, in words a volunteer reads: "training stage 1", "waiting: stage 1
            has no holder" (its stage trains, but the pipeline cannot), "loading stage 0's state", ...
        peer_id: empty until it joined the DHT.
        stage: the stage it serves (-1 before it chose one); num_stages None before the spec is known.
        step: optimizer steps of its stage replica.
        num_samples, num_microbatches: what it has processed; loss: its most recent (NaN if none);
        val_loss: its most recent held-out loss (stage 0; NaN if none).
        bytes_sent, bytes_received: payload bytes of its pipeline and state traffic (None if not counted).
        uptime_s: seconds since the peer started.
        flops: its measured FLOP/s.
        sync: the state download's progress (``SyncProgress.as_dict``), None if it downloaded nothing.
        checkpoint: the last checkpoint write's progress, None if it wrote none.
        bans, strikes: peers it banned and misbehaviours it counted (``dht.reputation``).
        services: its stage's :class:`ServiceCounters`.
    """

    time: float
    run_id: str
    role: str
    state: PeerState
    activity: str
    client_mode: bool = False
    peer_id: str = ""
    stage: int = -1
    num_stages: int | None = None
    step: int = 0
    num_samples: int = 0
    num_microbatches: int = 0
    loss: float = math.nan
    val_loss: float = math.nan
    bytes_sent: int | None = None
    bytes_received: int | None = None
    uptime_s: float | None = None
    flops: float = 0.0
    sync: Mapping[str, Any] | None = None
    checkpoint: Mapping[str, Any] | None = None
    bans: int = 0
    strikes: int = 0
    services: ServiceCounters = field(default_factory=ServiceCounters)


def describe_activity(state: PeerState, *, stage: int, joined: bool, unheld: list[int]) -> str:
    """What a peer in ``state`` at ``stage`` does now, as a volunteer wants to be told; ``joined``:
    it is in the DHT; ``unheld``: the other stages that have no holder now (the pipeline stalls)."""
    if state is PeerState.JOINING:
        return "choosing a stage" if joined else "joining the swarm"
    if state is PeerState.SYNCING:
        return f"loading the state of stage {stage}"
    if state is PeerState.PAUSED:
        return "paused: send SIGUSR1 (or remove the pause file) to resume"
    if state is PeerState.LEAVING:
        return "leaving"
    if state is PeerState.STANDBY:
        return "standing by: the swarm's global plan is faster without this peer for now"
    if unheld:
        return f"waiting: stage {unheld[0]} has no holder"
    return f"training stage {stage}"
