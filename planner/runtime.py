"""The runtime's settings that the cost model needs, as plain numbers (issue #18).

The planner must not import ``peer/`` or ``swarm/``, so the figures of the running pipeline that
change what a plan is worth are copied here by whoever builds the snapshot: how many micro-batches
a stage-0 peer keeps in flight (``peer.config`` ``max_in_flight``), how many bytes cross a stage
boundary per byte computed (the boundary codec), and how often a stage averages. A plan optimised
without them is optimised for another system: the in-flight window caps throughput at
``window / round-trip`` (Little's law) and holds activations in memory, the codec shrinks every
boundary transfer, and averaging shares the links with the pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RuntimeSettings:
    """What the running swarm does with a plan.

    Attributes:
        max_in_flight_per_peer: micro-batches each stage-0 server keeps in the pipeline at once
            (``--max-in-flight``); the window of the whole pipeline is this times the number
            of stage-0 servers. The default here, 4, is what the planner's benches and tests were
            tuned and measured with; the live peer's ``--max-in-flight`` is 8 since issue #16
            (flow control keeps the window at or below it), and the lifetime simulator uses 8.
        boundary_compression_ratio: bytes sent across a stage boundary per byte of the layer's
            output as profiled (1.0: as computed; 0.5: bf16/fp16 of fp32; 1/3.76: int8 of fp32).
        averaging_period: seconds between a stage's averaging rounds (``--averaging-period``, 15);
            0 means every step, blocking (seed 000's runtime: a step lasts at least the round).
        is_flushing: each step drains the pipeline of its micro-batches and then averages
            (``RunSpec.pipeline_schedule`` "flush", the runtime's default, whose replicas
            exchange gradients after every batch): a step pays the pipeline's fill and drain and
            the round after them. False: steps overlap (delayed updates), as seed 000 has it.
    """

    max_in_flight_per_peer: int = 4
    boundary_compression_ratio: float = 1.0
    averaging_period: float = 15.0
    is_flushing: bool = False

    def __post_init__(self) -> None:
        if self.max_in_flight_per_peer < 1:
            raise ValueError(f"max_in_flight_per_peer must be >= 1, got {self.max_in_flight_per_peer}")
        if not (0.0 < self.boundary_compression_ratio <= 1.0):
            raise ValueError(f"boundary_compression_ratio must lie in (0, 1], got {self.boundary_compression_ratio}")
        if not (math.isfinite(self.averaging_period) and self.averaging_period >= 0):
            raise ValueError(f"averaging_period must be finite and >= 0, got {self.averaging_period}")
