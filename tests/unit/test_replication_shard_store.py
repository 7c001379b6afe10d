"""Resumable on-disk shard store: verified writes, re-verification on open, assembly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replication.manifest import Manifest, ManifestError, build_manifest, read_shard, restore_state
from replication.shard_store import MANIFEST_FILE, ShardStore


def make_state(version: int) -> tuple[Manifest, memoryview, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(version)
    state = {
        "w": torch.randn(10, 10, generator=generator),
        "b": torch.randn(10, generator=generator).bfloat16(),
        "step": torch.tensor(version),
    }
    manifest, data = build_manifest(state, run_id="run", stage=1, version=version, shard_bytes=64)
    return manifest, data, state


def test_resume_after_reopen(tmp_path: Path) -> None:
    manifest, data, _ = make_state(1)
    store = ShardStore.open(tmp_path / "join", manifest)
    assert store.held_shards() == frozenset()
    assert store.missing_shards() == list(range(manifest.num_shards))
    for index in (0, 2, 5):
        store.put_shard(index, read_shard(manifest, data, index))
    reopened = ShardStore.open(tmp_path / "join", manifest)
    assert reopened.held_shards() == {0, 2, 5}
    resumed = ShardStore.open_existing(tmp_path / "join")
    assert resumed is not None and resumed.manifest == manifest
    assert resumed.held_shards() == {0, 2, 5}
    assert not resumed.is_complete()


def test_corrupt_file_on_disk_is_dropped(tmp_path: Path) -> None:
    manifest, data, _ = make_state(1)
    store = ShardStore.open(tmp_path, manifest)
    for index in (0, 1, 2):
        store.put_shard(index, read_shard(manifest, data, index))
    shard_file = tmp_path / "shard-00000001.bin"
    raw = bytearray(shard_file.read_bytes())
    raw[3] ^= 0x10
    shard_file.write_bytes(raw)
    (tmp_path / "shard-00000002.bin").write_bytes(b"short")  # a torn write
    (tmp_path / "shard-99999999.bin").write_bytes(b"x")  # no such shard
    (tmp_path / ".tmp-abc").write_bytes(b"leftover of a crash")
    reopened = ShardStore.open(tmp_path, manifest)
    assert reopened.held_shards() == {0}
    assert not shard_file.exists()
    assert not (tmp_path / "shard-99999999.bin").exists()
    assert not (tmp_path / ".tmp-abc").exists()


def test_put_rejects_bad_shard(tmp_path: Path) -> None:
    manifest, data, _ = make_state(1)
    store = ShardStore.open(tmp_path, manifest)
    shard = bytearray(read_shard(manifest, data, 3))
    shard[0] ^= 1
    with pytest.raises(ManifestError):
        store.put_shard(3, shard)
    with pytest.raises(ManifestError):
        store.put_shard(4, read_shard(manifest, data, 3))  # right bytes, wrong place
    with pytest.raises(ManifestError, match="out of range"):
        store.put_shard(manifest.num_shards, b"")
    assert store.held_shards() == frozenset()
    assert not (tmp_path / "shard-00000003.bin").exists()


def test_foreign_manifest_keeps_only_matching_shards(tmp_path: Path) -> None:
    old_manifest, old_data, _ = make_state(1)
    store = ShardStore.open(tmp_path, old_manifest)
    for index in range(old_manifest.num_shards):
        store.put_shard(index, read_shard(old_manifest, old_data, index))
    new_manifest, new_data, _ = make_state(2)
    same = {i for i in range(new_manifest.num_shards)
            if read_shard(new_manifest, new_data, i) == read_shard(old_manifest, old_data, i)}
    reopened = ShardStore.open(tmp_path, new_manifest)
    assert reopened.held_shards() == same
    assert len(same) < new_manifest.num_shards  # the versions really differ
    assert ShardStore.open_existing(tmp_path).manifest == new_manifest  # type: ignore[union-attr]


def test_assemble_and_restore(tmp_path: Path) -> None:
    manifest, data, state = make_state(3)
    store = ShardStore.open(tmp_path, manifest)
    with pytest.raises(ManifestError, match="missing"):
        store.assemble()
    for index in reversed(range(manifest.num_shards)):
        store.put_shard(index, read_shard(manifest, data, index))
    assert store.is_complete()
    buffer = store.assemble()
    assert bytes(buffer) == bytes(data)
    restored = restore_state(manifest, buffer)
    assert all(torch.equal(restored[name], tensor) for name, tensor in state.items())
    store.remove()
    assert not (tmp_path / MANIFEST_FILE).exists()
    assert ShardStore.open_existing(tmp_path) is None


def test_assemble_catches_shard_changed_after_write(tmp_path: Path) -> None:
    manifest, data, _ = make_state(4)
    store = ShardStore.open(tmp_path, manifest)
    for index in range(manifest.num_shards):
        store.put_shard(index, read_shard(manifest, data, index))
    target = tmp_path / "shard-00000002.bin"
    raw = bytearray(target.read_bytes())
    raw[-1] ^= 0xFF
    target.write_bytes(raw)
    with pytest.raises(ManifestError, match="shard 2"):
        store.assemble()
    assert store.missing_shards() == [2]


def test_open_existing_ignores_garbage_manifest(tmp_path: Path) -> None:
    assert ShardStore.open_existing(tmp_path / "absent") is None
    (tmp_path / MANIFEST_FILE).write_bytes(b"\xc1 not msgpack")
    assert ShardStore.open_existing(tmp_path) is None
    (tmp_path / MANIFEST_FILE).write_bytes(b"\x93\x01\x02\x03")  # valid msgpack, not a manifest
    assert ShardStore.open_existing(tmp_path) is None
