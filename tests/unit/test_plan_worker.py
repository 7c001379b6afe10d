"""peer.plan_worker: the global plan in a child process at the lowest priority, over a msgpack wire
(issue #18: in a thread, a plan starved the peer's event loop until neighbours declared it down)."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time

import msgpack
import numpy as np
import pytest

from peer.plan_watch import swarm_snapshot
from peer.plan_worker import PlanProcess, PlanWorkerError, from_wire, plan_in_process, to_wire
from planner.global_plan import GlobalPlanConfig, plan_global
from planner.snapshot import LinkMatrix, SwarmSnapshot
from tests.unit.test_plan_watch import QUICK, RECORDS, SPEC, view_of


def snapshot():
    return swarm_snapshot(view_of(RECORDS), SPEC, max_in_flight=8)[0]


def test_the_wire_carries_a_snapshot_a_config_and_a_plan_unchanged() -> None:
    original = snapshot()
    config = GlobalPlanConfig(max_pools=3, num_restarts=1)
    copy, config_copy = from_wire(to_wire((original, config)))
    assert config_copy == config
    assert copy.devices == original.devices and copy.runtime == original.runtime
    assert copy.model.layer_flops == original.model.layer_flops
    assert copy.model.batch_size == original.model.batch_size
    for name in ("latency_delay", "bandwidth"):  # the diagonal's inf included
        assert np.array_equal(getattr(copy.links, name), getattr(original.links, name))
    plan = plan_global(original, QUICK)
    assert from_wire(to_wire(plan)) == plan
    assert from_wire(to_wire({"a": 1.5, "b": [1, 2]})) == {"a": 1.5, "b": (1, 2)}


def test_the_wire_refuses_what_is_no_planner_value() -> None:
    with pytest.raises(TypeError, match="not a planner value"):
        to_wire(threading.Event())
    with pytest.raises(TypeError, match="float32"):
        to_wire(np.zeros(2, dtype=np.float32))
    hostile = [
        {"class": "Popen", "fields": {"args": "rm"}},  # a class outside the allow-list
        {"array": "object", "shape": [1], "data": b"\0" * 8},  # a dtype outside it
        {"array": "float64", "shape": [3], "data": b"\0" * 8},  # a shape the bytes do not fill
        {"class": "Device", "fields": {"peer_id": "a", "flops": -1.0, "memory_bytes": 0, "is_reliable": True}},
        {"class": "Device", "fields": {"peer_id": "a", "shell": "x"}},  # fields the class does not take
        {"eval": "1"},
    ]
    for value in hostile:
        with pytest.raises(ValueError, match="not a planner value"):
            from_wire(msgpack.packb(value))
    with pytest.raises(ValueError, match="not a planner value"):
        from_wire(b"\xc1 not msgpack")
    assert isinstance(from_wire(to_wire(LinkMatrix(latency_delay=np.zeros((2, 2)), bandwidth=np.ones((2, 2))))),
                      LinkMatrix)


def test_the_plan_computed_in_a_process_of_its_own_is_plan_global_s_and_a_failure_there_is_one_clear_error() -> None:
    """The same plan as in this process; a child that fails is a PlanWorkerError naming its error;
    plan_global's own ValueError (no plan fits) comes back a ValueError."""
    assert plan_in_process(snapshot(), QUICK, timeout=120) == plan_global(snapshot(), QUICK)
    with pytest.raises(PlanWorkerError, match="AttributeError"):
        plan_in_process(None, QUICK, timeout=120)
    original = snapshot()
    tiny = SwarmSnapshot(devices=tuple(dataclasses.replace(d, memory_bytes=1) for d in original.devices),
                         links=original.links, model=original.model, runtime=original.runtime)
    with pytest.raises(ValueError, match="no plan fits in memory"):
        plan_in_process(tiny, QUICK, timeout=120)


def test_a_leaving_peer_stops_its_planner_process_instead_of_waiting_for_it() -> None:
    """``PlanProcess.stop`` from another thread ends a plan under way at once (a child that would
    sleep a minute stands in for a long plan): a peer leaving mid-plan exits without waiting."""
    process = PlanProcess(command=(sys.executable, "-c", "import time; time.sleep(60)"))
    errors: list[BaseException] = []

    def plan() -> None:
        try:
            process.plan(snapshot(), QUICK, timeout=120)
        except PlanWorkerError as e:
            errors.append(e)

    thread = threading.Thread(target=plan)
    started = time.monotonic()
    thread.start()
    while process._child is None and time.monotonic() < started + 30:
        time.sleep(0.01)  # polls for the child's start, with a deadline
    process.stop()
    thread.join(30)
    assert not thread.is_alive() and len(errors) == 1 and "stopped" in str(errors[0]), errors
    assert process._child.returncode is not None
