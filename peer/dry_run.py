"""``run_peer.py --dry-run``: "can I be useful?" — join, measure, plan, report, and leave.

The peer joins the DHT, reads the run spec and the current members' records, measures its FLOP/s,
and evaluates the same pure planner functions a real join uses (:mod:`planner.stage_choice`): the
stage it would take (placed after every joiner already announced, as it would be), whether that
stage fits its memory budget (:func:`peer.profiler.stage_memory_bytes`), and how the swarm's
bottleneck throughput would change. It announces nothing, takes no stage, allocates no model, and
leaves; the exit code is 0 whether or not the stage would fit (the report says which).

Cost model (planner/stage_choice.py): stage ``k`` processes ``T_k = sum_p f_p / cost_k`` samples/s;
the pipeline runs at ``min_k T_k``; this peer adds ``f / cost_k`` to the stage it takes.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from dht.records import PeerRecord, RunSpec
from dht.clock import SYSTEM_CLOCK
from peer.config import PeerConfig
from peer.errors import UserError
from peer.join import bootstrap_peer_ids, fetch_spec, open_swarm_dht, stage_costs
from peer.profiler import MIB, available_memory_bytes, measure_flops, resolve_device, stage_memory_bytes
from planner.stage_choice import Joiner, StageMember, assign_joiners, stage_throughputs
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
JOIN_COUNTED_STATES = ("syncing", "training")  # as peer.join counts members: paused or leaving peers add nothing


@dataclass(frozen=True, kw_only=True)
class DryRunPlan:
    """What a join would do. Throughputs are samples/s per stage; ``tokens_per_sample`` converts."""

    stage: int
    chosen_by: str  # "negotiated" or "--stage"
    needed_bytes: int
    budget_bytes: int
    budget_source: str
    before: list[float]
    after: list[float]
    own_samples_per_s: float
    peers_per_stage: list[int]

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.budget_bytes

    @property
    def bottleneck_gain(self) -> float:
        return min(self.after) - min(self.before)


def plan_join(
    spec: RunSpec, records: list[PeerRecord], *, peer_id: str, flops: float, now: float,
    forced_stage: int, needed_bytes_fn, budget_bytes: int, budget_source: str,
) -> DryRunPlan:
    """The stage a join would take now and what it would change; pure but for ``needed_bytes_fn``."""
    costs = stage_costs(spec)
    members = [StageMember(peer_id=r.peer_id, stage=r.stage, flops=r.flops) for r in records
               if r.state in JOIN_COUNTED_STATES and 0 <= r.stage < spec.num_stages and r.peer_id != peer_id]
    joiners = [Joiner(peer_id=r.peer_id, flops=r.flops, announced_at=r.announced_at)
               for r in records if r.state == "joining" and r.peer_id != peer_id]
    joiners.append(Joiner(peer_id=peer_id, flops=flops, announced_at=now))
    stage = forced_stage if forced_stage >= 0 else assign_joiners(costs, members, joiners)[peer_id]
    before = stage_throughputs(costs, members)
    after = stage_throughputs(costs, [*members, StageMember(peer_id=peer_id, stage=stage, flops=flops)])
    counts = [sum(1 for m in members if m.stage == k) for k in range(spec.num_stages)]
    return DryRunPlan(stage=stage, chosen_by="--stage" if forced_stage >= 0 else "negotiated",
                      needed_bytes=needed_bytes_fn(stage), budget_bytes=budget_bytes, budget_source=budget_source,
                      before=before, after=after, own_samples_per_s=flops / costs[stage], peers_per_stage=counts)


async def dry_run(config: PeerConfig) -> str:
    """Join, measure and plan, then leave; returns the report to print.

    Raises:
        UserError: unreachable swarm, unknown run, or a ``--stage`` the run does not have.
    """
    dht, _validator = await open_swarm_dht(config, is_visitor=True)  # client mode, a fresh identity
    view = None
    try:
        peer_id = dht.peer_id.to_base58()
        spec = await fetch_spec(dht, config.run_id, timeout=config.join_timeout, owner=config.run_owner,
                                bootstraps=bootstrap_peer_ids(config.bootstrap))
        if config.start_stage >= spec.num_stages:
            raise UserError(f"stage {config.start_stage} does not exist: run {spec.run_id} has {spec.num_stages} stages (0-{spec.num_stages - 1}).")
        device = resolve_device(config.device)
        flops = await asyncio.to_thread(measure_flops, spec, device)
        view = SwarmView(dht, spec.run_id)
        records = await view.refresh()
        budget = int(config.max_memory_mb * MIB) if config.max_memory_mb else available_memory_bytes(device)
        source = "--max-memory-mb" if config.max_memory_mb else f"available on {device}"
        plan = plan_join(spec, records, peer_id=peer_id, flops=flops, now=SYSTEM_CLOCK.dht_time(), forced_stage=config.start_stage,
                         needed_bytes_fn=lambda k: stage_memory_bytes(spec, k, max_in_flight=config.max_in_flight,
                                                                      checkpoint_activations=config.activation_checkpointing),
                         budget_bytes=budget, budget_source=source)
        return format_plan(plan, spec, peer_id=peer_id, flops=flops, device=str(device))
    finally:
        if view is not None:
            await view.shutdown()
        dht.shutdown()


def format_plan(plan: DryRunPlan, spec: RunSpec, *, peer_id: str, flops: float, device: str) -> str:
    tokens = spec.model.seq_len
    start, end = spec.stage_layers[plan.stage]
    fit = ("fits" if plan.fits else
           "does NOT fit: raise --max-memory-mb, free memory, lower --max-in-flight, or give --activation-checkpointing")
    stages = "; ".join(f"stage {k}: {n} peer{'s' * (n != 1)}, {t * tokens:,.0f} tokens/s"
                       for k, (n, t) in enumerate(zip(plan.peers_per_stage, plan.before, strict=True)))
    return "\n".join([
        f"dry run of run {spec.run_id} as {peer_id}: joined, measured, left without taking a stage",
        f"measured   {flops / 1e9:.2f} GFLOP/s on {device}",
        f"stage      would take stage {plan.stage} of {spec.num_stages} (layers {start}-{end - 1}; {plan.chosen_by})",
        f"memory     needs about {plan.needed_bytes / MIB:,.0f} MiB; budget {plan.budget_bytes / MIB:,.0f} MiB "
        f"({plan.budget_source}): {fit}",
        f"throughput this peer would process {plan.own_samples_per_s * tokens:,.0f} tokens/s at stage {plan.stage}; "
        f"the swarm's bottleneck would go from {min(plan.before) * tokens:,.0f} to {min(plan.after) * tokens:,.0f} "
        f"tokens/s ({plan.bottleneck_gain * tokens:+,.0f})",
        f"swarm now  {stages}",
    ])
