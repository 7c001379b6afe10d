"""The global plan in a process of its own: ``python -m peer.plan_worker`` reads a
``(SwarmSnapshot, GlobalPlanConfig)`` on stdin and writes the ``plan_global`` result on stdout.

Why a process: ``plan_global`` is seconds of numpy and Python loops (5-16 s for five peers on a
loaded 2-core host, 10 s at 1,000 peers on a quiet one). Run in a thread of the peer (it was, until
2026-11-28), it held the GIL in turns with the event loop, and every send and receive of the loop
waited for its turn: during one plan a peer's view refresh took 9.6 s and its heartbeat 9.5 s, its
pings went unanswered, and a neighbour declared it down (CI rehearsal of the 20 Mbit/s swarm,
tests/e2e/test_internet.py). In a process of its own at the lowest CPU priority, planning takes only
the CPU nothing else wants. It imports numpy, msgpack and the planner only (no torch, no hivemind).

The wire (:func:`to_wire`, :func:`from_wire`) is msgpack, like every other in the project (no
pickle: ``tests/unit/test_no_pickle.py``): a planner dataclass of an allow-listed class is a map of
its constructor's fields, rebuilt through the constructor (so its checks run again); a numpy array
is its dtype (float64, int64 or bool), shape and raw bytes; a sequence comes back a tuple.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import msgpack
import numpy as np

from planner.global_plan import GlobalPlanConfig, plan_global
from planner.partition import PartitionConfig
from planner.plan import Plan, Stage
from planner.refinement import RefinementConfig
from planner.runtime import RuntimeSettings
from planner.snapshot import Device, LinkMatrix, ModelProfile, SwarmSnapshot

NICENESS = 19  # the lowest CPU priority: planning is advice, training comes first


WIRE_CLASSES = {cls.__name__: cls for cls in (SwarmSnapshot, Device, LinkMatrix, ModelProfile, RuntimeSettings,
                                               GlobalPlanConfig, PartitionConfig, RefinementConfig, Plan, Stage)}
WIRE_DTYPES = ("float64", "int64", "bool")


class PlanWorkerError(RuntimeError):
    """The planner process failed or ran out of time; the message says how."""


def to_wire(value: Any) -> bytes:
    """``value`` (planner dataclasses, arrays, numbers, strings, sequences, maps) as msgpack bytes.

    Raises:
        TypeError: a value of another type (a class not in :data:`WIRE_CLASSES`, an array of
            another dtype).
    """
    return msgpack.packb(_plain(value), use_bin_type=True)


def from_wire(data: bytes) -> Any:
    """The value :func:`to_wire` packed.

    Raises:
        ValueError: not such bytes (an unknown class or dtype, a shape that does not match the
            bytes, fields the class does not take, or the class's own checks).
    """
    try:
        return _rebuilt(msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=False))
    except (msgpack.UnpackException, ValueError, TypeError) as e:
        raise ValueError(f"not a planner value: {e}") from e


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        if WIRE_CLASSES.get(name) is not type(value):
            raise TypeError(f"{name} is not a planner value the wire carries")
        return {"class": name, "fields": {f.name: _plain(getattr(value, f.name))
                                          for f in dataclasses.fields(value) if f.init}}
    if isinstance(value, np.ndarray):
        if value.dtype.name not in WIRE_DTYPES:
            raise TypeError(f"an array of {value.dtype} is not carried")
        return {"array": value.dtype.name, "shape": list(value.shape), "data": np.ascontiguousarray(value).tobytes()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {"map": [[_plain(k), _plain(v)] for k, v in value.items()]}
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a {type(value).__name__} is not a planner value the wire carries")


def _rebuilt(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_rebuilt(v) for v in value)
    if not isinstance(value, dict):
        return value
    if "class" in value:
        cls = WIRE_CLASSES.get(value["class"])
        if cls is None or not isinstance(value.get("fields"), dict):
            raise ValueError(f"unknown class {value['class']!r}")
        return cls(**{str(k): _rebuilt(v) for k, v in value["fields"].items()})
    if "array" in value:
        if value["array"] not in WIRE_DTYPES:
            raise ValueError(f"an array of {value['array']!r} is not carried")
        shape = tuple(int(n) for n in value["shape"])
        return np.frombuffer(value["data"], dtype=value["array"]).reshape(shape).copy()
    if "map" in value:
        return {_rebuilt(k): _rebuilt(v) for k, v in value["map"]}
    raise ValueError(f"a map of {sorted(map(str, value))} is no planner value")


class PlanProcess:
    """Runs plans in child processes (:meth:`plan`, from any thread) and can stop the one running
    (:meth:`stop`, from any other): a peer that leaves does not wait for a plan nobody will read."""

    def __init__(self, command: tuple[str, ...] = (sys.executable, "-m", "peer.plan_worker")) -> None:
        self.command = command
        self._child: subprocess.Popen | None = None
        self._stopped = False

    def plan(self, snapshot: SwarmSnapshot, config: GlobalPlanConfig, *, timeout: float) -> Plan:
        return plan_in_process(snapshot, config, timeout=timeout, process=self)

    def stop(self) -> None:
        """Kill the running child (if any) and every later one at its start."""
        self._stopped = True
        child = self._child
        if child is not None and child.poll() is None:
            child.kill()

    def _started(self, child: subprocess.Popen) -> None:
        self._child = child
        if self._stopped:
            child.kill()


def plan_in_process(snapshot: SwarmSnapshot, config: GlobalPlanConfig, *, timeout: float,
                    process: PlanProcess | None = None) -> Plan:
    """``plan_global(snapshot, config)`` in a child process at :data:`NICENESS` (module doc);
    ``process`` can stop it from another thread.

    Raises:
        PlanWorkerError: the child failed (its last error line), or took longer than ``timeout``
            seconds (it is killed).
        ValueError: as ``plan_global`` (no plan fits in memory), raised again here.
    """
    process = process or PlanProcess()
    child = subprocess.Popen(list(process.command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    process._started(child)
    try:
        os.setpriority(os.PRIO_PROCESS, child.pid, NICENESS)
    except OSError:  # gone already, or not allowed: it runs at the peer's priority
        pass
    try:
        out, err = child.communicate(to_wire((snapshot, config)), timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise PlanWorkerError(f"the planner process took more than {timeout:.0f} s and was stopped") from None
    if process._stopped:
        raise PlanWorkerError("the planner process was stopped: this peer is leaving")
    if child.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        last = lines[-1] if lines else "no message"
        raise PlanWorkerError(f"the planner process failed (exit {child.returncode}): {last}")
    result = from_wire(out)
    if isinstance(result, str):  # plan_global's ValueError
        raise ValueError(result)
    return result


def main() -> None:
    snapshot, config = from_wire(sys.stdin.buffer.read())
    try:
        result: object = plan_global(snapshot, config)
    except ValueError as e:  # no plan fits: the caller's error to handle, not a crash
        result = str(e)
    sys.stdout.buffer.write(to_wire(result))


if __name__ == "__main__":
    main()
