"""Swarm snapshot: the immutable input of every planner function.

A snapshot is what a peer reads from the DHT before it plans (DESIGN §2): the devices with their
measured compute, memory and role (seed 000 §3.1.1: reliable / unreliable groups), the latency and
bandwidth between every pair (seed 000 §3.1.3: matrices A and B), and the model's per-layer
profile (seed 001 §3.3: per-layer FLOPs, parameter bytes, activation bytes).

Determinism: ``SwarmSnapshot`` sorts its devices by ``peer_id`` and permutes the link matrices to
match in ``__post_init__``, so two peers that list the same swarm in different orders hold equal
snapshots and every float sum afterwards runs in the same order.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from planner.runtime import RuntimeSettings


@dataclass(frozen=True, kw_only=True)
class Device:
    """One peer's device as profiled (seed 002 §3.2, seed 001 §3.3).

    Attributes:
        peer_id: the peer's stable identifier; the sort key of every planner input.
        flops: sustained training throughput in FLOP/s.
        memory_bytes: memory available for the stage (weights, optimizer state, activations).
        is_reliable: True for a committed peer that can serve as a parameter server (seed 000 §3.1.1).
    """

    peer_id: str
    flops: float
    memory_bytes: int
    is_reliable: bool

    def __post_init__(self) -> None:
        if not self.peer_id:
            raise ValueError("peer_id must be a non-empty string")
        if not (math.isfinite(self.flops) and self.flops > 0):
            raise ValueError(f"flops must be finite and > 0, got {self.flops!r}")
        if self.memory_bytes < 0:
            raise ValueError(f"memory_bytes must be >= 0, got {self.memory_bytes!r}")


def _read_only(array: np.ndarray) -> np.ndarray:
    """``array``, no longer writable (a snapshot's figures are shared by every planner)."""
    array.setflags(write=False)
    return array


@dataclass(frozen=True, kw_only=True, eq=False)
class LinkMatrix:
    """Pairwise link figures, indexed like the snapshot's devices (seed 000 §3.1.3).

    Attributes:
        latency_delay: (n, n) one-way latency in seconds; the diagonal is ignored.
        bandwidth: (n, n) bandwidth in bytes per second; the diagonal is ignored.
    """

    latency_delay: np.ndarray
    bandwidth: np.ndarray

    def __post_init__(self) -> None:
        latency = np.array(self.latency_delay, dtype=np.float64)
        bandwidth = np.array(self.bandwidth, dtype=np.float64)
        if latency.ndim != 2 or latency.shape[0] != latency.shape[1]:
            raise ValueError(f"latency_delay must be square, got shape {latency.shape}")
        if bandwidth.shape != latency.shape:
            raise ValueError(f"bandwidth shape {bandwidth.shape} != latency shape {latency.shape}")
        off_diagonal = ~np.eye(latency.shape[0], dtype=bool)
        if not np.all(np.isfinite(latency[off_diagonal])) or np.any(latency[off_diagonal] < 0):
            raise ValueError("latency_delay must be finite and >= 0 off the diagonal")
        if np.any(np.isnan(bandwidth[off_diagonal])) or np.any(bandwidth[off_diagonal] <= 0):
            raise ValueError("bandwidth must be > 0 off the diagonal")
        np.fill_diagonal(latency, 0.0)
        np.fill_diagonal(bandwidth, np.inf)
        latency.setflags(write=False)
        bandwidth.setflags(write=False)
        object.__setattr__(self, "latency_delay", latency)
        object.__setattr__(self, "bandwidth", bandwidth)

    @property
    def num_devices(self) -> int:
        """Number of devices the matrices describe."""
        return int(self.latency_delay.shape[0])

    @functools.cached_property
    def inverse_bandwidth(self) -> np.ndarray:
        """``1 / beta`` in seconds per byte (0 on the diagonal), built once: the cost model reads
        it for every stage group a planner scores."""
        return _read_only(1.0 / self.bandwidth)

    @functools.cached_property
    def mean_latency(self) -> np.ndarray:
        """``(alpha_ij + alpha_ji) / 2``, the latency a client and a server see between them."""
        return _read_only((self.latency_delay + self.latency_delay.T) / 2)

    @functools.cached_property
    def mean_inverse_bandwidth(self) -> np.ndarray:
        """``(1 / beta_ij + 1 / beta_ji) / 2``, seconds per byte between a client and a server."""
        return _read_only((self.inverse_bandwidth + self.inverse_bandwidth.T) / 2)

    def permuted(self, order: np.ndarray) -> LinkMatrix:
        """Returns the matrices with rows and columns taken in ``order``."""
        index = np.ix_(order, order)
        return LinkMatrix(latency_delay=self.latency_delay[index], bandwidth=self.bandwidth[index])


@dataclass(frozen=True, kw_only=True, eq=False)
class ModelProfile:
    """Per-layer profile of the model and the shape of one training step.

    Attributes:
        layer_flops: FLOPs of forward plus backward per sample, per layer.
        layer_param_bytes: parameter bytes per layer.
        layer_activation_bytes: bytes of the layer's output activation per sample (the same
            size flows back as a gradient; seed 000 §3.1.3 ``t``).
        microbatch_size: samples per micro-batch (seed 000 ``B/d``).
        num_microbatches: micro-batches per step (seed 000 ``d``).
        optimizer_bytes_per_param_byte: bytes of gradients plus optimizer state held per
            parameter byte (3.0 for fp32 Adam: gradient and two moments).
    """

    layer_flops: tuple[float, ...]
    layer_param_bytes: tuple[float, ...]
    layer_activation_bytes: tuple[float, ...]
    microbatch_size: int = 4
    num_microbatches: int = 32
    optimizer_bytes_per_param_byte: float = 3.0

    def __post_init__(self) -> None:
        num_layers = len(self.layer_flops)
        if num_layers == 0:
            raise ValueError("a model needs at least one layer")
        for name in ("layer_param_bytes", "layer_activation_bytes"):
            if len(getattr(self, name)) != num_layers:
                raise ValueError(f"{name} must have {num_layers} entries like layer_flops")
        for name in ("layer_flops", "layer_param_bytes", "layer_activation_bytes"):
            values = np.asarray(getattr(self, name), dtype=np.float64)
            if not np.all(np.isfinite(values)) or np.any(values < 0):
                raise ValueError(f"{name} must be finite and >= 0")
            object.__setattr__(self, name, tuple(float(v) for v in values))
        if self.microbatch_size < 1 or self.num_microbatches < 1:
            raise ValueError("microbatch_size and num_microbatches must be >= 1")
        if not (self.optimizer_bytes_per_param_byte >= 0):
            raise ValueError("optimizer_bytes_per_param_byte must be >= 0")

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.layer_flops)

    @property
    def batch_size(self) -> int:
        """Samples per training step (seed 000 ``B``)."""
        return self.microbatch_size * self.num_microbatches

    @functools.cached_property
    def prefix_sums(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Prefix sums, from 0, of the layers' FLOPs, parameter bytes and activation bytes: a
        layer range's figures are differences of two entries. Built once (read-only); the layer
        split reads them for every stage group a planner scores."""
        return tuple(
            _read_only(np.concatenate([[0.0], np.cumsum(values)]))
            for values in (self.layer_flops, self.layer_param_bytes, self.layer_activation_bytes)
        )

    @functools.cached_property
    def range_param_bytes(self) -> np.ndarray:
        """``P[a, b]`` = parameter bytes of layers [a, b) (0 where a >= b), built once."""
        prefix_params = self.prefix_sums[1]
        return _read_only(np.maximum(prefix_params[None, :] - prefix_params[:, None], 0.0))

    @functools.cached_property
    def layer_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, ends) of every layer range [a, b), a < b, in ``np.triu_indices`` order."""
        starts, ends = np.triu_indices(self.num_layers + 1, k=1)
        return _read_only(starts), _read_only(ends)


@dataclass(frozen=True, kw_only=True, eq=False)
class SwarmSnapshot:
    """Devices, links and model as one peer sees them; canonicalised by peer id.

    Attributes:
        devices: the devices, sorted by ``peer_id`` in ``__post_init__``.
        links: link matrices permuted to the sorted device order.
        model: the model profile.
        runtime: the runtime's settings (in-flight window, boundary compression, averaging
            period); part of the snapshot because they change what a plan is worth.
    """

    devices: tuple[Device, ...]
    links: LinkMatrix
    model: ModelProfile
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    index_by_peer_id: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        devices = tuple(self.devices)
        if not devices:
            raise ValueError("a snapshot needs at least one device")
        if self.links.num_devices != len(devices):
            raise ValueError(f"links describe {self.links.num_devices} devices, not {len(devices)}")
        peer_ids = [device.peer_id for device in devices]
        if len(set(peer_ids)) != len(peer_ids):
            raise ValueError("peer ids must be unique")
        order = np.array(sorted(range(len(devices)), key=lambda i: peer_ids[i]), dtype=np.int64)
        object.__setattr__(self, "devices", tuple(devices[i] for i in order))
        if np.any(order != np.arange(len(devices))):
            object.__setattr__(self, "links", self.links.permuted(order))
        index = {device.peer_id: i for i, device in enumerate(self.devices)}
        object.__setattr__(self, "index_by_peer_id", index)
        flops = np.array([d.flops for d in self.devices], dtype=np.float64)
        memory = np.array([d.memory_bytes for d in self.devices], dtype=np.float64)
        flops.setflags(write=False)
        memory.setflags(write=False)
        object.__setattr__(self, "_flops", flops)
        object.__setattr__(self, "_memory", memory)

    @property
    def num_devices(self) -> int:
        """Number of devices."""
        return len(self.devices)

    @property
    def flops(self) -> np.ndarray:
        """FLOP/s per device, in sorted order (read-only)."""
        return self._flops  # type: ignore[attr-defined]

    @property
    def memory_bytes(self) -> np.ndarray:
        """Memory bytes per device, in sorted order (read-only)."""
        return self._memory  # type: ignore[attr-defined]

    def reliable_indices(self) -> list[int]:
        """Indices of reliable devices, ascending (so in peer-id order)."""
        return [i for i, device in enumerate(self.devices) if device.is_reliable]

    def unreliable_indices(self) -> list[int]:
        """Indices of unreliable devices, ascending (so in peer-id order)."""
        return [i for i, device in enumerate(self.devices) if not device.is_reliable]

    def indices_of(self, peer_ids: tuple[str, ...]) -> np.ndarray:
        """Device indices of ``peer_ids``; raises ValueError for an unknown peer."""
        try:
            return np.array([self.index_by_peer_id[p] for p in peer_ids], dtype=np.int64)
        except KeyError as error:
            raise ValueError(f"unknown peer id {error.args[0]!r}") from None
