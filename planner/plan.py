"""Plan: the output of every global planner — ordered stages, their layers and their peers.

A stage (seed 000 §3.2) is a contiguous layer range served by reliable parameter servers, split
into frontal servers (receive activations from the previous stage) and backward servers (send them
on), plus unreliable clients that take tasks from the stage's task pool. A device that appears in
no stage is idle (a standby, or a device that fits no stage's memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.snapshot import SwarmSnapshot


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One pipeline stage.

    Attributes:
        layer_start: first layer of the stage.
        layer_end: one past the last layer of the stage.
        server_ids: reliable peers holding the stage (parameter servers), sorted.
        client_ids: unreliable peers working for the stage, sorted.
        frontal_ids: servers that receive from the previous stage (non-empty subset of servers).
        backward_ids: servers that send to the next stage (non-empty subset of servers).
    """

    layer_start: int
    layer_end: int
    server_ids: tuple[str, ...]
    client_ids: tuple[str, ...] = ()
    frontal_ids: tuple[str, ...] = ()
    backward_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"bad layer range [{self.layer_start}, {self.layer_end})")
        if not self.server_ids:
            raise ValueError("a stage needs at least one server")
        for name in ("server_ids", "client_ids", "frontal_ids", "backward_ids"):
            object.__setattr__(self, name, tuple(sorted(getattr(self, name))))
        if not self.frontal_ids:
            object.__setattr__(self, "frontal_ids", self.server_ids)
        if not self.backward_ids:
            object.__setattr__(self, "backward_ids", self.server_ids)
        servers = set(self.server_ids)
        if not set(self.frontal_ids) <= servers or not set(self.backward_ids) <= servers:
            raise ValueError("frontal and backward servers must be servers of the stage")
        if servers & set(self.client_ids):
            raise ValueError("a peer cannot be both server and client of a stage")

    @property
    def peer_ids(self) -> tuple[str, ...]:
        """Servers then clients."""
        return self.server_ids + self.client_ids

    @property
    def num_layers(self) -> int:
        """Number of layers in the stage."""
        return self.layer_end - self.layer_start


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Stages in pipeline order; layers contiguous from 0; every peer in at most one stage.

    Attributes:
        stages: the stages, first to last.
    """

    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise ValueError("a plan needs at least one stage")
        expected_start = 0
        seen: set[str] = set()
        for stage in self.stages:
            if stage.layer_start != expected_start:
                raise ValueError(f"stage starts at layer {stage.layer_start}, expected {expected_start}")
            expected_start = stage.layer_end
            duplicated = seen & set(stage.peer_ids)
            if duplicated:
                raise ValueError(f"peers {sorted(duplicated)} appear in two stages")
            seen.update(stage.peer_ids)

    @property
    def num_layers(self) -> int:
        """Layers covered by the plan."""
        return self.stages[-1].layer_end

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.stages)

    def assigned_peer_ids(self) -> list[str]:
        """All peers of all stages, sorted."""
        return sorted(p for stage in self.stages for p in stage.peer_ids)

    def stage_of(self, peer_id: str) -> int | None:
        """Index of the stage that holds ``peer_id``, or None when it is idle."""
        for index, stage in enumerate(self.stages):
            if peer_id in stage.server_ids or peer_id in stage.client_ids:
                return index
        return None

    def stage_of_layer(self, layer: int) -> int:
        """Index of the stage that holds ``layer``."""
        for index, stage in enumerate(self.stages):
            if stage.layer_start <= layer < stage.layer_end:
                return index
        raise ValueError(f"layer {layer} is outside the plan's {self.num_layers} layers")

    def check_fits(self, snapshot: SwarmSnapshot) -> None:
        """Raises ValueError unless the plan covers the model and its servers are reliable."""
        if self.num_layers != snapshot.model.num_layers:
            raise ValueError(f"plan covers {self.num_layers} layers, model has {snapshot.model.num_layers}")
        for stage in self.stages:
            for index in snapshot.indices_of(stage.server_ids):
                if not snapshot.devices[index].is_reliable:
                    raise ValueError(f"server {snapshot.devices[index].peer_id} is not reliable")
            snapshot.indices_of(stage.client_ids)
