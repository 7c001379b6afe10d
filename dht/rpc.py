"""Request/response calls over hivemind P2P binary streams, and the typed errors a caller handles.

Handler names are namespaced by run: ``<run_id>.forward`` (swarm/), and replication's
``<run_id>.manifest``/``.shard``/``.probe`` likewise. Each call opens a
binary stream through the local p2p daemon, sends one message, reads one reply, all under one
deadline. Failures to reach a peer become :class:`PeerUnavailableError`; a peer that answered with a
refusal becomes :class:`RemoteError`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID

from dht.wire import ProtocolError, read_message, write_message

logger = logging.getLogger(__name__)


class PeerUnavailableError(RuntimeError):
    """The peer could not be reached, hung up, or did not answer in time."""


class RemoteError(RuntimeError):
    """The peer answered, but refused the request; the message says why."""


# What reaching a peer can fail with: the daemon could not dial or open the stream, the stream was
# reset or cut short, or the deadline passed. Anything else is a bug of ours and propagates.
_UNREACHABLE = (OSError, EOFError, asyncio.TimeoutError, asyncio.IncompleteReadError, P2PDaemonError, P2PHandlerError)


async def send_reply(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: dict[str, Any],
    tensors: Sequence[torch.Tensor] = (), *, timeout: float,
) -> None:
    """A handler's answer: write it, then hang up only after the caller did.

    The p2p daemon resets a stream whose local end closes while the peer still reads, so the tail of
    a large reply still queued on a slow link would be lost (seen on a 400 Mbit/s shaped link).
    """
    try:
        async with asyncio.timeout(timeout):
            await write_message(writer, reply, tensors)
            await reader.read(1)  # returns at the caller's hang-up
    except (ConnectionError, OSError, asyncio.TimeoutError) as e:
        logger.debug(f"could not send a reply: {e!r}")
    finally:
        writer.close()


def forward_handler(run_id: str) -> str:
    return f"{run_id}.forward"


async def call_peer(
    p2p: P2P,
    peer_id: str,
    handler: str,
    header: dict[str, Any],
    tensors: Sequence[torch.Tensor] = (),
    *,
    timeout: float,
    max_payload_bytes: int,
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """One request/response exchange with ``peer_id``'s ``handler``, within ``timeout`` seconds."""
    writer = None
    try:
        async with asyncio.timeout(timeout):
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), handler)
            await write_message(writer, header, tensors)
            reply, reply_tensors = await read_message(reader, max_payload_bytes=max_payload_bytes, timeout=timeout)
    except ProtocolError as e:
        raise RemoteError(f"{peer_id[-6:]} sent a malformed reply: {e}") from e
    except _UNREACHABLE as e:
        raise PeerUnavailableError(f"{peer_id[-6:]}: {type(e).__name__}: {str(e)[:200]}") from e
    finally:
        if writer is not None:
            writer.close()
    if reply.get("ok") is not True:
        raise RemoteError(f"{peer_id[-6:]} refused: {str(reply.get('error', 'no reason given'))[:300]}")
    return reply, reply_tensors
