"""dht.rpc: refusals are counted per handler, logged in bounded numbers, and reach a caller that
sent more bytes than the refused header (regressions found by tests/fuzz)."""

from __future__ import annotations

import asyncio
import gc
import logging
import struct

import msgpack

from dht import rpc
from dht.rpc import REQUEST_OUTCOMES, RefusalLog, serve_request
from dht.wire import ProtocolError


def test_refusal_log_writes_a_burst_then_one_line_per_period(caplog):
    now = [100.0]
    log = RefusalLog(period=60.0, burst=3, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="dht.rpc"):
        for number in range(1000):
            log.refused("forward", f"reason {number}")
        now[0] += 61.0
        log.refused("forward", "a new period")
        log.refused("status", "another handler has its own burst")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == [f"refused a forward request: reason {n}" for n in range(3)]
    assert lines[3].startswith("refusing more forward requests than 3 per 60s")
    assert lines[4] == "refused 997 more forward requests in the last 61s (the first 3 logged in full)"
    assert lines[5:] == ["refused a forward request: a new period",
                         "refused a status request: another handler has its own burst"]


class Pipe:
    """One direction of a stream: bytes written by one side, read by the other."""

    def __init__(self) -> None:
        self.reader = asyncio.StreamReader()
        self.closed = False

    def write(self, data) -> None:
        self.reader.feed_data(bytes(data))

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.reader.feed_eof()


def test_a_refused_request_with_unread_bytes_is_answered_and_counted():
    """The refusal is written, then the unread tail is drained until the caller hangs up (closing
    with unread bytes made the p2p daemon reset the stream and lose the refusal)."""

    async def main():
        request, reply = Pipe(), Pipe()
        header = msgpack.packb({"kind": "leave", "tensors": [["float32", [1 << 20]]]})
        request.write(struct.pack(">I", len(header)) + header + b"\x00" * 300_000)  # tensor bytes refused unread

        async def never(header, tensors):
            raise AssertionError("a refused request must not be processed")

        before = REQUEST_OUTCOMES["fuzzed", "refused"]
        serving = asyncio.create_task(serve_request(request.reader, reply, never, max_payload_bytes=0, timeout=5,
                                                    what="fuzzed"))
        (length,) = struct.unpack(">I", await reply.reader.readexactly(4))
        answer = msgpack.unpackb(await reply.reader.readexactly(length))
        await asyncio.sleep(0.05)
        assert not serving.done() and not reply.closed  # still draining: it waits for our hang-up
        request.close()
        assert await asyncio.wait_for(serving, 5) == "refused"
        assert answer["ok"] is False and "payload exceeds" in answer["error"]
        assert REQUEST_OUTCOMES["fuzzed", "refused"] == before + 1 and reply.closed
        assert request.reader.at_eof()  # every byte was read

    asyncio.run(main())


def test_outcomes_are_counted_per_handler():
    async def main():
        async def process(header, tensors):
            if header.get("fail"):
                raise ProtocolError("bad")
            return {"ok": True}, []

        before = REQUEST_OUTCOMES.copy()
        for fail in (False, True, True):
            request, reply = Pipe(), Pipe()
            packed = msgpack.packb({"fail": fail})
            request.write(struct.pack(">I", len(packed)) + packed)
            request.close()
            await serve_request(request.reader, reply, process, max_payload_bytes=0, timeout=5, what="counted")
        cut = Pipe()
        cut.write(b"\x00\x00")
        cut.close()
        await serve_request(cut.reader, Pipe(), process, max_payload_bytes=0, timeout=5, what="counted")
        delta = {k: REQUEST_OUTCOMES[k] - before.get(k, 0) for k in REQUEST_OUTCOMES if k[0] == "counted"}
        assert delta == {("counted", "ok"): 1, ("counted", "refused"): 2, ("counted", "abandoned"): 1}

    asyncio.run(main())


def test_a_handler_cancelled_while_it_waits_ends_quietly_as_abandoned():
    """A process shutting down cancels every handler still waiting (a striped call's piece whose other
    pieces never came): the handler task ends without an exception, which Python 3.11's stream
    callback would log with a traceback (CI rehearsal, 2026-11-28)."""

    async def main():
        request, reply = Pipe(), Pipe()
        header = msgpack.packb({"kind": "slow", "tensors": []})
        request.write(struct.pack(">I", len(header)) + header)
        started = asyncio.Event()

        async def slow(header, tensors):
            started.set()
            await asyncio.sleep(60)

        before = REQUEST_OUTCOMES["cancelled", "abandoned"]
        serving = asyncio.create_task(serve_request(request.reader, reply, slow, max_payload_bytes=0, timeout=30,
                                                    what="cancelled"))
        await asyncio.wait_for(started.wait(), 5)
        serving.cancel()
        await asyncio.wait([serving], timeout=5)
        assert serving.done() and not serving.cancelled() and serving.exception() is None
        assert serving.result() == "abandoned" and reply.closed
        assert REQUEST_OUTCOMES["cancelled", "abandoned"] == before + 1

    asyncio.run(main())


def test_a_stripe_that_fails_as_its_call_is_given_up_leaves_no_unretrieved_error(caplog):
    """A striped call ends at its first failure and cancels its other streams; a stream that ends in an
    error of its own instead (Python 3.11's wait_for can turn a cancellation into the inner error that
    came at the same moment) must not be logged as "Task exception was never retrieved" (CI
    rehearsal, 2026-11-28: a leaving peer's log)."""

    async def main():
        async def fails():
            await asyncio.sleep(0.01)
            raise rpc.PeerUnavailableError("the first stream failed")

        async def fails_when_cancelled():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                raise rpc.PeerUnavailableError("the stream broke as it was cancelled") from None

        try:
            await rpc._all_or_first_error([fails(), fails_when_cancelled()])
        except rpc.PeerUnavailableError as e:
            assert "first stream" in str(e)
        else:
            raise AssertionError("the first failure is raised")
        await asyncio.sleep(0.05)  # the cancelled stream ends

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
