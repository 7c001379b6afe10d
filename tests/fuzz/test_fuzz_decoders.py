"""Property tests of every decoder that reads network bytes: only the documented error, ever.

In-process and fast (no network): hypothesis draws arbitrary bytes and arbitrary msgpack values
and checks that each decoder either returns a value within its limits or raises its one documented
error (``ProtocolError``/``ValueError``/``BadRequest``), never anything else. ``derandomize=True``
makes the examples a function of the test alone, so CI runs the same ones every time; the live
barrage against a real peer is tests/fuzz/test_fuzz_live_peer.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import struct

import msgpack
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dht.records import BOUNDARY_CODECS, ModelSpec, PeerRecord, RunSpec
from dht.striping import STRIPE_KEY, parse_answer_stripe, parse_request_stripe
from dht.wire import DTYPE_NAMES, DTYPES, ProtocolError, decode_header, decode_message, parse_tensor_layouts, read_message
from peer.status.http import BadRequest, parse_request_head
from replication.manifest import Manifest
from replication.server import require_int, unpack_bytes
from swarm.boundary_codec import boundary_codec
from swarm.stage_server import _check_forward_header
from swarm.subspace import stage_boundary_codec

EXAMPLES = 1_000
SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
           | st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
                      max_leaves=30)
shapes = st.lists(st.integers(-2, 2**64 - 1) | st.booleans() | st.floats(), max_size=10)
described = st.lists(st.lists(st.sampled_from(["float32", "int64", "float16", "bfloat16", "float64", "uint8"]) | values,
                              max_size=3) | st.tuples(st.sampled_from(["float32", "int64"]), shapes).map(list), max_size=6)


def near_valid(valid: dict, *, extra: st.SearchStrategy = values) -> st.SearchStrategy:
    """A valid wire dict with some fields replaced by arbitrary values, removed or added."""
    return st.builds(lambda replaced, removed, added: {**{k: v for k, v in valid.items() if k not in removed}, **replaced, **added},
                     st.dictionaries(st.sampled_from(sorted(valid)), extra, max_size=3),
                     st.sets(st.sampled_from(sorted(valid)), max_size=2),
                     st.dictionaries(st.text(max_size=8), extra, max_size=2))


@SETTINGS
@given(st.binary(max_size=300) | values.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_decode_header_returns_a_map_or_refuses(packed):
    try:
        header = decode_header(packed)
    except ProtocolError:
        return
    assert isinstance(header, dict)


@SETTINGS
@given(described | values, st.sampled_from([0, 1 << 10, 1 << 29]))
def test_tensor_layouts_stay_within_the_limit_or_are_refused(layout, limit):
    try:
        layouts = parse_tensor_layouts(layout, max_payload_bytes=limit)
    except ProtocolError:
        return
    assert sum(nbytes for _, _, nbytes in layouts) <= limit
    assert all(math.prod(shape) * dtype.itemsize == nbytes for dtype, shape, nbytes in layouts)


def _read(data: bytes, limit: int):
    async def main():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_message(reader, max_payload_bytes=limit, timeout=5)
    return asyncio.run(main())


def _framed(header: bytes) -> bytes:
    return struct.pack(">I", len(header)) + header


frames = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda header, tail: struct.pack(">I", len(header)) + header + tail,
              values.map(lambda v: msgpack.packb(v, use_bin_type=True)), st.binary(max_size=200)),
    st.builds(lambda layout, tail: _framed(msgpack.packb({"tensors": layout})) + tail, described, st.binary(max_size=400)),
    st.builds(lambda n, tail: struct.pack(">I", n) + tail, st.integers(0, 2**32 - 1), st.binary(max_size=50)),
)


@settings(SETTINGS, max_examples=EXAMPLES // 2)
@given(frames, st.sampled_from([0, 256]))
def test_read_message_returns_checked_tensors_or_refuses(data, limit):
    try:
        header, tensors = _read(data, limit)
    except (ProtocolError, asyncio.IncompleteReadError):
        return
    assert isinstance(header, dict) and "tensors" not in header
    assert sum(t.numel() * t.element_size() for t in tensors) <= limit


@SETTINGS
@given(values | near_valid(PeerRecord(peer_id="QmPeer", role="reliable", state="training", stage=0, flops=1e9).to_wire()))
def test_peer_record_from_wire_parses_or_raises_value_error(wire):
    try:
        record = PeerRecord.from_wire(wire)
    except ValueError:
        return
    assert record == PeerRecord.from_wire(record.to_wire())


@SETTINGS
@given(values | near_valid(RunSpec(run_id="demo").to_wire())
       | near_valid(RunSpec(run_id="demo").to_wire(), extra=near_valid(RunSpec(run_id="demo").to_wire()["model"])))
def test_run_spec_from_wire_parses_or_raises_value_error(wire):
    try:
        spec = RunSpec.from_wire(wire)
    except ValueError:
        return
    assert spec == RunSpec.from_wire(spec.to_wire())


_MANIFEST = {"format": 1, "hash": "blake2b-256", "run_id": "demo", "stage": 0, "version": 3, "total_bytes": 16,
             "shard_bytes": 8, "tensors": [["w", "float32", [4], 0, 16]], "shard_hashes": ["00" * 32, "11" * 32]}


@SETTINGS
@given(values | near_valid(_MANIFEST))
def test_manifest_from_wire_parses_or_raises_value_error(wire):
    try:
        Manifest.from_wire(wire)
    except ValueError:
        return


@settings(SETTINGS, max_examples=EXAMPLES // 2)
@given(frames, st.sampled_from([0, 256]))
def test_decode_message_agrees_with_read_message_or_refuses(data, limit):
    """A striped call's assembled bytes (dht.striping) are checked as a stream's are: the same message, or a refusal."""
    try:
        header, tensors = decode_message(data, max_payload_bytes=limit)
    except ProtocolError:
        return
    assert isinstance(header, dict) and "tensors" not in header
    assert sum(t.numel() * t.element_size() for t in tensors) <= limit
    streamed, streamed_tensors = _read(data, limit)  # the whole of it, exactly: a stream reads the same
    assert streamed == header and all(torch.equal(a, b) for a, b in zip(streamed_tensors, tensors, strict=True))


@SETTINGS
@given(near_valid({STRIPE_KEY: ["ab" * 16, 1, 4, 1000]}, extra=values | st.lists(scalars, max_size=5)))
def test_stripe_headers_parse_within_their_bounds_or_are_refused(header):
    try:
        call_id, index, count, total = parse_request_stripe(header, max_total=10_000)
    except ProtocolError:
        pass
    else:
        assert len(call_id) == 32 and 0 <= index < count <= 8 and count <= total <= 10_000
    answer = {"ok": True, STRIPE_KEY: header.get(STRIPE_KEY)}
    try:
        total = parse_answer_stripe(answer, index=1, count=4, max_total=10_000)
    except ProtocolError:
        return
    assert type(total) is int and 4 <= total <= 10_000


@SETTINGS
@given(near_valid({"mb_id": "mb-1", "route": [["QmPeer", 0, 3]], "batch_size": 4, "path": ["QmNext", "QmLast"]}))
def test_forward_header_check_accepts_only_well_formed_headers(header):
    try:
        mb_id, route, batch_size, path = _check_forward_header(header, 16, 1, 3)
    except ProtocolError:
        return
    assert isinstance(mb_id, str) and 1 <= len(mb_id) <= 128 and type(batch_size) is int and 1 <= batch_size <= 16
    assert len(route) == 1 and type(route[0][1]) is int and route[0][1] == 0 and 1 <= len(route[0][0]) <= 128
    assert path is None or (len(path) == 2 and all(isinstance(p, str) for p in path))


@SETTINGS
@given(values, st.sampled_from(["index", "count", "nbytes"]))
def test_require_int_returns_an_int_in_range_or_refuses(value, key):
    try:
        got = require_int({key: value}, key, low=0, high=1 << 20)
    except ProtocolError:
        return
    assert type(got) is int and 0 <= got <= 1 << 20


@SETTINGS
@given(st.lists(st.integers(0, 64)).map(lambda ns: [torch.zeros(n, dtype=torch.int64) for n in ns[:2]]),
       st.integers(-10, 10**6))
def test_unpack_bytes_fits_or_refuses(tensors, nbytes):
    try:
        view = unpack_bytes(tensors, nbytes)
    except ProtocolError:
        return
    assert len(view) == nbytes


BOUNDARY_SHAPE = (3, 50)  # what the run spec expects; 150 values: two full int8 blocks and a short one
special = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e38, -1e38, 1e-45, 65504.0, 70000.0, -128.0])


def _tensor(dtype_name: str, shape: list[int], fill: list[float]) -> torch.Tensor:
    dtype, numel = DTYPES[dtype_name], math.prod(shape)
    values = torch.tensor(fill or [0.0], dtype=torch.float64).repeat(numel // max(len(fill), 1) + 1)[:numel]
    if not dtype.is_floating_point:
        values = values.nan_to_num(0.0, 0.0, 0.0).clamp(-(2.0**62), 2.0**62)
        values = values.remainder(256) - 128 if dtype == torch.int8 else values
    return values.to(dtype).reshape(shape)


any_wire = st.lists(st.builds(_tensor, st.sampled_from(sorted(DTYPES)),
                              st.lists(st.integers(0, 160), max_size=2) | st.sampled_from([[150], [3, 50], [1], [3], [150, 1]]),
                              st.lists(st.floats() | special, max_size=8)), max_size=4)


def _near_valid_wire(name: str, seed: int, position: int, index: int, value: float) -> list[torch.Tensor]:
    """A valid encoding with one value of one wire tensor replaced by ``value`` (cast to its dtype)."""
    x = torch.randn(BOUNDARY_SHAPE, generator=torch.Generator().manual_seed(seed)) * 10.0 ** (seed % 7 - 3)
    wire = [t.clone() for t in boundary_codec(name).encode(x)]
    target = wire[position % len(wire)].reshape(-1)
    if target.numel():
        target[index % target.numel()] = _tensor(DTYPE_NAMES[target.dtype], [1], [value]).item()
    return wire


near_valid_wire = st.builds(_near_valid_wire, st.sampled_from(BOUNDARY_CODECS), st.integers(0, 100), st.integers(0, 3),
                            st.integers(0, 200), st.floats() | special)


@SETTINGS
@given(st.sampled_from(BOUNDARY_CODECS), any_wire | near_valid_wire, st.sampled_from([torch.float32, torch.bfloat16]))
def test_boundary_codecs_decode_the_expected_finite_tensor_or_refuse(name, wire, dtype):
    try:
        decoded = boundary_codec(name).decode(wire, shape=BOUNDARY_SHAPE, dtype=dtype)
    except ProtocolError:
        return
    assert decoded.shape == BOUNDARY_SHAPE and decoded.dtype == dtype and bool(torch.isfinite(decoded).all())


SUBSPACE = RunSpec(run_id="fz", model=ModelSpec(d_model=16, num_heads=2, seq_len=50, boundary_subspace=4))
SUBSPACE_SHAPE = (3, 50, 16)  # (batch, seq, d_model); its wire carries (3, 50, 4)


def _near_valid_subspace_wire(name: str, seed: int, position: int, index: int, value: float) -> list[torch.Tensor]:
    """A valid subspace encoding (of a gradient) with one value of one wire tensor replaced by ``value``."""
    x = torch.randn(SUBSPACE_SHAPE, generator=torch.Generator().manual_seed(seed)) * 10.0 ** (seed % 7 - 3)
    wire = [t.clone() for t in stage_boundary_codec(dataclasses.replace(SUBSPACE, boundary_codec=name)).encode(x)]
    target = wire[position % len(wire)].reshape(-1)
    target[index % target.numel()] = _tensor(DTYPE_NAMES[target.dtype], [1], [value]).item()
    return wire


subspace_wire = any_wire | st.builds(_near_valid_subspace_wire, st.sampled_from(BOUNDARY_CODECS), st.integers(0, 100),
                                     st.integers(0, 3), st.integers(0, 700), st.floats() | special)


@SETTINGS
@given(st.sampled_from(BOUNDARY_CODECS), subspace_wire, st.integers(0, 2**31), st.booleans())
def test_subspace_boundaries_decode_the_expected_finite_tensor_or_refuse(name, wire, seed, activations):
    """A subspace run's boundary (swarm.subspace): the inner codec's checks for the (…, k) shape, then
    a lifted tensor that must be finite; activations lift with the window's ids (in the vocabulary:
    the stage server checks them before it decodes)."""
    codec = stage_boundary_codec(dataclasses.replace(SUBSPACE, boundary_codec=name))
    ids = torch.randint(0, 256, (3, 51), generator=torch.Generator().manual_seed(seed))
    try:
        if activations:
            decoded = codec.decode_activations(wire, ids, shape=SUBSPACE_SHAPE, dtype=torch.float32)
        else:
            decoded = codec.decode(wire, shape=SUBSPACE_SHAPE, dtype=torch.float32, name="gradient")
    except ProtocolError:
        return
    assert decoded.shape == SUBSPACE_SHAPE and decoded.dtype == torch.float32 and bool(torch.isfinite(decoded).all())


heads = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda method, target, version, headers: method + b" " + target + b" " + version + b"\r\n" + headers + b"\r\n\r\n",
              st.sampled_from([b"GET", b"HEAD", b"POST", b"get", b""]) | st.binary(max_size=8),
              st.sampled_from([b"/", b"/status.json", b"/metrics?x=1", b"status"]) | st.binary(max_size=30),
              st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2"]) | st.binary(max_size=10),
              st.binary(max_size=60)),
)


@SETTINGS
@given(heads)
def test_http_request_head_parses_or_is_a_bad_request(head):
    try:
        method, path = parse_request_head(head)
    except BadRequest:
        return
    assert method.isalpha() and method.isupper() and path.startswith("/") and "?" not in path
