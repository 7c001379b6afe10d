"""A run's files, named by their hash: the BPE ``tokenizer.json`` its spec pins.

The bootstrap serves the file it published the run with, and so does every peer once it holds it,
so joiners spread over the swarm rather than all asking the bootstrap. A joiner asks one peer after
another for the file in ``FILE_CHUNK_BYTES`` pieces and keeps the first whole copy whose hash is the
run spec's; a peer that sent another file is logged and skipped. Nothing comes from outside the
swarm. The file is as public as the run spec that names it, so anyone may ask; an answer is at most
one chunk, and a caller reads at most ``MAX_RUN_FILE_BYTES``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from hivemind.p2p import P2P

from dht.rpc import Declined, PeerUnavailableError, RemoteError, call_peer, serve_request
from dht.wire import ProtocolError
from replication.server import pack_bytes, require_int, unpack_bytes

logger = logging.getLogger(__name__)

FILE_CHUNK_BYTES = 1 << 20
MAX_RUN_FILE_BYTES = 64 << 20
FILE_REQUEST_TIMEOUT = 30.0
MAX_FILE_ID_CHARS = 80


class RunFileError(RuntimeError):
    """No peer asked served the file whole and with the right hash."""


def file_handler(run_id: str) -> str:
    return f"{run_id}.file"


class RunFileServer:
    """Serves ``files`` (file id → bytes) to whoever asks, one chunk per request."""

    def __init__(self, p2p: P2P, run_id: str, files: Mapping[str, bytes], *,
                 request_timeout: float = FILE_REQUEST_TIMEOUT) -> None:
        self.p2p, self.run_id, self.files, self.request_timeout = p2p, run_id, dict(files), request_timeout
        self.num_chunks_served = 0
        self._started = False

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(file_handler(self.run_id), self.rpc_file)
        self._started = True

    async def shutdown(self) -> None:
        """Stops serving (idempotent)."""
        if self._started:
            self._started = False
            await self.p2p.remove_binary_stream_handler(file_handler(self.run_id))

    async def rpc_file(self, _info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve_request(reader, writer, self._process, max_payload_bytes=0, timeout=self.request_timeout,
                            what="file")

    async def _process(self, header: dict[str, Any], _tensors: list[torch.Tensor]) -> tuple[dict[str, Any], list[torch.Tensor]]:
        file_id = header.get("id")
        if not isinstance(file_id, str) or len(file_id) > MAX_FILE_ID_CHARS:
            raise ProtocolError("'id' must be a file id string")
        offset = require_int(header, "offset", high=MAX_RUN_FILE_BYTES)
        blob = self.files.get(file_id)
        if blob is None:
            raise Declined(f"this peer does not hold {file_id[:16]}…")
        if offset > len(blob):
            raise ValueError(f"offset {offset} is beyond the file's {len(blob)} bytes")
        chunk = blob[offset:offset + FILE_CHUNK_BYTES]
        self.num_chunks_served += 1
        return {"ok": True, "size": len(blob), "bytes": len(chunk)}, [pack_bytes(chunk)]


async def fetch_run_file(p2p: P2P, run_id: str, file_id: str, peers: Sequence[str], *,
                         verify: Callable[[bytes], bool], timeout: float = FILE_REQUEST_TIMEOUT) -> bytes:
    """The file ``file_id`` from the first of ``peers`` that serves a copy ``verify`` accepts.

    Raises:
        RunFileError: none did (each peer's failure is in the message).
    """
    failures = []
    for peer in peers:
        try:
            blob = await _fetch_from(p2p, run_id, file_id, peer, timeout=timeout)
        except (PeerUnavailableError, RemoteError, ProtocolError) as e:
            failures.append(f"{peer[-6:]}: {str(e)[:120]}")
            continue
        if verify(blob):
            return blob
        logger.warning(f"{peer[-6:]} sent {len(blob):,} bytes that are not the run's {file_id[:16]}…; trying another peer")
        failures.append(f"{peer[-6:]}: another file")
    raise RunFileError(f"no peer served {file_id[:16]}… ({len(peers)} asked: {'; '.join(failures[:5]) or 'none known'})")


async def _fetch_from(p2p: P2P, run_id: str, file_id: str, peer: str, *, timeout: float) -> bytes:
    parts: list[bytes] = []
    received, size = 0, None
    while size is None or received < size:
        reply, tensors = await call_peer(p2p, peer, file_handler(run_id), {"id": file_id, "offset": received},
                                         timeout=timeout, max_payload_bytes=FILE_CHUNK_BYTES + 8)
        told = require_int(reply, "size", high=MAX_RUN_FILE_BYTES)
        if size is not None and told != size:
            raise ProtocolError("the file's size changed between chunks")
        size, nbytes = told, require_int(reply, "bytes", high=FILE_CHUNK_BYTES)
        if nbytes == 0 and received < size:
            raise ProtocolError("an empty chunk before the end of the file")
        parts.append(bytes(unpack_bytes(tensors, nbytes)))
        received += nbytes
        if received > size:
            raise ProtocolError("more bytes than the file's size")
    return b"".join(parts)
