"""A run's tokenizer file travels over real hivemind P2P: served in chunks, checked by hash, and a
peer that serves another file is skipped for one that serves the right one."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterator

import pytest

from dht.rpc import RemoteError, call_peer
from replication.run_files import FILE_CHUNK_BYTES, RunFileError, RunFileServer, fetch_run_file, file_handler
from tests.conftest import open_dht_nodes

RUN = "filetest"
pytestmark = pytest.mark.timeout(60)
BLOB = bytes(range(256)) * (FILE_CHUNK_BYTES // 100)  # 2.56 chunks
FILE_ID = "bpe:" + hashlib.sha256(BLOB).hexdigest()


def right(blob: bytes) -> bool:
    return "bpe:" + hashlib.sha256(blob).hexdigest() == FILE_ID


@pytest.fixture
def nodes() -> Iterator[list]:
    with open_dht_nodes(3) as nodes:
        yield nodes


def test_a_joiner_skips_a_peer_serving_another_file_and_takes_a_checked_copy(nodes, caplog):
    (joiner, _), (liar, _), (honest, _) = nodes
    liar_id, honest_id = liar.peer_id.to_base58(), honest.peer_id.to_base58()

    async def main():
        p2p = await joiner.replicate_p2p()
        servers = [RunFileServer(await liar.replicate_p2p(), RUN, {FILE_ID: BLOB[:-1] + b"x"}),
                   RunFileServer(await honest.replicate_p2p(), RUN, {FILE_ID: BLOB})]
        for server in servers:
            await server.start()
        try:
            with caplog.at_level(logging.WARNING, logger="replication.run_files"):
                blob = await fetch_run_file(p2p, RUN, FILE_ID, [liar_id, honest_id], verify=right)
            assert blob == BLOB
            assert servers[1].num_chunks_served == 3 and servers[0].num_chunks_served == 3
            assert "are not the run's" in caplog.text
            with pytest.raises(RunFileError, match="another file"):
                await fetch_run_file(p2p, RUN, FILE_ID, [liar_id], verify=right)
            with pytest.raises(RunFileError, match="does not hold"):
                await fetch_run_file(p2p, RUN, "bpe:" + "0" * 64, [honest_id], verify=lambda b: True)
            with pytest.raises(RemoteError, match="offset"):  # a bad request is refused; the server goes on
                await call_peer(p2p, honest_id, file_handler(RUN), {"id": FILE_ID, "offset": len(BLOB) + 1},
                                timeout=10, max_payload_bytes=FILE_CHUNK_BYTES + 8)
            assert await fetch_run_file(p2p, RUN, FILE_ID, [honest_id], verify=right) == BLOB
        finally:
            for server in servers:
                await server.shutdown()

    asyncio.run(main())
