"""replication.server: request fields are checked exactly (regressions found by tests/fuzz)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dht.wire import ProtocolError
from replication.server import ReplicationServer


async def _snapshot():
    return 3, {"w": torch.arange(4096, dtype=torch.float32)}


@pytest.mark.parametrize("stage", [1.0, True, "1", None, 2, [1]])
def test_only_the_integer_stage_is_served(stage):
    """``1.0 == 1`` and ``True == 1`` in Python: a manifest request for stage 1.0 used to be served."""
    server = ReplicationServer(None, run_id="demo", stage=1, snapshot_fn=_snapshot)
    with pytest.raises(ValueError, match="this peer serves stage 1"):
        asyncio.run(server._process_manifest({"stage": stage, "shard_bytes": 65536}))


def test_the_integer_stage_is_served():
    server = ReplicationServer(None, run_id="demo", stage=1, snapshot_fn=_snapshot)
    reply, _ = asyncio.run(server._process_manifest({"stage": 1, "shard_bytes": 65536}))
    assert reply["ok"] and reply["manifest"]["version"] == 3
    with pytest.raises(ProtocolError):
        asyncio.run(server._process_shard({"stage": 1, "version": 3, "shard_bytes": 65536, "index": -1}))
