"""Stage checkpoints on disk, so that a whole swarm can stop and resume (DESIGN §1 step 9).

One safetensors file per run and stage, ``<dir>/<run_id>-stage<k>.safetensors``, holding what a
joiner would download (``Stage.state_tensors``: parameters, AdamW state, step counters, the stage's
identity). It is written to a temporary file in the same folder, flushed to disk and renamed over
the old one, so a crash mid-write leaves the previous checkpoint whole. The header records the run,
the stage, the optimizer step and a digest of the model and its stage layout; a checkpoint of
another run, stage or model is refused with a sentence saying so, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dht.records import RunSpec

__all__ = ["CheckpointError", "checkpoint_path", "load_checkpoint", "save_checkpoint", "spec_digest"]

FORMAT = "murmuration-stage-checkpoint/1"


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


def save_checkpoint(path: Path, state: dict[str, torch.Tensor], *, spec: RunSpec, stage: int, version: int) -> None:
    """Writes ``state`` to ``path`` atomically (temporary file, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": FORMAT, "run_id": spec.run_id, "stage": str(stage), "version": str(version),
                "spec_digest": spec_digest(spec)}
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({name: tensor.contiguous() for name, tensor in state.items()}, temp_name, metadata=metadata)
        with open(temp_name, "rb") as file:
            os.fsync(file.fileno())
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def load_checkpoint(path: Path, *, spec: RunSpec, stage: int) -> tuple[int, dict[str, torch.Tensor]]:
    """The (version, state) of the checkpoint at ``path``, checked to be of this run, stage and model.

    Raises:
        FileNotFoundError: there is none.
        CheckpointError: it is unreadable or of something else.
    """
    try:
        with open(path, "rb") as file:
            header_size = int.from_bytes(file.read(8), "little")
            if not 0 < header_size <= 100 * 2**20:
                raise CheckpointError(f"{path} is not a safetensors file")
            header = json.loads(file.read(header_size))
        metadata = header.get("__metadata__") or {}
        state = load_file(path)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"cannot read the checkpoint {path}: {e}; delete it or point --checkpoint-dir elsewhere") from e
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
    return version, state
