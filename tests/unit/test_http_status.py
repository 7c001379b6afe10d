"""peer.status.http: request heads parsed strictly, and a live server on 127.0.0.1 that survives bad input.

The server is plain asyncio on loopback (no hivemind), fast enough for the unit layer.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from peer.status.http import MAX_HEAD_BYTES, BadRequest, Response, StatusHTTPServer, parse_request_head


@pytest.mark.parametrize(("head", "expected"), [
    (b"GET / HTTP/1.1\r\n\r\n", ("GET", "/")),
    (b"GET /status.json?x=1 HTTP/1.0\r\nHost: a\r\nAccept: */*\r\n\r\n", ("GET", "/status.json")),
    (b"HEAD /metrics HTTP/1.1\r\nUser-Agent: curl/8\r\n\r\n", ("HEAD", "/metrics")),
])
def test_well_formed_heads(head, expected):
    assert parse_request_head(head) == expected


@pytest.mark.parametrize("head", [
    b"", b"\r\n\r\n", b"garbage\r\n\r\n", b"GET / HTTP/1.1\r\n", b"GET /\r\n\r\n", b"get / HTTP/1.1\r\n\r\n",
    b"GET  / HTTP/1.1\r\n\r\n", b"GET http://x/ HTTP/1.1\r\n\r\n", b"GET / HTTP/2.0\r\n\r\n", b"GET / HTTP/1.1\n\n",
    b"GET /a b HTTP/1.1\r\n\r\n", b"GET /\x00 HTTP/1.1\r\n\r\n", b"\xff\xfe / HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\nno colon\r\n\r\n", b"GET / HTTP/1.1\r\n: empty name\r\n\r\n", b"GET / HTTP/1.1\r\nA: \x00\r\n\r\n",
    b"GET /" + b"a" * 3000 + b" HTTP/1.1\r\n\r\n",
])
def test_malformed_heads_are_bad_requests(head):
    with pytest.raises(BadRequest):
        parse_request_head(head)


async def exchange(port: int, data: bytes, *, half_close: bool = False) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    if half_close:
        writer.write_eof()
    reply = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return reply


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


async def ok_route() -> Response:
    return Response(b"fine\n")


async def broken_route() -> Response:
    raise RuntimeError("a bug")


@pytest.fixture
def routes():
    return {"/": ok_route, "/broken": broken_route}


def test_server_answers_bad_input_with_4xx_logs_it_and_keeps_serving(routes, caplog):
    async def scenario() -> None:
        async with StatusHTTPServer(routes, host="127.0.0.1", port=0) as server:
            bad = [
                (b"garbage\r\n\r\n", 400), (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),
                (b"POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", 405), (b"GET / HTTP/1.1\r\nbad\r\n\r\n", 400),
                (b"GET / HTTP/1.1\r\nX: " + b"a" * (2 * MAX_HEAD_BYTES), 431), (b"GET /half", 400),
                (b"GET /nowhere HTTP/1.1\r\n\r\n", 404), (b"GET /broken HTTP/1.1\r\n\r\n", 500),
            ]
            for data, expected in bad:
                reply = await exchange(server.port, data, half_close=data == b"GET /half")
                assert status_of(reply) == expected, (data[:30], reply[:80])
            reply = await exchange(server.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status_of(reply) == 200 and reply.endswith(b"\r\n\r\nfine\n")
            assert b"Content-Length: 5\r\n" in reply
            head = await exchange(server.port, b"HEAD / HTTP/1.1\r\n\r\n")
            assert status_of(head) == 200 and head.endswith(b"\r\n\r\n")
            assert server.num_bad_requests == 6 and server.num_requests == 10

    with caplog.at_level(logging.WARNING, logger="peer.status.http"):
        asyncio.run(scenario())
    assert sum("bad request" in r.getMessage() for r in caplog.records) == 6
    assert any("status page /broken failed" in r.getMessage() for r in caplog.records)


def test_a_silent_client_is_dropped_at_the_deadline_and_others_are_served(routes):
    async def scenario() -> None:
        async with StatusHTTPServer(routes, host="127.0.0.1", port=0, request_timeout=0.3) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET / HT")  # and then nothing
            assert status_of(await exchange(server.port, b"GET / HTTP/1.1\r\n\r\n")) == 200
            assert await asyncio.wait_for(reader.read(), 3) == b""  # hung up on, without an answer
            writer.close()

    asyncio.run(scenario())


def test_too_many_connections_get_503(routes):
    async def scenario() -> None:
        async with StatusHTTPServer(routes, host="127.0.0.1", port=0, max_connections=2) as server:
            idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
            await asyncio.sleep(0.1)
            assert status_of(await exchange(server.port, b"GET / HTTP/1.1\r\n\r\n")) == 503
            for _, writer in idle:
                writer.close()
            await asyncio.sleep(0.1)
            assert status_of(await exchange(server.port, b"GET / HTTP/1.1\r\n\r\n")) == 200

    asyncio.run(scenario())


def test_shutdown_is_idempotent_and_frees_the_port(routes):
    async def scenario() -> None:
        server = StatusHTTPServer(routes, host="127.0.0.1", port=0)
        port = await server.start()
        await server.shutdown()
        await server.shutdown()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)

    asyncio.run(scenario())
