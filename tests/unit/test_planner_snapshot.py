"""Snapshot and plan validation."""

from __future__ import annotations

import numpy as np
import pytest

from planner.plan import Plan, Stage
from planner.snapshot import Device, LinkMatrix, ModelProfile, SwarmSnapshot


def _model() -> ModelProfile:
    return ModelProfile(layer_flops=(1.0, 2.0), layer_param_bytes=(1.0, 1.0), layer_activation_bytes=(1.0, 1.0))


def test_snapshot_sorts_devices_and_permutes_links() -> None:
    devices = (
        Device(peer_id="b", flops=1.0, memory_bytes=1, is_reliable=True),
        Device(peer_id="a", flops=2.0, memory_bytes=1, is_reliable=False),
    )
    latency = np.array([[0.0, 0.5], [0.7, 0.0]])
    snapshot = SwarmSnapshot(
        devices=devices, links=LinkMatrix(latency_delay=latency, bandwidth=np.ones((2, 2))), model=_model()
    )
    assert [d.peer_id for d in snapshot.devices] == ["a", "b"]
    assert snapshot.links.latency_delay[0, 1] == 0.7
    assert snapshot.index_by_peer_id == {"a": 0, "b": 1}
    assert snapshot.reliable_indices() == [1]


@pytest.mark.parametrize("kwargs", [
    {"peer_id": "", "flops": 1.0, "memory_bytes": 1, "is_reliable": True},
    {"peer_id": "x", "flops": 0.0, "memory_bytes": 1, "is_reliable": True},
    {"peer_id": "x", "flops": float("nan"), "memory_bytes": 1, "is_reliable": True},
    {"peer_id": "x", "flops": 1.0, "memory_bytes": -1, "is_reliable": True},
])
def test_device_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Device(**kwargs)


def test_links_reject_bad_matrices() -> None:
    with pytest.raises(ValueError):
        LinkMatrix(latency_delay=np.zeros((2, 3)), bandwidth=np.ones((2, 3)))
    with pytest.raises(ValueError):
        LinkMatrix(latency_delay=np.zeros((2, 2)), bandwidth=np.zeros((2, 2)))
    with pytest.raises(ValueError):
        LinkMatrix(latency_delay=np.full((2, 2), -1.0), bandwidth=np.ones((2, 2)))


def test_snapshot_rejects_duplicates_and_size_mismatch() -> None:
    device = Device(peer_id="a", flops=1.0, memory_bytes=1, is_reliable=True)
    links = LinkMatrix(latency_delay=np.zeros((2, 2)), bandwidth=np.ones((2, 2)))
    with pytest.raises(ValueError):
        SwarmSnapshot(devices=(device, device), links=links, model=_model())
    with pytest.raises(ValueError):
        SwarmSnapshot(devices=(device,), links=links, model=_model())


def test_model_rejects_mismatched_layers() -> None:
    with pytest.raises(ValueError):
        ModelProfile(layer_flops=(1.0,), layer_param_bytes=(1.0, 2.0), layer_activation_bytes=(1.0,))
    with pytest.raises(ValueError):
        ModelProfile(layer_flops=(), layer_param_bytes=(), layer_activation_bytes=())


def test_plan_rejects_gaps_and_duplicates() -> None:
    with pytest.raises(ValueError):
        Plan(stages=(Stage(layer_start=1, layer_end=2, server_ids=("a",)),))
    with pytest.raises(ValueError):
        Plan(stages=(
            Stage(layer_start=0, layer_end=1, server_ids=("a",)),
            Stage(layer_start=1, layer_end=2, server_ids=("a",)),
        ))
    with pytest.raises(ValueError):
        Stage(layer_start=0, layer_end=1, server_ids=("a",), frontal_ids=("b",))
    with pytest.raises(ValueError):
        Stage(layer_start=0, layer_end=1, server_ids=())


def test_plan_check_fits_rejects_unreliable_server() -> None:
    devices = (Device(peer_id="a", flops=1.0, memory_bytes=1, is_reliable=False),)
    snapshot = SwarmSnapshot(
        devices=devices, links=LinkMatrix(latency_delay=np.zeros((1, 1)), bandwidth=np.ones((1, 1))), model=_model()
    )
    plan = Plan(stages=(Stage(layer_start=0, layer_end=2, server_ids=("a",)),))
    with pytest.raises(ValueError):
        plan.check_fits(snapshot)


def test_model_tables_are_the_layer_figures_summed() -> None:
    """The model's cached prefix sums and range tables are read by the layer split for every
    group: they must be exactly the sums of the layer figures, and read-only."""
    model = ModelProfile(
        layer_flops=(1.5, 2.0, 0.25, 7.0), layer_param_bytes=(3.0, 0.0, 5.0, 1.0),
        layer_activation_bytes=(8.0, 4.0, 2.0, 1.0),
    )
    flops, params, acts = model.prefix_sums
    starts, ends = model.layer_ranges
    assert list(zip(starts.tolist(), ends.tolist())) == [(a, b) for a in range(5) for b in range(a + 1, 5)]
    for a in range(5):
        for b in range(5):
            assert model.range_param_bytes[a, b] == (sum(model.layer_param_bytes[a:b]) if a < b else 0.0)
            if a < b:
                assert flops[b] - flops[a] == sum(model.layer_flops[a:b])
                assert acts[b] - acts[a] == sum(model.layer_activation_bytes[a:b])
    assert params[-1] == sum(model.layer_param_bytes)
    assert not any(table.flags.writeable for table in (flops, params, acts, starts, ends, model.range_param_bytes))
