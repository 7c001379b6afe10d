"""peer.plan_watch: the global plan from a view's records, the same for every order of them (issue #18)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random

from dht.link_figures import LinkFigure
from dht.records import PeerRecord, RunSpec
from peer.event_log import EventLog
from peer.plan_watch import MAX_PLANNED_PEERS, NO_MEMORY_LIMIT, GlobalPlanWatch, model_profile, swarm_snapshot
from planner.global_plan import GlobalPlanConfig
from swarm.model import layer_flops_per_sample
from swarm.view import SwarmView

SPEC = RunSpec(run_id="run")  # 4 blocks on 2 stages
REGION = {"a": 0, "b": 0, "c": 1, "d": 1, "e": 1}
QUICK = GlobalPlanConfig(max_pools=2, num_simulated=1, simulation_steps=2, min_simulated_microbatches=16)


def record(peer_id: str, stage: int, flops: float, *, state: str = "training", memory: int = 0) -> PeerRecord:
    links = tuple(LinkFigure(peer_id=other, rtt_ms=2.0 if REGION[other] == REGION[peer_id] else 120.0,
                             mbit_per_s=900.0 if REGION[other] == REGION[peer_id] else 20.0)
                  for other in REGION if other not in (peer_id, "e"))
    return PeerRecord(peer_id=peer_id, role="reliable", state=state, stage=stage, flops=flops, announced_at=100.0,
                      links=links, memory_bytes=memory)


RECORDS = [record("a", 0, 4e9), record("b", 0, 3e9), record("c", 1, 2e9), record("d", 1, 1e9, memory=2**33),
           record("e", -1, 5e9, state="joining")]


def view_of(records: list[PeerRecord]) -> SwarmView:
    view = SwarmView(None, "run")
    view.records = records
    return view


def test_the_snapshot_holds_the_layouts_members_their_links_and_the_model() -> None:
    snapshot, stage_of = swarm_snapshot(view_of(RECORDS), SPEC, max_in_flight=8)
    assert stage_of == {"a": 0, "b": 0, "c": 1, "d": 1}  # the joiner holds no stage yet
    assert [d.peer_id for d in snapshot.devices] == ["a", "b", "c", "d"]
    memory = {d.peer_id: d.memory_bytes for d in snapshot.devices}
    assert memory["a"] == NO_MEMORY_LIMIT and memory["d"] == 2**33
    i, j = snapshot.index_by_peer_id["a"], snapshot.index_by_peer_id["c"]
    assert snapshot.links.bandwidth[i, j] == 20e6 / 8 and snapshot.links.latency_delay[i, j] == 0.06
    assert snapshot.model.layer_flops == layer_flops_per_sample(SPEC)
    assert snapshot.runtime.max_in_flight_per_peer == 8
    # the default replicas exchange gradients every swarm-wide batch: blocking, once per batch
    per_batch = SPEC.target_batch_size // SPEC.microbatch_size
    assert SPEC.replica_sync == "gradients" and snapshot.runtime.averaging_period == 0
    assert model_profile(SPEC, num_stage0_peers=2).num_microbatches == per_batch
    periodic = dataclasses.replace(SPEC, replica_sync="periodic", pipeline_schedule="delayed")
    assert model_profile(periodic, num_stage0_peers=2).num_microbatches == 2 * per_batch
    snapshot, _ = swarm_snapshot(view_of(RECORDS), periodic, max_in_flight=8)
    assert snapshot.runtime.averaging_period == periodic.averaging_period
    assert swarm_snapshot(view_of(RECORDS[-1:]), SPEC, max_in_flight=8) is None


def test_every_order_of_the_records_gives_the_same_plan_and_verdict_and_each_check_writes_an_event(tmp_path) -> None:
    results = []
    for seed in range(3):
        path = tmp_path / f"events{seed}.jsonl"
        metrics = EventLog(str(path))
        watch = GlobalPlanWatch(view_of(random.Random(seed).sample(RECORDS, len(RECORDS))), SPEC, period=60.0,
                                max_in_flight=8, metrics=metrics, plan_config=QUICK)
        adoption = watch.check()
        metrics.close()
        events = [json.loads(line) for line in path.read_text().splitlines()]
        assert [e["event"] for e in events] == ["global_plan"]
        event = events[0]
        assert event["stage_layers"][0][0] == 0 and event["stage_layers"][-1][1] == SPEC.model.num_layers
        assert event["adopt"] == adoption.adopt and event["planned"] == adoption.planned
        results.append((adoption.plan, adoption.adopt, adoption.moves))
    assert len(set(results)) == 1


def test_a_swarm_larger_than_the_planner_handles_in_a_period_gets_no_plan(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    metrics = EventLog(str(path))
    many = [PeerRecord(peer_id=f"p{i:03d}", role="reliable", state="training", stage=i % 2, flops=1e9, announced_at=100.0)
            for i in range(MAX_PLANNED_PEERS + 1)]
    watch = GlobalPlanWatch(view_of(many), SPEC, period=60.0, max_in_flight=8, metrics=metrics, plan_config=QUICK)
    assert watch.check() is None
    metrics.close()
    assert path.read_text() == ""


def test_a_planner_error_costs_one_period_and_never_the_peer() -> None:
    """The loop of checks survives a check that raises (records the planner cannot use, or a bug)."""
    calls = []

    class Failing(GlobalPlanWatch):
        def check(self):
            calls.append(len(calls))
            if len(calls) == 1:
                raise ZeroDivisionError("a planner bug")
            stop.set()

    async def main() -> None:
        watch = Failing(view_of(RECORDS), SPEC, period=0.01, max_in_flight=8, metrics=EventLog(None))
        await asyncio.wait_for(watch.run(stop), timeout=60)

    stop = asyncio.Event()
    asyncio.run(main())
    assert calls == [0, 1]
