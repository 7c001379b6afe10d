"""A minimal HTTP/1.1 server on asyncio for the status port: GET only, one request per connection.

Stdlib only (no web framework is a dependency): the status port serves three small documents,
and what matters is that no request, however malformed, can hurt the peer. Every connection runs
under a deadline; the request head is capped in size; a request that does not parse gets
``400 Bad Request`` and a log line; a handler's bug gets ``500`` and a traceback in the log; the
server keeps serving in every case.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
MAX_CONNECTIONS = 64
REQUEST_TIMEOUT = 5.0
_REQUEST_LINE = re.compile(rb"^(?P<method>[A-Z]{1,16}) (?P<target>/[\x21-\x7e]{0,2048}) HTTP/1\.[01]$")
_HEADER_LINE = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e\x80-\xff]*$")
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass(frozen=True)
class Response:
    """What a route returns: a status code, a content type and the body."""

    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    status: int = 200


Route = Callable[[], Awaitable[Response]]


class BadRequest(ValueError):
    """The request does not parse as HTTP/1.x; answered with 400 (or ``status``)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_request_head(head: bytes) -> tuple[str, str]:
    """``(method, path)`` of a request head (the bytes up to and including the blank line).

    The query string is dropped from the path. Raises :class:`BadRequest` on anything that is not
    a well-formed HTTP/1.0 or 1.1 request line followed by well-formed header lines.
    """
    if not head.endswith(b"\r\n\r\n"):
        raise BadRequest("request head is not terminated by a blank line")
    lines = head[:-4].split(b"\r\n")
    match = _REQUEST_LINE.fullmatch(lines[0])
    if match is None:
        raise BadRequest(f"malformed request line {lines[0][:80]!r}")
    for line in lines[1:]:
        if not _HEADER_LINE.fullmatch(line):
            raise BadRequest(f"malformed header line {line[:80]!r}")
    target = match["target"].decode("ascii")
    return match["method"].decode("ascii"), target.split("?", 1)[0].split("#", 1)[0]


def encode_response(response: Response, *, head_only: bool = False) -> bytes:
    reason = _REASONS.get(response.status, "Unknown")
    head = (f"HTTP/1.1 {response.status} {reason}\r\nContent-Type: {response.content_type}\r\n"
            f"Content-Length: {len(response.body)}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + (b"" if head_only else response.body)


async def _close_gracefully(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Half-close, then read what the client still sends until it hangs up (bounded by the caller's
    deadline): closing a socket with unread input resets the connection, and the client would lose
    the answer (a "lingering close", as web servers do)."""
    if writer.can_write_eof():
        writer.write_eof()
    for _ in range(64):
        if not await reader.read(MAX_HEAD_BYTES):
            return


class StatusHTTPServer:
    """Serves ``routes`` (path → coroutine returning a :class:`Response`) on ``host:port``.

    Attributes:
        port: the port it listens on (after :meth:`start`).
        num_requests: requests answered, whatever the status.
        num_bad_requests: requests answered with a 4xx because they did not parse or were not GETs.
    """

    def __init__(self, routes: Mapping[str, Route], *, host: str, port: int,
                 request_timeout: float = REQUEST_TIMEOUT, max_connections: int = MAX_CONNECTIONS) -> None:
        self.routes = dict(routes)
        self.host, self.port = host, port
        self.request_timeout = request_timeout
        self.num_requests = self.num_bad_requests = 0
        self._slots = asyncio.Semaphore(max_connections)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Listen; returns the port (useful when ``port`` was 0)."""
        self._server = await asyncio.start_server(self._on_connection, self.host, self.port, limit=MAX_HEAD_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def shutdown(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def __aenter__(self) -> StatusHTTPServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            async with asyncio.timeout(self.request_timeout):
                if self._slots.locked():  # too many open connections: refuse rather than queue
                    await self._refuse_busy(reader, writer)
                else:
                    async with self._slots:
                        await self._serve_one(reader, writer)
                await _close_gracefully(reader, writer)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as e:
            logger.debug(f"status connection dropped: {e!r}")
        except asyncio.CancelledError:
            pass  # shutdown: this task is the top of its connection, nobody awaits it
        except Exception:  # a bug of ours: log it, keep the server (and the peer) running
            logger.exception("status server failed on a connection")
        finally:
            self._connections.discard(task)
            writer.close()

    async def _refuse_busy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError):
            pass
        writer.write(encode_response(Response(b"busy: too many open connections\n", status=503)))
        await writer.drain()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method = ""
        try:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.LimitOverrunError:
                raise BadRequest(f"request head over {MAX_HEAD_BYTES} bytes", status=431) from None
            except asyncio.IncompleteReadError as e:
                if not e.partial:
                    raise  # connected and hung up without a word: nothing to answer
                raise BadRequest("request head cut short (no blank line before the end)") from None
            method, path = parse_request_head(head)
            if method not in ("GET", "HEAD"):
                raise BadRequest(f"method {method} not allowed", status=405)
            response = await self._respond(path)
        except BadRequest as e:
            self.num_bad_requests += 1
            peer = writer.get_extra_info("peername")
            logger.warning(f"status server: bad request from {peer}: {e}")
            response = Response(f"{_REASONS[e.status]}: {e}\n".encode(), status=e.status)
        self.num_requests += 1
        writer.write(encode_response(response, head_only=method == "HEAD"))
        await writer.drain()

    async def _respond(self, path: str) -> Response:
        route = self.routes.get(path)
        if route is None:
            return Response(f"no such page: {path}; try / /status.json /metrics\n".encode(), status=404)
        try:
            return await route()
        except Exception:
            logger.exception(f"status page {path} failed")
            return Response(b"internal error\n", status=500)
