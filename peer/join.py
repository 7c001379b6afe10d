"""Joining a run: find its spec, negotiate a stage, and obtain that stage's state.

Each policy step is the house pattern: read a snapshot from the DHT (I/O), call a pure planner
function, apply the result (I/O).
"""

from __future__ import annotations

import asyncio
import logging
import time

import hivemind
import torch
from hivemind.p2p import P2P

from dht.records import PeerRecord, RunSpec
from dht.registry import fetch_run_ids, fetch_run_specs
from peer.errors import UserError
from planner.stage_choice import Joiner, StageMember, assign_joiners
from swarm.model import stage_flops_per_sample
from dht.rpc import PeerUnavailableError, RemoteError, call_peer, state_handler
from swarm.stage import Stage
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
SPEC_POLL_PERIOD = 0.5


async def fetch_spec(dht: hivemind.DHT, run_id: str, *, timeout: float) -> RunSpec:
    """The run's spec, polled until ``timeout``; several conflicting specs → the first by publisher key.

    Raises:
        UserError: nobody in this swarm serves ``run_id``.
    """
    deadline = time.monotonic() + timeout
    while True:
        specs = await fetch_run_specs(dht, run_id)
        if specs:
            if len({repr(s.to_wire()) for s in specs}) > 1:
                logger.warning(f"{len(specs)} different specs are published for run {run_id}; using the first")
            return specs[0]
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(SPEC_POLL_PERIOD)
    known = await fetch_run_ids(dht)
    seen = f"runs it serves: {', '.join(known)}" if known else "it lists no runs yet"
    raise UserError(f"No run named '{run_id}' is served by this swarm ({seen}); check --run-id or the bootstrap address.")


def stage_costs(spec: RunSpec) -> list[float]:
    return [stage_flops_per_sample(spec, k) for k in range(spec.num_stages)]


def choose_stage_from_view(spec: RunSpec, records: list[PeerRecord], peer_id: str) -> int:
    """Apply :func:`planner.stage_choice.assign_joiners` to the current records; this peer's stage."""
    members = [StageMember(peer_id=r.peer_id, stage=r.stage, flops=r.flops)
               for r in records if r.state in ("syncing", "training") and 0 <= r.stage < spec.num_stages
               and r.peer_id != peer_id]
    joiners = [Joiner(peer_id=r.peer_id, flops=r.flops, announced_at=r.announced_at)
               for r in records if r.state == "joining"]
    if peer_id not in {j.peer_id for j in joiners}:
        raise RuntimeError("this peer's own join intent is not visible in the DHT yet")
    return assign_joiners(stage_costs(spec), members, joiners)[peer_id]


async def negotiate_stage(
    view: SwarmView, spec: RunSpec, peer_id: str, *, settle_delay: float, timeout: float
) -> tuple[int, list[PeerRecord]]:
    """Wait ``settle_delay`` for concurrent joiners to announce, then choose like all of them would.

    Returns:
        the chosen stage and the snapshot of records it was chosen from.
    """
    await asyncio.sleep(settle_delay)
    deadline = time.monotonic() + timeout
    while True:
        records = await view.refresh()
        try:
            return choose_stage_from_view(spec, records, peer_id), records
        except RuntimeError:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.2)


async def download_stage_state(
    p2p: P2P, stage: Stage, donors: list[PeerRecord], *, timeout: float, max_payload_bytes: int
) -> PeerRecord | None:
    """Load the stage's state from the first donor that serves it (freshest version first).

    The simple single-donor path; the multi-neighbour replication of ``replication/`` replaces it.

    Returns:
        the donor used, or None if no donor could serve it.
    """
    for donor in sorted(donors, key=lambda r: (-r.version, r.peer_id)):
        try:
            reply, tensors = await call_peer(p2p, donor.peer_id, state_handler(stage.spec.run_id), {"stage": stage.index},
                                             timeout=timeout, max_payload_bytes=max_payload_bytes)
            names = reply.get("names")
            if not isinstance(names, list) or len(names) != len(tensors) or not all(isinstance(n, str) for n in names):
                raise RemoteError("state reply names do not match its tensors")
            state: dict[str, torch.Tensor] = dict(zip(names, tensors))
            await stage.run(stage.load_state_tensors, state)
            logger.info(f"downloaded stage {stage.index} state version {stage.version} from {donor.peer_id[-6:]}")
            return donor
        except (PeerUnavailableError, RemoteError, ValueError) as e:
            logger.warning(f"could not download state from {donor.peer_id[-6:]}: {e}")
    return None
