"""Stage checkpoints on disk, so that a whole swarm can stop and resume (DESIGN §1 step 9).

One safetensors file (written here in chunks, read back by the safetensors library, which checks
it) per run and stage, ``<dir>/<run_id>-stage<k>.safetensors``, holding what a
joiner would download (``Stage.state_tensors``: parameters, AdamW state, step counters, the stage's
identity). It is written to a temporary file in the same folder, flushed to disk and renamed over
the old one, so a crash mid-write leaves the previous checkpoint whole. The header records the run,
the stage, the optimizer step and a digest of the model and its stage layout; a checkpoint of
another run, stage or model is refused with a sentence saying so, never loaded. Its tensor table
(names, dtypes, shapes) must be exactly the one the run spec implies for the stage
(``swarm.stage_state.state_template``), checked from the header before any tensor is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dht.records import RunSpec
from replication.layout import StateLayout
from swarm.stage_state import state_template

__all__ = ["CheckpointError", "WriteProgress", "checkpoint_path", "checkpoint_spec", "load_checkpoint", "save_checkpoint",
           "spec_digest"]

FORMAT = "murmuration-stage-checkpoint/1"
WRITE_CHUNK_BYTES = 4 * 2**20
# torch dtype -> safetensors dtype name (https://github.com/huggingface/safetensors, "Format")
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in _SAFETENSORS_DTYPES.items()}


class WriteProgress:
    """How far a checkpoint write got (the terminal view's progress bar); updated from the writing
    thread, read from the event loop."""

    def __init__(self) -> None:
        self.total_bytes = 0
        self.done_bytes = 0
        self.started_at = time.time()
        self.finished = False

    def as_dict(self, now: float | None = None) -> dict[str, Any]:
        """``{"done_bytes", "total_bytes", "started_at", "eta_s", "finished"}``; eta_s None until bytes are written."""
        now = time.time() if now is None else now
        done, elapsed = self.done_bytes, now - self.started_at
        eta = (self.total_bytes - done) * elapsed / done if done > 0 and elapsed > 0 else None
        return {"done_bytes": done, "total_bytes": self.total_bytes, "started_at": round(self.started_at, 3),
                "eta_s": round(eta, 1) if eta is not None else None, "finished": self.finished}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used here; the message says why and what to do."""


def spec_digest(spec: RunSpec) -> str:
    """What must match for a checkpoint to fit: the model, its cut into stages and the optimizer
    (what the state's tensors mean), as a SHA-256. The learning rate, batch sizes and the averaging
    period may change between a stop and a resume."""
    wire = spec.to_wire()
    layout = {key: wire[key] for key in ("model", "stage_layers", "optimizer")}
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()


def checkpoint_path(directory: str | os.PathLike[str], run_id: str, stage: int) -> Path:
    return Path(directory) / f"{run_id}-stage{stage}.safetensors"


def newest_checkpoint_layout(directory: str | os.PathLike[str], base: RunSpec) -> RunSpec:
    """The spec under the newest re-planned layout (``peer.relayout``) this folder holds checkpoints
    of, or ``base`` if none: a whole swarm that stopped after a re-plan resumes under that layout,
    not from the older checkpoints of the published one. Unreadable or foreign files are skipped."""
    best = base
    for path in sorted(Path(directory).glob(f"{base.run_id}@L*-stage*.safetensors")):
        try:
            metadata = _read_metadata(path)
            spec = base.with_layout(int(metadata["layout_version"]),
                                    tuple(tuple(r) for r in json.loads(metadata["stage_layers"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if metadata.get("run_id") == base.run_id and spec.layout_version > best.layout_version:
            best = spec
    return best


def save_checkpoint(path: Path, state: dict[str, torch.Tensor], *, spec: RunSpec, stage: int, version: int,
                    progress: WriteProgress | None = None) -> None:
    """Writes ``state`` to ``path`` atomically (temporary file, fsync, rename), in the safetensors
    format, ``WRITE_CHUNK_BYTES`` at a time so that ``progress`` can follow it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": FORMAT, "run_id": spec.run_id, "stage": str(stage), "version": str(version),
                "spec_digest": spec_digest(spec), "layout_version": str(spec.layout_version),
                "stage_layers": json.dumps([list(r) for r in spec.stage_layers]),
                "spec": json.dumps(spec.to_wire(), sort_keys=True)}  # what peer.export needs to name the model
    header, tensors = _safetensors_header(state, metadata)
    progress = progress or WriteProgress()
    progress.total_bytes = len(header) + sum(t.numel() * t.element_size() for t in tensors)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(header)
            progress.done_bytes = len(header)
            for tensor in tensors:
                data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else b""
                for start in range(0, len(data), WRITE_CHUNK_BYTES):
                    chunk = data[start : start + WRITE_CHUNK_BYTES]
                    file.write(chunk)
                    progress.done_bytes += len(chunk)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_name, path)
        progress.finished = True
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def _safetensors_header(state: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, list[torch.Tensor]]:
    """The 8-byte length and JSON header of a safetensors file, and the tensors in file order."""
    entries: dict[str, Any] = {"__metadata__": metadata}
    tensors, offset = [], 0
    for name in sorted(state):
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"checkpoint entry {name!r} is not a tensor of a supported dtype")
        tensor = tensor.detach().cpu().contiguous()
        size = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + size]}
        tensors.append(tensor)
        offset += size
    encoded = json.dumps(entries, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return len(encoded).to_bytes(8, "little") + encoded, tensors


def _read_header(path: Path) -> dict[str, Any]:
    """The JSON header of the safetensors file at ``path``: its tensor table and ``__metadata__``.

    Raises:
        OSError: it cannot be read. ValueError: it is not a safetensors file (CheckpointError).
    """
    with open(path, "rb") as file:
        header_size = int.from_bytes(file.read(8), "little")
        if not 0 < header_size <= 100 * 2**20:
            raise CheckpointError(f"{path} is not a safetensors file")
        header = json.loads(file.read(header_size))
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file")
    return header


def _read_metadata(path: Path) -> dict[str, Any]:
    """The ``__metadata__`` of the safetensors file at ``path`` (empty if it has none).

    Raises:
        OSError: it cannot be read. ValueError: it is not a safetensors file (CheckpointError).
    """
    return _metadata_of(_read_header(path))


def _metadata_of(header: dict[str, Any]) -> dict[str, Any]:
    metadata = header.get("__metadata__")
    return metadata if isinstance(metadata, dict) else {}


def _tensor_table(header: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype name, shape) of every tensor a safetensors header lists, as written by this module."""
    table = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = (entry.get("dtype"), entry.get("shape")) if isinstance(entry, dict) else (None, None)
        if not isinstance(dtype, str) or dtype not in _DTYPE_NAMES or not isinstance(shape, list):
            raise ValueError(f"its entry {name!r} has no valid dtype and shape")
        table.append((name, _DTYPE_NAMES[dtype], tuple(shape)))
    return table


def load_checkpoint(path: Path, *, spec: RunSpec, stage: int) -> tuple[int, dict[str, torch.Tensor]]:
    """The (version, state) of the checkpoint at ``path``, checked to be of this run, stage and model,
    and its tensor table to be the one ``spec`` implies for ``stage``, before any tensor is read.

    Raises:
        FileNotFoundError: there is none.
        CheckpointError: it is unreadable or of something else.
    """
    try:
        header = _read_header(path)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise _unreadable(path, e) from e
    metadata = _metadata_of(header)
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a Murmuration stage checkpoint; point --checkpoint-dir elsewhere")
    if metadata.get("run_id") != spec.run_id or metadata.get("stage") != str(stage):
        raise CheckpointError(f"{path} holds stage {metadata.get('stage')} of run {metadata.get('run_id')!r}, "
                              f"not stage {stage} of {spec.run_id!r}; point --checkpoint-dir elsewhere")
    if metadata.get("spec_digest") != spec_digest(spec):
        raise CheckpointError(f"{path} was written for another model or layout of run {spec.run_id!r}; "
                              "delete it or point --checkpoint-dir elsewhere")
    try:
        version = int(metadata.get("version", ""))
    except ValueError as e:
        raise CheckpointError(f"{path} has no valid version in its header") from e
    try:
        mismatch = StateLayout.from_tensors(state_template(spec, stage)).mismatch(_tensor_table(header))
        if mismatch is not None:  # refused from the header: nothing is allocated for its tensors
            raise CheckpointError(f"it is not the state the run spec implies for stage {stage}: {mismatch}")
        state = load_file(path)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, SafetensorError) as e:
        raise _unreadable(path, e) from e
    return version, state


def checkpoint_spec(path: Path) -> RunSpec:
    """The run spec the checkpoint at ``path`` was written under (its header's; nothing else is read).

    Raises:
        FileNotFoundError: there is none.
        CheckpointError: it is unreadable, of something else, or older than checkpoints that carry their spec.
    """
    try:
        metadata = _metadata_of(_read_header(path))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise _unreadable(path, e) from e
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a Murmuration stage checkpoint")
    if "spec" not in metadata:
        raise CheckpointError(f"{path} was written before checkpoints carried their run spec; let the swarm "
                              "write a new one (--checkpoint-period) and export that")
    try:
        return RunSpec.from_wire(json.loads(metadata["spec"]))
    except ValueError as e:
        raise CheckpointError(f"{path} carries an unusable run spec: {e}") from e


def _unreadable(path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(f"cannot read the checkpoint {path}: {error}; delete it or point --checkpoint-dir elsewhere")
