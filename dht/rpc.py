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
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch
from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID

from dht.clock import SYSTEM_CLOCK
from dht.striping import (ASSEMBLIES, FRAME_OVERHEAD, MAX_STRIPES, STRIPE_KEY, Busy, check_piece, join_pieces,
                          parse_answer_stripe, parse_request_stripe, piece_tensor, stripe_bounds)
from dht.wire import ProtocolError, decode_message, encode_message, read_message, write_message

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
                 noun: str = "request", clock: Callable[[], float] = SYSTEM_CLOCK) -> None:
        self.period, self.burst, self.noun, self.clock = period, burst, noun, clock  # noun: what is refused ("record", ...)
        self._windows: dict[str, tuple[float, int]] = {}  # what -> (window start, refusals in it)

    def refused(self, what: str, reason: str) -> None:
        now = self.clock()
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

    A piece of a striped call (``dht.striping``) is kept until its call's pieces are all in; the
    stream that brings the last one serves the call, and every stream answers with its piece of the
    answer. The call is counted once, and ``on_received`` told of it once, whole.

    ``send_lock``, when given, is held while the answer is written (not while waiting for the
    caller's hang-up): answers that share it leave one after another, not interleaved.
    ``on_received(payload bytes, seconds)`` is called once a request arrived whole (``read_message``).

    Returns:
        "ok", "refused", "declined", "abandoned" or "error", also passed to ``on_outcome`` before the
        answer is sent (so a caller that got its answer sees the outcome counted); "piece" for a
        piece of a striped call that another stream served.
    """
    payload: list[tuple[int, float]] = []

    async def receive() -> tuple[dict[str, Any], Sequence[torch.Tensor]]:
        header, request_tensors = await read_message(reader, max_payload_bytes=max_payload_bytes, timeout=timeout,
                                                     on_payload=lambda *figures: payload.append(figures))
        if STRIPE_KEY in header:
            raise _Piece(header, request_tensors)
        if on_received is not None and payload:
            on_received(*payload[0])
        return await process(header, request_tensors)

    try:
        async with asyncio.timeout(timeout):
            try:
                reply, tensors, outcome = await _answer(receive, what)
            except _Piece as piece:
                reply, tensors, outcome = await _serve_piece(
                    piece, process, max_payload_bytes=max_payload_bytes, what=what, on_outcome=on_outcome,
                    on_received=on_received, arrival=payload[0] if payload else (0, 0.0))
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError) as e:
        # cancelled: this process shuts down and its loop cancels every handler still waiting (a
        # striped call's piece waiting for pieces a leaving peer declined, CI rehearsal 2026-11-28).
        # The handler ends quietly: Python 3.11's stream callback calls exception() on a cancelled
        # handler task and logs that with a traceback.
        return _abandoned(writer, what, on_outcome, e)
    if outcome != "piece":
        REQUEST_OUTCOMES[what, outcome] += 1
        on_outcome(outcome)
    try:
        await send_reply(reader, writer, reply, tensors, timeout=timeout, send_lock=send_lock)
    except asyncio.CancelledError:  # shutting down mid-answer (see above); counted already
        logger.debug(f"{what} answer cut short: this process shuts down")
        writer.close()
    return outcome


def _abandoned(writer: asyncio.StreamWriter, what: str, on_outcome: Callable[[str], None], reason: BaseException) -> str:
    logger.debug(f"{what} request abandoned: {reason!r}")
    REQUEST_OUTCOMES[what, "abandoned"] += 1
    on_outcome("abandoned")
    writer.close()
    return "abandoned"


class _Piece(Exception):
    """A request that is a piece of a striped call (raised out of :func:`_answer`'s mapping)."""

    def __init__(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        super().__init__("a stripe")
        self.header, self.tensors = header, tensors


async def _answer(work: Callable[[], Awaitable[tuple[dict[str, Any], Sequence[torch.Tensor]]]],
                  what: str) -> tuple[dict[str, Any], Sequence[torch.Tensor], str]:
    """``work()``'s answer and outcome, with bad input, declines and bugs turned into answers (see
    :func:`serve_request`); a stalled or vanished caller (and a striped piece) propagates."""
    try:
        reply, tensors = await work()
        return reply, tensors, "ok"
    except (ProtocolError, ValueError, TypeError) as e:
        REFUSAL_LOG.refused(what, str(e)[:300])
        return {"ok": False, "error": str(e)[:500]}, (), "refused"
    except Declined as e:
        logger.debug(f"declined a {what} request: {e}")
        return {"ok": False, "error": str(e)[:500], **({"code": e.code} if e.code else {})}, (), "declined"
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, _Piece):
        raise
    except Exception:
        logger.exception(f"internal error while serving a {what} request")
        return {"ok": False, "error": "internal error"}, (), "error"


async def _serve_piece(
    piece: _Piece, process: Process, *, max_payload_bytes: int, what: str, on_outcome: Callable[[str], None],
    on_received: Callable[[int, float], None] | None, arrival: tuple[int, float],
) -> tuple[dict[str, Any], Sequence[torch.Tensor], str]:
    """Keep one piece of a striped call; serve the call if it was the last one in; answer this piece.
    ``arrival``: the piece's bytes this peer waited for and over how long (``dht.wire.ArrivalClock``);
    the call's are their sum over its longest piece's time (the pieces arrive side by side).
    Returns (answer, tensors, outcome), outcome "piece" unless this stream served the call."""
    served: list[tuple[dict[str, Any], Sequence[torch.Tensor], str]] = []

    async def gather() -> tuple[dict[str, Any], Sequence[torch.Tensor]]:
        call_id, index, count, total = parse_request_stripe(piece.header, max_total=max_payload_bytes + FRAME_OVERHEAD)
        try:
            assembly = ASSEMBLIES.add(call_id, index, count, total, piece.tensors)
        except Busy as e:
            raise Declined(str(e)) from None
        assembly.waited_bytes += arrival[0]
        assembly.seconds = max(assembly.seconds, arrival[1])
        try:
            if assembly.complete and not assembly.answer.done():  # the last piece in: serve the call
                blob = ASSEMBLIES.take(call_id)
                if on_received is not None:
                    on_received(assembly.waited_bytes, assembly.seconds)
                served.append(await _answer(lambda: process(*decode_message(blob, max_payload_bytes=max_payload_bytes)), what))
                reply, tensors, outcome = served[0]
                if outcome == "ok":
                    encoded = encode_message(reply, tensors)
                    answer = [({"ok": True, STRIPE_KEY: [i, count, len(encoded)]}, [piece_tensor(encoded, b)])
                              for i, b in enumerate(stripe_bounds(len(encoded), count))]
                else:
                    answer = [(reply, ())] * count
                if assembly.answer.done():  # given up meanwhile: a stream's deadline passed while it was served
                    raise asyncio.TimeoutError(f"striped call {call_id[:8]} was given up while it was served")
                assembly.answer.set_result(answer)
                ASSEMBLIES.forget(call_id)
            return (await asyncio.shield(assembly.answer))[index]
        except BaseException:
            ASSEMBLIES.drop(call_id)  # timed out or failed: the call's other streams end with it
            raise

    reply, tensors, outcome = await _answer(gather, what)
    if served:  # counted here, once for the call (its refusal was logged once, by _answer)
        return reply, tensors, served[0][2]
    if outcome != "ok":  # this piece itself was refused or declined
        return reply, tensors, outcome
    return reply, tensors, "piece"


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
    stripes: int = 1,
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """One request/response exchange with ``peer_id``'s ``handler``, within ``timeout`` seconds;
    over ``stripes`` streams at once when more than 1 (``dht.striping``: a long round trip, a large
    message; the handler must serve with :func:`serve_request`)."""
    if stripes > 1:
        return await _call_striped(p2p, peer_id, handler, header, tensors, count=stripes, timeout=timeout,
                                   max_payload_bytes=max_payload_bytes)
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
    _raise_refusal(peer_id, reply)
    return reply, reply_tensors


def _raise_refusal(peer_id: str, reply: dict[str, Any]) -> None:
    if reply.get("ok") is not True:
        code = reply.get("code")
        raise RemoteError(f"{peer_id[-6:]} refused: {str(reply.get('error', 'no reason given'))[:300]}",
                          code=code[:32] if isinstance(code, str) else "")


async def _call_striped(
    p2p: P2P, peer_id: str, handler: str, header: dict[str, Any], tensors: Sequence[torch.Tensor], *,
    count: int, timeout: float, max_payload_bytes: int,
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """:func:`call_peer` over ``count`` streams: piece ``i`` of the request out and of the answer back
    on stream ``i``; the first failure of any ends them all."""
    count = min(count, MAX_STRIPES)
    blob = encode_message(header, tensors)
    call_id, bounds, max_total = secrets.token_hex(16), stripe_bounds(len(blob), count), max_payload_bytes + FRAME_OVERHEAD
    try:
        async with asyncio.timeout(timeout):
            answers = await _all_or_first_error([
                call_peer(p2p, peer_id, handler, {STRIPE_KEY: [call_id, i, count, len(blob)]},
                          [piece_tensor(blob, bounds[i])], timeout=timeout, max_payload_bytes=max_total)
                for i in range(count)])
    except TimeoutError as e:  # this deadline can pass before its streams' own: the same failure as theirs
        raise PeerUnavailableError(f"{peer_id[-6:]}: TimeoutError: {count} stripes") from e
    try:
        totals = {parse_answer_stripe(reply, index=i, count=count, max_total=max_total) for i, (reply, _) in enumerate(answers)}
        if len(totals) != 1:
            raise ProtocolError(f"the stripes of one answer disagree on its length: {sorted(totals)[:4]}")
        answer_bounds = stripe_bounds(totals.pop(), count)
        pieces = [check_piece(piece, answer_bounds[i]) for i, (_, piece) in enumerate(answers)]
        reply, reply_tensors = decode_message(join_pieces(pieces), max_payload_bytes=max_payload_bytes)
    except ProtocolError as e:
        raise RemoteError(f"{peer_id[-6:]} sent a malformed striped reply: {e}") from e
    _raise_refusal(peer_id, reply)
    return reply, reply_tensors


async def _all_or_first_error(calls: Sequence[Awaitable[Any]]) -> list[Any]:
    """The results of ``calls`` run at once, in order; the first to fail cancels the others and its
    error is raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    for task in tasks:  # a stream's failure after this call ended (cancelled, or another failed first)
        # is no news: asyncio would log it as "never retrieved" (CI rehearsal, 2026-11-28)
        task.add_done_callback(_retrieved)
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if failed:
            raise failed[0]
        return [t.result() for t in tasks]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


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
