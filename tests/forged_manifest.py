"""Manifests a lying donor sends: well-formed (they parse under the default caps), of a layout the
run spec does not imply. Shared by tests/unit/test_state_layout.py and tests/integration/test_bounded_transfer.py."""

from __future__ import annotations

import math

from replication.layout import ExpectedTensor, StateLayout
from replication.manifest import HASH_BYTES, HASH_NAME, WIRE_FORMAT, piece_size_for

HUGE_BYTES = 200 * 2**30


def forged_wire(tensors: list[ExpectedTensor], *, run_id: str, stage: int, min_piece_bytes: int,
                version: int = 99) -> dict:
    """A well-formed manifest of ``tensors`` with made-up digests, hashed at the piece size an honest
    donor would use (``piece_size_for``): for 200 GiB it is 1024 digests, about 36 KB of msgpack."""
    total, rows = 0, []
    for t in sorted(tensors, key=lambda t: t.name):
        rows.append([t.name, t.dtype, list(t.shape), total, t.size_bytes])
        total += t.size_bytes
    piece = piece_size_for(total, min_piece_bytes)
    return {"format": WIRE_FORMAT, "hash": HASH_NAME, "run_id": run_id, "stage": stage, "version": version,
            "total_bytes": total, "shard_bytes": piece, "tensors": rows,
            "shard_hashes": [bytes(HASH_BYTES)] * math.ceil(total / piece)}


def grown(layout: StateLayout, total_bytes: int = HUGE_BYTES) -> list[ExpectedTensor]:
    """``layout`` with its first tensor replaced by a uint8 one, so that the state claims ``total_bytes``."""
    first, *rest = layout.tensors
    return [ExpectedTensor(first.name, "uint8", (total_bytes - sum(t.size_bytes for t in rest),)), *rest]
