"""State manifests: a stage's training state as hash-checked byte-range shards (seed 003 §III-A).

The state w of a stage (weights, optimizer state, step counters: name -> tensor) is laid out as
one buffer: tensors in name order, each flattened to its raw little-endian bytes, back to back.
Shard k is the byte range [k*s, min((k+1)*s, |w|)) of that buffer, so shards cut across tensor
boundaries and all but the last have exactly s bytes, as seed 003 §III-A assumes. A manifest
names the state (run_id, stage, version = optimizer step), lists the tensor table and holds one
BLAKE2b-256 digest per shard; a joiner checks every shard it receives against it.

A manifest arrives from the network, so ``Manifest.from_wire`` trusts nothing: every field is
type-checked, the layout must be canonical (names sorted and unique, offsets contiguous, sizes
equal to shape x itemsize), and ``ManifestLimits`` caps what a peer can make us allocate.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from replication.assignment import count_shards

__all__ = [
    "ALLOWED_DTYPES", "HASH_NAME", "Manifest", "ManifestError", "ManifestLimits", "TensorEntry",
    "MAX_PIECES", "build_manifest", "hash_shard", "is_shard_valid", "piece_size_for", "read_shard",
    "restore_state",
]

WIRE_FORMAT = 1
HASH_NAME = "blake2b-256"
HASH_BYTES = 32
MAX_PIECES = 1024  # digests per manifest at the chosen piece size: about 36 KB of msgpack

# dtype name -> (torch dtype, numpy dtype of the same bytes). numpy has no bfloat16, so its bits
# travel through int16; nothing here ever does arithmetic on them.
_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float64": (torch.float64, np.dtype("<f8")),
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<i2")),
    "int64": (torch.int64, np.dtype("<i8")),
    "int32": (torch.int32, np.dtype("<i4")),
    "int16": (torch.int16, np.dtype("<i2")),
    "int8": (torch.int8, np.dtype("i1")),
    "uint8": (torch.uint8, np.dtype("u1")),
    "bool": (torch.bool, np.dtype("?")),
}
ALLOWED_DTYPES = frozenset(_DTYPES)
_WIRE_KEYS = frozenset(
    {"format", "hash", "run_id", "stage", "version", "total_bytes", "shard_bytes", "tensors",
     "shard_hashes"}
)


class ManifestError(ValueError):
    """A manifest, or a shard checked against one, is malformed or inconsistent."""


@dataclass(frozen=True, kw_only=True)
class ManifestLimits:
    """Caps applied to a manifest received from the network; raise them for very large stages.

    Attributes:
        max_total_bytes: largest state accepted (bytes).
        max_num_tensors: most entries in the tensor table.
        max_num_shards: most shards (and so digests).
        max_name_length: longest tensor name or run id (characters).
        max_ndim: most dimensions of one tensor.
    """

    max_total_bytes: int = 256 * 1024**3
    max_num_tensors: int = 100_000
    max_num_shards: int = 1 << 20
    max_name_length: int = 1024
    max_ndim: int = 32

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


def _require_int(value: object, what: str, *, low: int = 0, high: int = 2**63 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(f"{what} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ManifestError(f"{what} must be in [{low}, {high}], got {value}")
    return value


def _require_str(value: object, what: str, *, max_length: int) -> str:
    if not isinstance(value, str) or not value:
        raise ManifestError(f"{what} must be a non-empty str, got {value!r:.80}")
    if len(value) > max_length:
        raise ManifestError(f"{what} is longer than {max_length} characters")
    return value


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the state: where its raw bytes lie in the state buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int
    size_bytes: int

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ManifestError(f"tensor {self.name!r}: dtype {self.dtype!r} is not allowed")
        if not isinstance(self.shape, tuple):
            raise ManifestError(f"tensor {self.name!r}: shape must be a tuple")
        for dim in self.shape:
            _require_int(dim, f"tensor {self.name!r} dimension")
        _require_int(self.offset_bytes, f"tensor {self.name!r} offset")
        expected = math.prod(self.shape) * _DTYPES[self.dtype][1].itemsize
        if _require_int(self.size_bytes, f"tensor {self.name!r} size") != expected:
            raise ManifestError(
                f"tensor {self.name!r}: size {self.size_bytes} != shape x itemsize {expected}"
            )


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A versioned, hashed description of one stage's state (seed 003 §III-A, the set K).

    Attributes:
        run_id: the training run.
        stage: the pipeline stage index.
        version: the optimizer step the state belongs to.
        tensors: the tensor table, sorted by name, offsets contiguous from 0.
        total_bytes: |w|, the size of the state buffer.
        shard_bytes: s, the size of every shard but the last.
        shard_hashes: BLAKE2b-256 digest of each shard, K = ceil(|w| / s) of them.
    """

    run_id: str
    stage: int
    version: int
    tensors: tuple[TensorEntry, ...]
    total_bytes: int
    shard_bytes: int
    shard_hashes: tuple[bytes, ...]

    def __post_init__(self) -> None:
        _require_str(self.run_id, "run_id", max_length=1 << 16)
        _require_int(self.stage, "stage")
        _require_int(self.version, "version")
        _require_int(self.shard_bytes, "shard_bytes", low=1)
        offset = 0
        for previous, entry in zip((None, *self.tensors), self.tensors):
            if previous is not None and not previous.name < entry.name:
                raise ManifestError(f"tensor names not sorted and unique at {entry.name!r}")
            if entry.offset_bytes != offset:
                raise ManifestError(f"tensor {entry.name!r}: offset is not {offset}")
            offset += entry.size_bytes
        if _require_int(self.total_bytes, "total_bytes") != offset:
            raise ManifestError(f"total_bytes {self.total_bytes} != sum of tensor sizes {offset}")
        if len(self.shard_hashes) != self.num_shards:
            raise ManifestError(f"{len(self.shard_hashes)} hashes for {self.num_shards} shards")
        for digest in self.shard_hashes:
            if not isinstance(digest, bytes) or len(digest) != HASH_BYTES:
                raise ManifestError(f"each shard hash must be {HASH_BYTES} bytes")

    @property
    def num_shards(self) -> int:
        """K, the number of shards."""
        return count_shards(self.total_bytes, self.shard_bytes)

    def shard_range(self, index: int) -> tuple[int, int]:
        """Returns the [start, end) byte range of shard ``index`` in the state buffer."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"shard index must be an int, got {type(index).__name__}")
        if not 0 <= index < self.num_shards:
            raise ManifestError(f"shard index {index} out of range 0..{self.num_shards - 1}")
        start = index * self.shard_bytes
        return start, min(start + self.shard_bytes, self.total_bytes)

    def to_wire(self) -> dict[str, Any]:
        """Returns a plain msgpack-able dict (see docs/replication.md for the format)."""
        return {
            "format": WIRE_FORMAT, "hash": HASH_NAME, "run_id": self.run_id, "stage": self.stage,
            "version": self.version, "total_bytes": self.total_bytes,
            "shard_bytes": self.shard_bytes,
            "tensors": [[t.name, t.dtype, list(t.shape), t.offset_bytes, t.size_bytes]
                        for t in self.tensors],
            "shard_hashes": list(self.shard_hashes),
        }

    @classmethod
    def from_wire(cls, wire: object, *, limits: ManifestLimits | None = None) -> Manifest:
        """Parses an untrusted dict from ``to_wire`` (after msgpack), checking everything.

        Raises:
            ManifestError: (a ValueError) naming the first problem found.
        """
        limits = limits or ManifestLimits()
        if not isinstance(wire, dict):
            raise ManifestError(f"manifest must be a dict, got {type(wire).__name__}")
        if set(wire) != _WIRE_KEYS:
            raise ManifestError(f"manifest keys differ from the format: {sorted(map(str, wire))}")
        if _require_int(wire["format"], "format") != WIRE_FORMAT or wire["hash"] != HASH_NAME:
            raise ManifestError(f"unsupported format {wire['format']!r} / hash {wire['hash']!r}")
        total_bytes = _require_int(wire["total_bytes"], "total_bytes")
        if total_bytes > limits.max_total_bytes:  # before anything is sized from it
            raise ManifestError(f"the manifest claims {total_bytes} bytes of state, more than the "
                                f"{limits.max_total_bytes} accepted")
        shard_bytes = _require_int(wire["shard_bytes"], "shard_bytes", low=1)
        num_shards = count_shards(total_bytes, shard_bytes)
        if num_shards > limits.max_num_shards:
            raise ManifestError(f"{num_shards} shards exceed the cap {limits.max_num_shards}")
        hashes, rows = wire["shard_hashes"], wire["tensors"]
        if not isinstance(hashes, list) or len(hashes) != num_shards:
            raise ManifestError(f"shard_hashes must be a list of {num_shards} digests")
        if not isinstance(rows, list):
            raise ManifestError("tensors must be a list")
        if len(rows) > limits.max_num_tensors:
            raise ManifestError(f"the manifest lists {len(rows)} tensors, more than the "
                                f"{limits.max_num_tensors} accepted")
        return cls(
            run_id=_require_str(wire["run_id"], "run_id", max_length=limits.max_name_length),
            stage=_require_int(wire["stage"], "stage"),
            version=_require_int(wire["version"], "version"),
            tensors=tuple(_parse_entry(row, limits) for row in rows),
            total_bytes=total_bytes,
            shard_bytes=shard_bytes,
            shard_hashes=tuple(hashes),
        )


def _parse_entry(row: object, limits: ManifestLimits) -> TensorEntry:
    if not isinstance(row, list) or len(row) != 5:
        raise ManifestError("each tensor entry must be [name, dtype, shape, offset, size]")
    name, dtype, shape, offset, size = row
    name = _require_str(name, "tensor name", max_length=limits.max_name_length)
    if not isinstance(dtype, str) or not isinstance(shape, list) or len(shape) > limits.max_ndim:
        raise ManifestError(f"tensor {name!r}: bad dtype or shape (at most {limits.max_ndim} dims)")
    for dim in shape:
        _require_int(dim, f"tensor {name!r} dimension", high=limits.max_total_bytes)
    return TensorEntry(name, dtype, tuple(shape), offset, size)


def piece_size_for(total_bytes: int, min_piece_bytes: int, *, max_pieces: int = MAX_PIECES) -> int:
    """The piece size p a state of ``total_bytes`` is hashed at: ``min_piece_bytes``, doubled until
    the state has at most ``max_pieces`` pieces (a manifest stays well under one message).

    Deterministic, so every donor of the same state describes it with the same manifest."""
    _require_int(total_bytes, "total_bytes")
    piece = _require_int(min_piece_bytes, "min_piece_bytes", low=1)
    while -(-total_bytes // piece) > max_pieces:
        piece *= 2
    return piece


def hash_shard(data: bytes | bytearray | memoryview) -> bytes:
    """Returns the BLAKE2b-256 digest of one shard."""
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def _require_little_endian() -> None:
    if sys.byteorder != "little":  # the wire layout is little-endian raw bytes
        raise RuntimeError("state replication supports little-endian hosts only")


def _to_numpy(name: str, value: torch.Tensor | np.ndarray) -> tuple[str, np.ndarray]:
    """Returns (dtype name, contiguous numpy view or copy) for one tensor of the state."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise ValueError(f"tensor {name!r}: only dense tensors can be replicated")
        tensor = value.detach().cpu().contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype == "bfloat16":
            tensor = tensor.view(torch.int16)
        array = tensor.numpy()
    elif isinstance(value, np.ndarray):
        array, dtype = value, value.dtype.name
    else:
        raise TypeError(f"tensor {name!r}: expected torch.Tensor or numpy array")
    if dtype not in _DTYPES:
        raise ValueError(f"tensor {name!r}: dtype {dtype} is not in {sorted(ALLOWED_DTYPES)}")
    # astype, not ascontiguousarray: the latter turns 0-d arrays into 1-d ones.
    return dtype, array.astype(_DTYPES[dtype][1], order="C", copy=False)


