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
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch
from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID

from dht.wire import ProtocolError, read_message, write_message

logger = logging.getLogger(__name__)


class PeerUnavailableError(RuntimeError):
    """The peer could not be reached, hung up, or did not answer in time."""


class RemoteError(RuntimeError):
    """The peer answered, but refused the request; the message says why, ``code`` what kind of refusal
    it was when the peer said (e.g. ``"unrouted"``: it could not pass the request on downstream)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


# What reaching a peer can fail with: the daemon could not dial or open the stream, the stream was
# reset or cut short, or the deadline passed. Anything else is a bug of ours and propagates.
_UNREACHABLE = (OSError, EOFError, asyncio.TimeoutError, asyncio.IncompleteReadError, P2PDaemonError, P2PHandlerError)


class Declined(RuntimeError):
    """A handler's polite refusal of a well-formed request (leaving, nowhere to route it): answered
    with the reason (and ``code``, if any) and logged at DEBUG, unlike bad input, which is a
    ``ProtocolError``/``ValueError``."""

    code = ""


# Process-wide, like dht.wire.TRAFFIC: (what, outcome) -> requests served, for /metrics. A peer process
# hosts one peer, so these are that peer's handlers.
REQUEST_OUTCOMES: Counter[tuple[str, str]] = Counter()

MAX_DRAIN_BYTES = 1 << 20  # unread request bytes dropped after an answer before hanging up anyway
REFUSAL_LOG_PERIOD = 60.0  # seconds: per kind of request, the first few refusals are logged in full...
REFUSAL_LOG_BURST = 20  # ...this many per period; the rest are summed into one line per period


class RefusalLog:
    """Logs refusals of bad requests with their reasons, bounded: a peer flooded with garbage writes
    at most ``burst`` lines per kind of request per ``period`` seconds plus one summary line, rather
    than one line per message (which would fill the disk and cost the CPU the flood aims at)."""

    def __init__(self, *, period: float = REFUSAL_LOG_PERIOD, burst: int = REFUSAL_LOG_BURST,
                 noun: str = "request") -> None:
        self.period, self.burst, self.noun = period, burst, noun  # noun: what is refused ("record", ...)
        self._windows: dict[str, tuple[float, int]] = {}  # what -> (window start, refusals in it)

    def refused(self, what: str, reason: str) -> None:
        now = time.monotonic()
        started, count = self._windows.get(what, (now, 0))
        if now - started >= self.period:
            if count > self.burst:
                logger.warning(f"refused {count - self.burst} more {what} {self.noun}s in the last "
                               f"{now - started:.0f}s (the first {self.burst} logged in full)")
            started, count = now, 0
        count += 1
        self._windows[what] = (started, count)
        if count <= self.burst:
            logger.warning(f"refused a {what} {self.noun}: {reason}")
        elif count == self.burst + 1:
            logger.warning(f"refusing more {what} {self.noun}s than {self.burst} per {self.period:.0f}s: "
                           f"not logging each one until the period ends (the counts are in /metrics)")


REFUSAL_LOG = RefusalLog()

Process = Callable[[dict[str, Any], list[torch.Tensor]], Awaitable[tuple[dict[str, Any], Sequence[torch.Tensor]]]]


async def serve_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, process: Process, *,
    max_payload_bytes: int, timeout: float, what: str, on_outcome: Callable[[str], None] = lambda outcome: None,
    send_lock: asyncio.Lock | None = None, on_received: Callable[[int, float], None] | None = None,
) -> str:
    """Serve one request on a handler's stream: read it, ``process`` it, answer, all under ``timeout``.

    Bad input (``ProtocolError``, ``ValueError``, ``TypeError``) is refused with its reason and logged
    as a warning; :class:`Declined` is answered with its reason; a stalled or vanished caller is
    abandoned; any other exception is a bug of ours, logged with its traceback and answered as an
    internal error. The handler keeps serving others in every case.

    ``send_lock``, when given, is held while the answer is written (not while waiting for the
    caller's hang-up): answers that share it leave one after another, not interleaved.
    ``on_received(payload bytes, seconds)`` is called once a request arrived whole (``read_message``).

    Returns:
        "ok", "refused", "declined", "abandoned" or "error", also passed to ``on_outcome`` before the
        answer is sent (so a caller that got its answer sees the outcome counted).
    """
    reply: dict[str, Any] = {"ok": False}
    tensors: Sequence[torch.Tensor] = ()
    try:
        async with asyncio.timeout(timeout):
            header, request_tensors = await read_message(reader, max_payload_bytes=max_payload_bytes, timeout=timeout,
                                                         on_payload=on_received)
            reply, tensors = await process(header, request_tensors)
        outcome = "ok"
    except (ProtocolError, ValueError, TypeError) as e:
        REFUSAL_LOG.refused(what, str(e)[:300])
        reply, outcome = {"ok": False, "error": str(e)[:500]}, "refused"
    except Declined as e:
        logger.debug(f"declined a {what} request: {e}")
        reply, outcome = {"ok": False, "error": str(e)[:500], **({"code": e.code} if e.code else {})}, "declined"
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
        logger.debug(f"{what} request abandoned: {e!r}")
        REQUEST_OUTCOMES[what, "abandoned"] += 1
        on_outcome("abandoned")
        writer.close()
        return "abandoned"
    except Exception:
        logger.exception(f"internal error while serving a {what} request")
        reply, outcome = {"ok": False, "error": "internal error"}, "error"
    REQUEST_OUTCOMES[what, outcome] += 1
    on_outcome(outcome)
    await send_reply(reader, writer, reply, tensors, timeout=timeout, send_lock=send_lock)
    return outcome


async def send_reply(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: dict[str, Any],
    tensors: Sequence[torch.Tensor] = (), *, timeout: float, send_lock: asyncio.Lock | None = None,
) -> None:
    """A handler's answer: write it, then hang up only after the caller did.

    The p2p daemon resets a stream whose local end closes while the peer still reads, so the tail of
    a large reply still queued on a slow link would be lost (seen on a 400 Mbit/s shaped link). It
    does the same when we close with request bytes left unread (a request refused from its header,
    its tensor bytes still coming): so those are read and dropped, up to ``MAX_DRAIN_BYTES``, until
    the caller hangs up (found by tests/fuzz: about 1 refusal in 2,000 was lost that way).
    """
    try:
        async with asyncio.timeout(timeout):
            if send_lock is None:
                await write_message(writer, reply, tensors)
            else:
                async with send_lock:
                    await write_message(writer, reply, tensors)
            drained = 0
            while drained <= MAX_DRAIN_BYTES:  # returns at the caller's hang-up
                chunk = await reader.read(64 * 1024)
                if not chunk:
                    break
                drained += len(chunk)
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
        code = reply.get("code")
        raise RemoteError(f"{peer_id[-6:]} refused: {str(reply.get('error', 'no reason given'))[:300]}",
                          code=code[:32] if isinstance(code, str) else "")
    return reply, reply_tensors


class HandlerService:
    """One binary-stream handler of ours on a P2P node: registered by :meth:`start`, removed by
    :meth:`shutdown` (idempotent, and quiet when the daemon is already gone); ``async with`` does both.
    Subclasses set ``self.p2p`` and name their handler and the method serving it."""

    handler_name: str
    p2p: P2P
    _started: bool = False

    async def _serve_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve_stream)
        self._started = True

    async def shutdown(self) -> None:
        if not self._started:
            return
        self._started = False
        try:
            await self.p2p.remove_binary_stream_handler(self.handler_name)
        except Exception as e:  # the daemon may already be gone
            logger.debug(f"could not remove the {self.handler_name} handler: {e!r}")

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()
