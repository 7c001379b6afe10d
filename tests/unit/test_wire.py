"""Stream messages: round trips through an in-memory stream, and every malformed frame rejected."""

from __future__ import annotations

import asyncio
import math
import socket
import struct

import msgpack
import pytest
import torch

from dht.wire import (
    MAX_DIMS,
    MAX_HEADER_BYTES,
    MAX_TENSORS,
    READ_CHUNK,
    ProtocolError,
    encode_header,
    read_message,
    require_tensor,
    write_message,
)

LIMIT = 1 << 20
TIMEOUT = 5.0


class CapturingWriter:
    """Stands in for asyncio.StreamWriter: keeps what is written."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.num_drains = 0

    def write(self, data) -> None:
        self.chunks.append(bytes(data))

    async def drain(self) -> None:
        self.num_drains += 1

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)


def reader_of(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


async def encode(header, tensors=()) -> bytes:
    writer = CapturingWriter()
    await write_message(writer, header, tensors)
    assert writer.num_drains == 1
    return writer.data


async def round_trip(header, tensors=(), *, max_payload_bytes=LIMIT):
    data = await encode(header, tensors)
    return await read_message(reader_of(data), max_payload_bytes=max_payload_bytes, timeout=TIMEOUT)


def raw_frame(header_obj, payload: bytes = b"") -> bytes:
    packed = msgpack.packb(header_obj, use_bin_type=True)
    return struct.pack(">I", len(packed)) + packed + payload


def read_frame(data: bytes, *, eof: bool = True, max_payload_bytes: int = LIMIT, timeout: float = TIMEOUT):
    async def main():
        return await read_message(reader_of(data, eof=eof), max_payload_bytes=max_payload_bytes, timeout=timeout)

    return asyncio.run(main())


TENSORS = [
    torch.randn(3, 5, generator=torch.Generator().manual_seed(0)),
    torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)).to(torch.float16),
    torch.randn(7, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16),
    torch.arange(-5, 7, dtype=torch.int64).reshape(3, 4),
    torch.tensor(3.25),  # 0-d
    torch.tensor(-9, dtype=torch.int64),  # 0-d int
    torch.empty(0, dtype=torch.float32),
    torch.empty(4, 0, 3, dtype=torch.bfloat16),
    torch.empty(0, dtype=torch.int64),
    torch.tensor([math.nan, math.inf, -0.0]),  # raw bytes carried as they are
]


@pytest.mark.parametrize("tensor", TENSORS, ids=lambda t: f"{t.dtype}{list(t.shape)}")
def test_single_tensor_round_trip(tensor):
    header, tensors = asyncio.run(round_trip({"kind": "x"}, [tensor]))
    assert header == {"kind": "x"}
    assert len(tensors) == 1
    assert tensors[0].dtype == tensor.dtype and tensors[0].shape == tensor.shape
    assert torch.equal(tensors[0].view(torch.uint8) if tensor.dim() else tensors[0].reshape(1).view(torch.uint8),
                       tensor.view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8))


def test_many_tensors_and_header_round_trip():
    header = {"mb_id": "abc:1", "route": [["peer", 0, 3]], "loss": 1.5, "blob": b"\x00\x01", "none": None}
    got_header, tensors = asyncio.run(round_trip(header, TENSORS))
    assert got_header == header
    assert len(tensors) == len(TENSORS)
    for got, sent in zip(tensors, TENSORS):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        torch.testing.assert_close(got, sent, equal_nan=True, rtol=0, atol=0)


def test_no_tensors_and_non_contiguous_input():
    assert asyncio.run(round_trip({})) == ({}, [])
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    _, (got,) = asyncio.run(round_trip({}, [base.t()]))
    assert torch.equal(got, base.t())
    _, (got,) = asyncio.run(round_trip({}, [torch.ones(2, requires_grad=True) * 2]))
    assert torch.equal(got, torch.full((2,), 2.0))


def test_received_tensors_are_writable_and_independent_of_the_stream():
    _, (got,) = asyncio.run(round_trip({}, [torch.zeros(4)]))
    got += 1  # must not raise (frombuffer over a bytearray, not read-only bytes)
    assert torch.equal(got, torch.ones(4))


def test_two_messages_back_to_back_on_one_stream():
    async def main():
        data = await encode({"n": 1}, [torch.ones(2)]) + await encode({"n": 2}, [torch.zeros(3, dtype=torch.int64)])
        reader = reader_of(data)
        first = await read_message(reader, max_payload_bytes=LIMIT, timeout=TIMEOUT)
        second = await read_message(reader, max_payload_bytes=LIMIT, timeout=TIMEOUT)
        return first, second

    (h1, t1), (h2, t2) = asyncio.run(main())
    assert h1 == {"n": 1} and torch.equal(t1[0], torch.ones(2))
    assert h2 == {"n": 2} and torch.equal(t2[0], torch.zeros(3, dtype=torch.int64))


def test_round_trip_over_a_real_socketpair():
    async def main():
        left, right = socket.socketpair()
        reader, left_writer = await asyncio.open_connection(sock=left)  # keep both ends referenced
        right_reader, writer = await asyncio.open_connection(sock=right)
        big = torch.randn(300, 257)  # larger than socket buffers: needs drain while the reader reads
        try:
            send = asyncio.create_task(write_message(writer, {"k": 1}, [big]))
            header, tensors = await read_message(reader, max_payload_bytes=LIMIT, timeout=TIMEOUT)
            await send
        finally:
            for w in (writer, left_writer):
                w.close()
                await w.wait_closed()
        return header, tensors[0], big

    header, got, big = asyncio.run(main())
    assert header == {"k": 1} and torch.equal(got, big)


def test_payload_exactly_at_the_limit_is_accepted():
    _, (got,) = asyncio.run(round_trip({}, [torch.ones(16)], max_payload_bytes=64))
    assert got.numel() == 16


# --- rejections ---------------------------------------------------------------------------------


def test_unsendable_dtype_is_refused_by_the_writer():
    with pytest.raises(ProtocolError):
        asyncio.run(encode({}, [torch.ones(2, dtype=torch.int16)]))


def test_oversized_header_is_refused_by_the_writer():
    with pytest.raises(ProtocolError):
        encode_header({"blob": b"x" * MAX_HEADER_BYTES}, [])


def test_header_length_over_the_limit_is_rejected_before_reading_it():
    # only the length prefix is there, no EOF: a reader that tried to read the header would time out
    data = struct.pack(">I", MAX_HEADER_BYTES + 1)
    with pytest.raises(ProtocolError):
        read_frame(data, eof=False, timeout=30.0)
    with pytest.raises(ProtocolError):
        read_frame(struct.pack(">I", 0xFFFFFFFF), eof=False, timeout=30.0)


@pytest.mark.parametrize("header_bytes", [b"\xc1", b"\x92\x01", b"\x81\xa1", b"\x01\x02"], ids=["reserved", "truncated-array", "truncated-map", "extra-data"])
def test_header_that_is_not_msgpack_is_rejected(header_bytes):
    with pytest.raises(ProtocolError):
        read_frame(struct.pack(">I", len(header_bytes)) + header_bytes)


@pytest.mark.parametrize("obj", [[1, 2], 5, "map", None, b"bytes"])
def test_header_that_is_not_a_map_is_rejected(obj):
    with pytest.raises(ProtocolError):
        read_frame(raw_frame(obj))


def test_header_with_non_string_map_keys_is_rejected():
    with pytest.raises(ProtocolError):
        read_frame(raw_frame({(1, 2): 3}))


@pytest.mark.parametrize("described", [
    [["float64", [2]]],
    [["complex64", [2]]],
    [["int16", [1]]],
    [[None, [1]]],
    [["float32"]],
    [["float32", [1], "extra"]],
    [["float32", 3]],
    ["float32"],
    {"float32": [1]},
    "float32",
    5,
], ids=repr)
def test_unknown_dtype_or_malformed_description_is_rejected(described):
    with pytest.raises(ProtocolError):
        read_frame(raw_frame({"tensors": described}, b"\0" * 64))


@pytest.mark.parametrize("shape", [
    [-1],
    [2, -3],
    [1.5],
    [2.0],
    ["2"],
    [True],
    [None],
    [[2]],
    [1] * (MAX_DIMS + 1),
], ids=repr)
def test_bad_shape_is_rejected(shape):
    with pytest.raises(ProtocolError):
        read_frame(raw_frame({"tensors": [["float32", shape]]}, b"\0" * 64))


def test_max_dims_is_accepted():
    _, (got,) = asyncio.run(round_trip({}, [torch.ones([1] * MAX_DIMS)]))
    assert got.dim() == MAX_DIMS


@pytest.mark.parametrize("described", [
    [["float32", [1 << 20]]],
    [["float32", [1 << 17]], ["float32", [1 << 17]], ["int64", [1]]],
    [["float32", [1 << 30, 1 << 30, 1 << 30, 1 << 30, 1 << 30, 1 << 30, 1 << 30, 1 << 30]]],
], ids=["one-big", "sum-over", "astronomic"])
def test_payload_over_the_limit_is_rejected_before_reading_the_payload(described):
    # Only the header is fed and the stream stays open: had the reader waited for the payload it
    # would hang until the (long) timeout instead of failing at once.
    frame = raw_frame({"tensors": described})
    with pytest.raises(ProtocolError, match="limit"):
        read_frame(frame, eof=False, max_payload_bytes=1 << 20, timeout=30.0)


def test_too_many_tensors_is_rejected():
    described = [["int64", [0]]] * (MAX_TENSORS + 1)
    frame = raw_frame({"tensors": described})
    assert len(frame) - 4 <= MAX_HEADER_BYTES  # it is the count, not the header size, that fails
    with pytest.raises(ProtocolError):
        read_frame(frame, eof=False, timeout=30.0)
    _, tensors = read_frame(raw_frame({"tensors": [["int64", [0]]] * MAX_TENSORS}))
    assert len(tensors) == MAX_TENSORS


@pytest.mark.parametrize("cut", [0, 2, 4, 10, -1, -17])
def test_truncated_stream_raises_incomplete_read(cut):
    data = asyncio.run(encode({"name": "truncated"}, [torch.arange(8, dtype=torch.float32)]))
    with pytest.raises(asyncio.IncompleteReadError):
        read_frame(data[:cut])


@pytest.mark.parametrize("cut", [2, 10, -1])
def test_stalled_stream_times_out_within_the_timeout(cut):
    data = asyncio.run(encode({"name": "stalled"}, [torch.arange(8, dtype=torch.float32)]))

    async def main():
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError):
            await read_message(reader_of(data[:cut], eof=False), max_payload_bytes=LIMIT, timeout=0.2)
        return loop.time() - started

    elapsed = asyncio.run(main())
    assert 0.15 <= elapsed < 2.0


# --- require_tensor -----------------------------------------------------------------------------


def test_require_tensor_returns_the_matching_tensor():
    tensors = [torch.zeros(2, 3), torch.ones(4, dtype=torch.int64)]
    assert require_tensor(tensors, 1, dtype=torch.int64, shape=(4,), name="ids") is tensors[1]
    assert require_tensor(tensors, 0, dtype=torch.float32, shape=(2, 3), name="x") is tensors[0]


@pytest.mark.parametrize("tensor, dtype, shape", [
    (torch.zeros(2, 3), torch.float16, (2, 3)),
    (torch.zeros(2, 3), torch.float32, (3, 2)),
    (torch.zeros(2, 3), torch.float32, (2, 3, 1)),
    (torch.zeros(6), torch.float32, (2, 3)),
    (torch.zeros(2, 3, dtype=torch.int64), torch.float32, (2, 3)),
    (torch.tensor([1.0, math.nan]), torch.float32, (2,)),
    (torch.tensor([1.0, math.inf]), torch.float32, (2,)),
    (torch.tensor([-math.inf, 0.0]).to(torch.bfloat16), torch.bfloat16, (2,)),
    (torch.tensor([math.nan]).to(torch.float16), torch.float16, (1,)),
])
def test_require_tensor_rejects_wrong_dtype_shape_or_non_finite(tensor, dtype, shape):
    with pytest.raises(ProtocolError):
        require_tensor([tensor], 0, dtype=dtype, shape=shape, name="x")


def test_require_tensor_rejects_a_missing_tensor():
    with pytest.raises(ProtocolError, match="missing"):
        require_tensor([torch.zeros(1)], 1, dtype=torch.float32, shape=(1,), name="grad")
    with pytest.raises(ProtocolError):
        require_tensor([], 0, dtype=torch.float32, shape=(1,), name="grad")


def test_protocol_error_is_a_value_error():
    assert issubclass(ProtocolError, ValueError)


@pytest.mark.parametrize("dtype", [[], {}, ["float32"], None, 3])
def test_an_unhashable_or_odd_dtype_is_a_protocol_error(dtype):
    """Regression (tests/fuzz): ``[[], [1]]`` raised TypeError (unhashable list) from the dtype lookup."""
    from dht.wire import parse_tensor_layouts

    with pytest.raises(ProtocolError, match="bad tensor description"):
        parse_tensor_layouts([[dtype, [1]]], max_payload_bytes=1 << 20)


def test_only_the_payload_bytes_the_reader_waited_for_measure_the_senders_goodput():
    """A payload half buffered when its handler ran: the buffered half is no evidence of the link's
    rate (timed from the header it read 0.5 MB in no time: a burst); the half that came while the
    reader waited is (ArrivalClock). The clock is a fake one that moves only when the test feeds."""
    payload = torch.zeros(128 * 1024, dtype=torch.float32)  # 512 KiB
    data = asyncio.run(encode({"kind": "forward"}, [payload]))
    split = len(data) // 2

    async def main() -> tuple[int, float]:
        now = [0.0]
        reader, figures = asyncio.StreamReader(), []
        reader.feed_data(data[:split])
        reading = asyncio.create_task(read_message(reader, max_payload_bytes=LIMIT, timeout=TIMEOUT,
                                                   on_payload=lambda *f: figures.append(f), clock=lambda: now[0]))
        while reader._waiter is None:  # until the reader read the buffered half and waits for more
            await asyncio.sleep(0)
        now[0] = 2.0  # the rest arrives 2 s later
        reader.feed_data(data[split:])
        reader.feed_eof()
        _, tensors = await reading
        assert torch.equal(tensors[0], payload)
        return figures[0]

    num_bytes, seconds = asyncio.run(main())
    assert seconds == 2.0 and len(data) - split <= num_bytes < len(data) - split + READ_CHUNK
    everything = []

    async def buffered() -> None:
        await read_message(reader_of(data), max_payload_bytes=LIMIT, timeout=TIMEOUT, clock=lambda: 0.0,
                           on_payload=lambda *f: everything.append(f))

    asyncio.run(buffered())
    assert everything == [(0, 0.0)]  # all buffered: says nothing of the link