def build_manifest(
    state: Mapping[str, torch.Tensor | np.ndarray],
    *,
    run_id: str,
    stage: int,
    version: int,
    shard_bytes: int,
) -> tuple[Manifest, memoryview]:
    """Snapshots ``state`` into one buffer and describes it.

    The bytes are copied, so a donor can keep training and serve shards of this version from
    the returned buffer. Call it where the state is consistent (between optimizer steps); it
    costs one extra copy of the state in host memory for as long as the buffer is kept.

    Returns:
        The manifest and a read-only buffer of its ``total_bytes`` bytes.
    """
    _require_little_endian()
    _require_int(shard_bytes, "shard_bytes", low=1)
    arrays = [(name, *_to_numpy(name, state[name])) for name in sorted(state)]
    entries, offset = [], 0
    for name, dtype, array in arrays:
        entries.append(TensorEntry(name, dtype, tuple(array.shape), offset, array.nbytes))
        offset += array.nbytes
    buffer = bytearray(offset)
    flat = np.frombuffer(buffer, dtype=np.uint8)
    for entry, (_, _, array) in zip(entries, arrays):
        end = entry.offset_bytes + entry.size_bytes
        flat[entry.offset_bytes : end] = array.reshape(-1).view(np.uint8)
    data = memoryview(buffer).toreadonly()
    hashes = tuple(
        hash_shard(data[start : start + shard_bytes]) for start in range(0, offset, shard_bytes)
    )
    manifest = Manifest(run_id=run_id, stage=stage, version=version, tensors=tuple(entries),
                        total_bytes=offset, shard_bytes=shard_bytes, shard_hashes=hashes)
    return manifest, data


