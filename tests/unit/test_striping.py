"""dht.striping's pure parts: how many streams a call takes, how its bytes are cut, and what the
gatherer of pieces keeps (the calls themselves: tests/integration/test_striped_calls.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dht.striping import (MAX_STRIPES, STRIPE_BYTES, STRIPE_MIN_RTT, Assemblies, Busy, join_pieces, piece_tensor,
                          stripe_bounds, stripe_count)
from dht.wire import ProtocolError, decode_message, encode_message

CALL = "ab" * 16


def test_a_call_is_striped_only_on_a_long_round_trip_and_only_when_it_is_large():
    activation = 512 * 1024
    assert stripe_count(activation, None) == 1  # not measured yet
    assert stripe_count(activation, 0.001) == 1  # loopback: a window per round trip is far above the link
    assert stripe_count(activation, 0.9 * STRIPE_MIN_RTT) == 1
    assert stripe_count(activation, 0.160) == 4  # 20 Mbit/s + 40 ms: 128 KiB a stream
    assert stripe_count(STRIPE_BYTES, 0.160) == 1 and stripe_count(STRIPE_BYTES + 1, 0.160) == 2
    assert stripe_count(64 << 20, 0.160) == MAX_STRIPES
    assert stripe_count(activation, float("nan")) == 1


@pytest.mark.parametrize("total, count", [(10, 3), (3, 3), (1_000_003, 8), (8, 8)])
def test_the_ranges_cover_the_message_once_in_order_and_differ_by_at_most_a_byte(total, count):
    bounds = stripe_bounds(total, count)
    assert bounds[0][0] == 0 and bounds[-1][1] == total and len(bounds) == count
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_a_message_cut_into_pieces_and_joined_decodes_to_itself():
    header, tensors = {"mb_id": "x", "n": [1, 2]}, [torch.randn(3, 5), torch.arange(7), torch.empty(0)]
    blob = encode_message(header, tensors)
    pieces = [piece_tensor(blob, b) for b in stripe_bounds(len(blob), 3)]
    decoded, decoded_tensors = decode_message(join_pieces(pieces), max_payload_bytes=1 << 20)
    assert decoded == header and all(torch.equal(a, b) for a, b in zip(decoded_tensors, tensors, strict=True))
    with pytest.raises(ProtocolError, match="follow its header"):
        decode_message(blob[:-1], max_payload_bytes=1 << 20)
    with pytest.raises(ProtocolError, match="follow its header"):
        decode_message(blob + b"\0", max_payload_bytes=1 << 20)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode_message(blob, max_payload_bytes=10)


def run(coroutine):
    return asyncio.run(coroutine)


def test_the_gatherer_keeps_a_call_until_it_is_complete_and_refuses_pieces_that_disagree():
    async def main():
        assemblies = Assemblies()
        blob = bytes(range(256)) * 4
        bounds = stripe_bounds(len(blob), 3)
        first = assemblies.add(CALL, 1, 3, len(blob), [piece_tensor(blob, bounds[1])])
        assert not first.complete and assemblies.held_bytes == bounds[1][1] - bounds[1][0]
        with pytest.raises(ProtocolError, match="arrived twice"):
            assemblies.add(CALL, 1, 3, len(blob), [piece_tensor(blob, bounds[1])])
        with pytest.raises(ProtocolError, match="its call 3 of"):
            assemblies.add(CALL, 0, 4, len(blob), [piece_tensor(blob, stripe_bounds(len(blob), 4)[0])])
        with pytest.raises(ProtocolError, match="where its range holds"):
            assemblies.add(CALL, 0, 3, len(blob), [piece_tensor(blob, bounds[2])[:-1]])
        for index in (2, 0):
            assembly = assemblies.add(CALL, index, 3, len(blob), [piece_tensor(blob, bounds[index])])
        assert assembly is first and assembly.complete
        assert assemblies.take(CALL) == blob and assemblies.held_bytes == 0
        with pytest.raises(ProtocolError, match="arrived twice"):  # known until forgotten
            assemblies.add(CALL, 0, 3, len(blob), [piece_tensor(blob, bounds[0])])
        assemblies.forget(CALL)
        assert len(assemblies) == 0 and assemblies.held_bytes == 0

    run(main())


def test_the_gatherer_is_bounded_in_calls_and_bytes_and_a_dropped_call_ends_its_waiters():
    async def main():
        assemblies = Assemblies(max_calls=2, max_bytes=1000)
        blob = bytes(1200)
        bounds = stripe_bounds(len(blob), 2)  # 600 bytes a piece
        waiting = assemblies.add("01" * 16, 0, 2, len(blob), [piece_tensor(blob, bounds[0])])
        with pytest.raises(Busy, match="bytes"):  # 1,200 held would be over 1,000
            assemblies.add("02" * 16, 0, 2, len(blob), [piece_tensor(blob, bounds[0])])
        assemblies.add("03" * 16, 0, 2, 4, [piece_tensor(bytes(4), (0, 2))])
        with pytest.raises(Busy, match="calls"):
            assemblies.add("04" * 16, 0, 2, 4, [piece_tensor(bytes(4), (0, 2))])
        assert len(assemblies) == 2 and assemblies.held_bytes == 602
        assemblies.drop("01" * 16)
        with pytest.raises(asyncio.TimeoutError):
            await waiting.answer
        assemblies.drop("01" * 16)  # idempotent
        assert len(assemblies) == 1 and assemblies.held_bytes == 2

    run(main())
