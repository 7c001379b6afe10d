"""State manifests: bit-identical round trips, shard checks, strict parsing of untrusted input."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replication.manifest import (
    Manifest,
    ManifestError,
    ManifestLimits,
    build_manifest,
    hash_shard,
    is_shard_valid,
    read_shard,
    restore_state,
)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The exact bits of a tensor (bfloat16 through int16, since numpy lacks it)."""
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


def sample_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 7, generator=generator)
    weight[0, 0], weight[0, 1] = float("nan"), -0.0
    return {
        "layer.weight": weight.t(),  # non-contiguous on purpose
        "layer.bias": torch.randn(7, generator=generator).half(),
        "optim.exp_avg": torch.randn(3, 3, generator=generator).bfloat16(),
        "optim.step": torch.tensor(12345678901, dtype=torch.int64),  # 0-d
        "scalar_bf16": torch.tensor(-2.5, dtype=torch.bfloat16),  # 0-d bfloat16
        "empty": torch.empty(0, 4, dtype=torch.float32),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(5, dtype=torch.int32),
    }


def assert_bit_identical(restored: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    assert sorted(restored) == sorted(state)
    for name, tensor in state.items():
        assert restored[name].dtype == tensor.dtype, name
        assert restored[name].shape == tensor.shape, name
        assert raw_bytes(restored[name]) == raw_bytes(tensor), name


@pytest.mark.parametrize("shard_bytes", [1, 3, 64, 10_000])
def test_round_trip_is_bit_identical(shard_bytes: int) -> None:
    state = sample_state()
    manifest, data = build_manifest(state, run_id="run", stage=2, version=40,
                                    shard_bytes=shard_bytes)
    wire = msgpack.unpackb(msgpack.packb(manifest.to_wire()))
    assert Manifest.from_wire(wire) == manifest
    shards = [read_shard(manifest, data, i) for i in range(manifest.num_shards)]
    assert all(is_shard_valid(manifest, i, shard) for i, shard in enumerate(shards))
    assert b"".join(shards) == bytes(data)
    assert_bit_identical(restore_state(manifest, b"".join(shards)), state)
    assert [t.name for t in manifest.tensors] == sorted(state)


@settings(max_examples=60, deadline=None)
@given(
    arrays=st.dictionaries(
        st.text(alphabet="abcxyz._", min_size=1, max_size=6),
        st.tuples(st.sampled_from(["float32", "float16", "bfloat16", "int64", "uint8"]),
                  st.lists(st.integers(0, 4), max_size=3), st.integers(0, 2**32 - 1)),
        max_size=5,
    ),
    shard_bytes=st.integers(1, 50),
)
def test_round_trip_random_states(
    arrays: dict[str, tuple[str, list[int], int]], shard_bytes: int
) -> None:
    state = {}
    for name, (dtype, shape, seed) in arrays.items():
        num_elements = int(np.prod(shape))
        bits = np.random.default_rng(seed).integers(0, 256, size=num_elements * 8 + 8,
                                                    dtype=np.uint8)  # random bits: NaNs too
        tensor = torch.from_numpy(bits).view(getattr(torch, dtype))[:num_elements]
        state[name] = tensor.reshape(shape)
    manifest, data = build_manifest(state, run_id="r", stage=0, version=1, shard_bytes=shard_bytes)
    assert manifest.num_shards == -(-manifest.total_bytes // shard_bytes)
    assert_bit_identical(restore_state(manifest, data), state)


def test_snapshot_is_a_copy() -> None:
    state = {"w": torch.zeros(4)}
    manifest, data = build_manifest(state, run_id="r", stage=0, version=1, shard_bytes=8)
    state["w"].add_(1.0)  # the donor keeps training
    assert bytes(data) == bytes(16)
    assert is_shard_valid(manifest, 0, read_shard(manifest, data, 0))
    with pytest.raises(TypeError):
        data[0] = 1  # type: ignore[index]  # read-only


def test_flipped_byte_is_caught() -> None:
    manifest, data = build_manifest(sample_state(), run_id="r", stage=0, version=1, shard_bytes=16)
    for index in range(manifest.num_shards):
        shard = bytearray(read_shard(manifest, data, index))
        shard[len(shard) // 2] ^= 0x01
        assert not is_shard_valid(manifest, index, shard)
        assert not is_shard_valid(manifest, index, bytes(shard[:-1]))
    corrupted = bytearray(data)
    corrupted[5] ^= 0x80
    with pytest.raises(ManifestError, match="digest"):
        restore_state(manifest, corrupted)
    with pytest.raises(ManifestError, match="bytes"):
        restore_state(manifest, bytes(data)[:-1])
    with pytest.raises(ManifestError, match="out of range"):
        read_shard(manifest, data, manifest.num_shards)


def test_bool_bytes_other_than_0_1_rejected() -> None:
    manifest, data = build_manifest({"m": torch.tensor([True])}, run_id="r", stage=0,
                                    version=1, shard_bytes=4)
    forged = Manifest(**{**vars(manifest), "shard_hashes": (hash_shard(b"\x02"),)})
    with pytest.raises(ManifestError, match="bool"):
        restore_state(forged, b"\x02")


def test_build_rejects_unsupported_input() -> None:
    with pytest.raises(ValueError, match="dtype"):
        build_manifest({"c": torch.zeros(2, dtype=torch.complex64)}, run_id="r", stage=0,
                       version=1, shard_bytes=4)
    with pytest.raises(TypeError):
        build_manifest({"x": [1.0]}, run_id="r", stage=0, version=1,  # type: ignore[dict-item]
                       shard_bytes=4)
    with pytest.raises(ValueError, match="shard_bytes"):
        build_manifest({"x": torch.zeros(2)}, run_id="r", stage=0, version=1, shard_bytes=0)


def test_empty_state() -> None:
    manifest, data = build_manifest({}, run_id="r", stage=0, version=0, shard_bytes=4)
    assert manifest.num_shards == 0 and len(data) == 0
    assert Manifest.from_wire(manifest.to_wire()) == manifest
    assert restore_state(manifest, b"") == {}


def good_wire() -> dict[str, Any]:
    state = {"a": torch.zeros(3), "b": torch.ones(2, 2, dtype=torch.float16)}
    manifest, _ = build_manifest(state, run_id="run", stage=1, version=9, shard_bytes=8)
    return msgpack.unpackb(msgpack.packb(manifest.to_wire()))


def _set(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    return lambda wire: wire.__setitem__(key, value)


def _set_entry(index: int, value: object) -> Callable[[dict[str, Any]], None]:
    return lambda wire: wire["tensors"][0].__setitem__(index, value)


MALFORMED: dict[str, Callable[[dict[str, Any]], None]] = {
    "extra key": _set("evil", 1),
    "missing key": lambda wire: wire.pop("version"),
    "format": _set("format", 2),
    "format bool": _set("format", True),
    "hash name": _set("hash", "md5"),
    "run_id type": _set("run_id", 5),
    "run_id empty": _set("run_id", ""),
    "run_id too long": _set("run_id", "x" * 5000),
    "stage negative": _set("stage", -1),
    "stage bool": _set("stage", True),
    "version float": _set("version", 1.5),
    "version huge": _set("version", 2**64),
    "total too big": _set("total_bytes", 2**50),
    "total mismatch": _set("total_bytes", 24),
    "shard_bytes zero": _set("shard_bytes", 0),
    "shard_bytes str": _set("shard_bytes", "8"),
    "too many shards": _set("shard_bytes", 1),
    "hashes not list": _set("shard_hashes", b"x" * 32),
    "hash count": lambda wire: wire["shard_hashes"].pop(),
    "hash length": lambda wire: wire["shard_hashes"].__setitem__(0, b"short"),
    "hash type": lambda wire: wire["shard_hashes"].__setitem__(0, "x" * 32),
    "tensors not list": _set("tensors", {}),
    "entry not list": lambda wire: wire["tensors"].__setitem__(0, "a"),
    "entry length": lambda wire: wire["tensors"][0].pop(),
    "name type": _set_entry(0, 7),
    "dtype not allowed": _set_entry(1, "object"),
    "dtype type": _set_entry(1, 4),
    "shape not list": _set_entry(2, 3),
    "shape negative": _set_entry(2, [-3]),
    "shape float": _set_entry(2, [3.0]),
    "too many dims": _set_entry(2, [1] * 40),
    "offset wrong": _set_entry(3, 4),
    "offset negative": _set_entry(3, -1),
    "size mismatch": _set_entry(4, 16),
    "names unsorted": lambda wire: wire["tensors"][1].__setitem__(0, "0"),
    "names duplicate": lambda wire: wire["tensors"][1].__setitem__(0, "a"),
    "too many tensors": lambda wire: wire.__setitem__("tensors", [wire["tensors"][0]] * 11),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_from_wire_rejects_malformed(case: str) -> None:
    wire = good_wire()
    Manifest.from_wire(copy.deepcopy(wire))  # the unmodified one parses
    MALFORMED[case](wire)
    limits = ManifestLimits(max_total_bytes=2**40, max_num_tensors=10, max_num_shards=10)
    with pytest.raises(ValueError) as info:
        Manifest.from_wire(wire, limits=limits)
    assert str(info.value)  # a reason is given


@pytest.mark.parametrize("wire", [None, [], "manifest", b"\x00", 3])
def test_from_wire_rejects_non_dicts(wire: object) -> None:
    with pytest.raises(ManifestError, match="dict"):
        Manifest.from_wire(wire)


def test_manifest_limits_validate() -> None:
    with pytest.raises(ValueError):
        ManifestLimits(max_ndim=0)