def read_shard(manifest: Manifest, data: bytes | bytearray | memoryview, index: int) -> bytes:
    """Returns a copy of shard ``index`` of a state buffer described by ``manifest``."""
    if len(data) != manifest.total_bytes:
        raise ManifestError(f"buffer holds {len(data)} bytes, manifest {manifest.total_bytes}")
    start, end = manifest.shard_range(index)
    return bytes(data[start:end])


def is_shard_valid(manifest: Manifest, index: int, shard: bytes | bytearray | memoryview) -> bool:
    """Whether ``shard`` is exactly shard ``index`` of ``manifest`` (length and digest)."""
    start, end = manifest.shard_range(index)
    return len(shard) == end - start and hash_shard(shard) == manifest.shard_hashes[index]


def restore_state(
    manifest: Manifest, data: bytes | bytearray | memoryview, *, verify: bool = True, share: bool = False
) -> dict[str, torch.Tensor]:
    """Rebuilds the state dict (CPU tensors, bit-identical) from a complete state buffer.

    Args:
        manifest: describes ``data``.
        data: the full buffer (e.g. from ``ShardStore.assemble``).
        verify: re-check every shard digest first; skip only if the caller just did.
        share: let the tensors use ``data``'s memory instead of a copy (``data`` must be a
            writable buffer the caller hands over; tensors not aligned to their item size are
            still copied).

    Raises:
        ManifestError: wrong length, a digest mismatch, or a bool tensor with bytes not 0/1.
    """
    _require_little_endian()
    if len(data) != manifest.total_bytes:
        raise ManifestError(f"buffer holds {len(data)} bytes, manifest {manifest.total_bytes}")
    view = memoryview(data)
    if verify:
        for index in range(manifest.num_shards):
            if not is_shard_valid(manifest, index, view[slice(*manifest.shard_range(index))]):
                raise ManifestError(f"shard {index} does not match its digest")
    share = share and not view.readonly
    return {entry.name: _restore_tensor(entry, view, share=share) for entry in manifest.tensors}


def _restore_tensor(entry: TensorEntry, view: memoryview, *, share: bool) -> torch.Tensor:
    torch_dtype, numpy_dtype = _DTYPES[entry.dtype]
    raw = view[entry.offset_bytes : entry.offset_bytes + entry.size_bytes]
    array = np.frombuffer(raw, dtype=numpy_dtype).reshape(entry.shape)
    if not (share and array.flags.aligned and array.flags.writeable):
        array = array.copy()
    if entry.dtype == "bool" and np.any(array.view(np.uint8) > 1):
        raise ManifestError(f"tensor {entry.name!r}: bool bytes other than 0 and 1")
    tensor = torch.from_numpy(array)
    return tensor.view(torch_dtype) if entry.dtype == "bfloat16" else tensor
