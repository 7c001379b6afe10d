"""--max-upload-mbps: the token bucket behind dht.wire's writes."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dht.wire import UPLOAD_CHUNK_BYTES, UploadLimit, read_message, write_message


def test_off_never_waits():
    limit = UploadLimit()

    async def main():
        loop = asyncio.get_running_loop()
        started = loop.time()
        for _ in range(100):
            await limit.acquire(10**9)
        return loop.time() - started

    assert asyncio.run(main()) < 0.5


def test_the_average_rate_is_capped_after_the_burst():
    limit = UploadLimit()
    limit.configure(4e6, burst_seconds=0.25)  # 4 MB/s, 1 MB burst

    async def main():
        loop = asyncio.get_running_loop()
        started = loop.time()
        for _ in range(12):
            await limit.acquire(250_000)  # 3 MB: 1 MB of burst, then 2 MB at 4 MB/s
        return loop.time() - started

    assert asyncio.run(main()) >= 0.5 - 0.02


def test_concurrent_senders_share_the_rate():
    limit = UploadLimit()
    limit.configure(2e6, burst_seconds=0.0)  # the burst is at least one chunk

    async def sender():
        for _ in range(4):
            await limit.acquire(UPLOAD_CHUNK_BYTES)

    async def main():
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.gather(sender(), sender())
        return loop.time() - started

    expected = (8 * UPLOAD_CHUNK_BYTES - UPLOAD_CHUNK_BYTES) / 2e6  # all but the first chunk wait
    assert asyncio.run(main()) >= expected - 0.02


@pytest.mark.parametrize("rate", [-1.0, float("nan"), float("inf")])
def test_bad_rates_are_refused(rate):
    with pytest.raises(ValueError):
        UploadLimit().configure(rate)


def test_a_capped_message_arrives_whole(monkeypatch):
    import dht.wire as wire

    limit = UploadLimit()
    limit.configure(20e6)
    monkeypatch.setattr(wire, "UPLOAD_LIMIT", limit)
    tensor = torch.arange(1_000_000, dtype=torch.float32)  # 4 MB, 16 chunks

    async def main():
        server_got = asyncio.get_running_loop().create_future()

        async def handle(reader, writer):
            server_got.set_result(await read_message(reader, max_payload_bytes=8 << 20, timeout=10))
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await write_message(writer, {"k": 1}, [tensor])
        elapsed = loop.time() - started
        header, tensors = await asyncio.wait_for(server_got, 10)
        writer.close()
        server.close()
        return elapsed, header, tensors

    elapsed, header, tensors = asyncio.run(main())
    assert header == {"k": 1} and torch.equal(tensors[0], tensor)
    assert elapsed >= (4e6 - limit.burst) / 20e6 - 0.02


def test_a_control_message_never_queues_behind_a_bulk_transfer(monkeypatch):
    """A ping's answer from a capped peer that serves its state: were it to wait its turn behind the
    shards, the pinging neighbour would get no answer in time and declare the peer down."""
    import dht.wire as wire

    limit = UploadLimit()
    limit.configure(1e3, burst_seconds=0.0)  # 1 kB/s: a chunk's debt takes minutes to pay
    monkeypatch.setattr(wire, "UPLOAD_LIMIT", limit)

    async def main():
        bulk = asyncio.ensure_future(limit.acquire(10 * UPLOAD_CHUNK_BYTES))  # holds the bucket, paying its debt
        await asyncio.sleep(0)
        got = asyncio.get_running_loop().create_future()

        async def handle(reader, writer):
            got.set_result(await read_message(reader, max_payload_bytes=64, timeout=10))
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        await asyncio.wait_for(write_message(writer, {"kind": "ping"}), 10)  # not the bulk's minutes
        header, _ = await asyncio.wait_for(got, 10)
        owed = limit._tokens
        bulk.cancel()
        writer.close()
        server.close()
        return header, owed

    header, owed = asyncio.run(main())
    assert header == {"kind": "ping"}
    assert owed < UPLOAD_CHUNK_BYTES - 10 * UPLOAD_CHUNK_BYTES  # charged (the burst is one chunk): the next bulk write pays for the ping too
