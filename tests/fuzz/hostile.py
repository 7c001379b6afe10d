"""Seeded generators of malformed and hostile messages for every handler a peer serves.

A message is the raw bytes a hostile peer writes on a stream; :attr:`Hostile.complete` says
whether it is a whole frame (length prefix, header and every tensor byte it announces, or a
length prefix the peer refuses on sight), which the peer must answer with a refusal, or a frame
cut short, which the peer cannot answer and must drop when the sender hangs up.

Every message carries at least one defect, so a peer that accepts one has a bug. Strategies are
taken in turn (round robin) from a fixed list, with their details drawn from ``random.Random(seed)``:
the same seed gives the same bytes on every machine, so a failure in CI reproduces exactly
(hypothesis is used in-process in ``test_fuzz_decoders.py``, where shrinking pays; here the
messages cross a real network to a real peer, where a seeded stream is what can be replayed).
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from dht.records import RunSpec
from dht.wire import MAX_DIMS, MAX_HEADER_BYTES, MAX_TENSORS

_LENGTH = struct.Struct(">I")
MISSING = object()  # a field left out of the header
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8}


@dataclass(frozen=True)
class Hostile:
    strategy: str
    data: bytes
    complete: bool


@dataclass(frozen=True)
class Target:
    """What the fuzzed peer serves: its run spec and stage (to build near-valid requests)."""

    spec: RunSpec
    stage: int
    peer_ids: tuple[str, ...]  # plausible peer ids for routes


def frame(header: Any, tensors: list[tuple[str, list[int], bytes]] = (), *, raw_header: bytes | None = None) -> bytes:
    """A frame of ``dht.wire``: the header (with its "tensors" list) and the tensor bytes as given."""
    if raw_header is None:
        if isinstance(header, dict):
            header = {k: v for k, v in header.items() if v is not MISSING}
            if tensors:
                header["tensors"] = [[dtype, shape] for dtype, shape, _ in tensors]
        raw_header = msgpack.packb(header, use_bin_type=True)
    return _LENGTH.pack(len(raw_header)) + raw_header + b"".join(data for _, _, data in tensors)


def _tensor(dtype: str, shape: list[int], values: bytes | None = None, *, rng: random.Random) -> tuple[str, list[int], bytes]:
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    return dtype, shape, values if values is not None else rng.randbytes(nbytes)


def _finite_floats(count: int, rng: random.Random) -> bytes:
    return struct.pack(f"<{count}f", *(rng.uniform(-3, 3) for _ in range(count)))


def _tokens(count: int, rng: random.Random, *, vocab: int) -> bytes:
    return struct.pack(f"<{count}q", *(rng.randrange(vocab) for _ in range(count)))


# ---------------------------------------------------------------- framing, for every handler

def random_bytes(rng: random.Random) -> Hostile:
    data = rng.randbytes(rng.randrange(0, 300))
    if len(data) >= 4 and _LENGTH.unpack(data[:4])[0] <= MAX_HEADER_BYTES:
        data = b"\xff" + data[1:]  # a plausible length would make it a cut-short frame: keep it whole
    return Hostile("random bytes", data, complete=len(data) >= 4)


def oversized_length(rng: random.Random) -> Hostile:
    claim = rng.choice([MAX_HEADER_BYTES + 1, 1 << 20, 1 << 30, (1 << 31) + 7, (1 << 32) - 1])
    return Hostile("header length claiming up to 4 GiB", _LENGTH.pack(claim) + rng.randbytes(rng.randrange(0, 64)), True)


def truncated_prefix(rng: random.Random) -> Hostile:
    return Hostile("length prefix cut short", rng.randbytes(rng.randrange(0, 4)), complete=False)


def truncated_header(rng: random.Random) -> Hostile:
    packed = msgpack.packb({"x": rng.randbytes(rng.randrange(1, 200))})
    cut = rng.randrange(0, len(packed))
    return Hostile("header cut short", _LENGTH.pack(len(packed)) + packed[:cut], complete=False)


def garbage_msgpack(rng: random.Random) -> Hostile:
    body = rng.choice([
        lambda: rng.randbytes(rng.randrange(1, 200)),
        lambda: b"\xc1" * rng.randrange(1, 8),  # never-used msgpack byte
        lambda: b"\x91" * 2000 + b"\xc0",  # arrays nested 2,000 deep
        lambda: b"\xdb\xff\xff\xff\xff",  # str32 claiming 4 GiB inside a 5-byte header
        lambda: b"\xc6\xff\xff\xff\xf0" + b"x" * 16,  # bin32 claiming 4 GiB
        lambda: b"\xdd\x7f\xff\xff\xff",  # array32 claiming 2**31 items
        lambda: b"\xdf\x7f\xff\xff\xff",  # map32 claiming 2**31 pairs
        lambda: b"\xd7\xff" + rng.randbytes(8),  # timestamp ext with random bits
        lambda: b"\xc7\x05\xff" + rng.randbytes(5),  # timestamp ext of an invalid length
    ])()
    return Hostile("valid length, garbage msgpack", frame(None, raw_header=body), complete=True)


def not_a_map(rng: random.Random) -> Hostile:
    value = rng.choice([[1, 2, 3], "status", 42, None, True, 1.5, b"\x00" * 8, [[["nested"]]],
                        msgpack.ExtType(0x50, b"\x93\x00\x00\x90"), msgpack.ExtType(0x51, b"\x80")])
    return Hostile("msgpack that is not a map", frame(value), complete=True)


def extra_data(rng: random.Random) -> Hostile:
    body = msgpack.packb({"want": "status"}) + msgpack.packb(rng.randrange(1 << 30))
    return Hostile("a map followed by extra data", frame(None, raw_header=body), complete=True)


def non_string_keys(rng: random.Random) -> Hostile:
    body = rng.choice([b"\x81\x01\x02", b"\x81\xc0\x02", b"\x81\x91\x01\x02", b"\x81\xc4\x01x\x02"])  # int/nil/array/bin key
    return Hostile("map with non-string keys", frame(None, raw_header=body), complete=True)


def bad_tensor_list(rng: random.Random) -> Hostile:
    described = rng.choice([
        "float32", 7, {"a": 1}, [["float32"]], [["float64", [1]]], [["uint8", [4]]], [["object", [1]]],
        [["float32", [-1]]], [["float32", [True]]], [["float32", [1.5]]], [["float32", "4"]],
        [["float32", [1] * (MAX_DIMS + 1)]], [["int64", [0]]] * (MAX_TENSORS + 1), [[None, None]],
        [["float32", [1], "extra"]],
    ])
    header = msgpack.packb({"want": "status", "kind": "leave", "tensors": described})
    return Hostile("malformed tensor descriptions", frame(None, raw_header=header), complete=True)


def payload_over_limit(rng: random.Random) -> Hostile:
    shape = rng.choice([[1 << 31, 1 << 31], [(1 << 64) - 1], [1 << 20, 1 << 20, 1 << 20], [1 << 28, 4]])
    header = msgpack.packb({"kind": "leave", "tensors": [["float32", shape]]})
    return Hostile("tensors claiming GiBs to EiBs", frame(None, raw_header=header) + rng.randbytes(64), complete=True)


def tensor_bytes_cut_short(rng: random.Random) -> Hostile:
    shape = [rng.randrange(1, 64)]
    data = rng.randbytes(shape[0] * 4 - rng.randrange(1, 4 * shape[0] + 1))
    header = msgpack.packb({"kind": "leave", "want": "status", "tensors": [["float32", shape]]})
    # a peer that accepts no tensor bytes refuses it from the header alone; one that does waits for them
    return Hostile("tensor bytes cut short", frame(None, raw_header=header) + data, complete=None)


FRAMING: list[Callable[[random.Random], Hostile]] = [
    random_bytes, oversized_length, truncated_prefix, truncated_header, garbage_msgpack, not_a_map,
    extra_data, non_string_keys, bad_tensor_list, payload_over_limit, tensor_bytes_cut_short,
]

WRONG_VALUES = [MISSING, None, True, False, -1, 1.5, math.nan, "", "x" * 300, b"\x00\x01", [], [1, 2], {"a": 1},
                (1 << 64) - 1, -(1 << 63)]


def _one_of(rng: random.Random, *values: Any) -> Any:
    return rng.choice([*values, *WRONG_VALUES])


# ---------------------------------------------------------------- handler by handler

class Headers:
    """Near-valid requests for one handler with at least one defect each (``bad_*`` methods)."""

    def __init__(self, target: Target, rng: random.Random) -> None:
        self.target, self.rng = target, rng
        self.spec = target.spec

    # forward (rpc_forward): refused before any compute
    def forward_base(self, batch_size: int = 1) -> tuple[dict, list]:
        rng, spec, stage = self.rng, self.spec, self.target.stage
        route = [[rng.choice(self.target.peer_ids), hop, rng.randrange(1000)] for hop in range(stage)]
        seq, width = spec.model.seq_len, spec.model.d_model
        shape = [batch_size, seq] if stage == 0 else [batch_size, seq, width]
        values = (_tokens(math.prod(shape), rng, vocab=spec.model.vocab_size) if stage == 0
                  else _finite_floats(math.prod(shape), rng))
        activations = _tensor("int64" if stage == 0 else "float32", shape, values, rng=rng)
        targets = _tensor("int64", [batch_size, seq], _tokens(batch_size * seq, rng, vocab=spec.model.vocab_size), rng=rng)
        header = {"mb_id": f"fuzz-{rng.randrange(1 << 40):x}", "route": route, "batch_size": batch_size}
        return header, [activations, targets]

    def bad_forward_header(self) -> tuple[str, bytes]:
        rng = self.rng
        header, tensors = self.forward_base()
        field = rng.choice(["mb_id", "batch_size", "route", "hop", "version", "hops", "extra"])
        if field == "mb_id":
            header["mb_id"] = rng.choice([w for w in WRONG_VALUES if not (isinstance(w, str) and 1 <= len(w) <= 128)])
        elif field == "batch_size":
            header["batch_size"] = rng.choice([0, -1, self.spec.microbatch_size + 1, 1 << 40, True, 1.5, "1", None, MISSING])
        elif field == "route":
            header["route"] = rng.choice([MISSING, None, "route", 7, {}, [[]], [None]])
        elif field == "hop":
            hop = [rng.choice(self.target.peer_ids), 0, 0]
            header["route"] = [rng.choice([hop[:2], hop + [1], [1, 0, 0], [None, 0, 0], "hop", [hop[0], 1, 0],
                                           [hop[0], -1, 0], [hop[0], "0", 0]])]
        elif field == "version":  # forged versions of an earlier hop
            header["route"] = [[rng.choice(self.target.peer_ids), 0, rng.choice([-1, -(1 << 63), 1.5, "7", None, [], math.inf])]]
        elif field == "hops":  # the wrong number of hops for this stage
            n = rng.choice([0, 2, 3, 65, 1000])
            header["route"] = [[rng.choice(self.target.peer_ids), k, 0] for k in range(n)]
        else:  # unknown fields are ignored (forward compatibility): paired with a missing field
            header[f"x-{rng.randrange(100)}"] = rng.choice(WRONG_VALUES[1:])
            del header[rng.choice(["mb_id", "route", "batch_size"])]
        return f"forward header: {field}", frame(header, tensors)

    def bad_forward_tensors(self) -> tuple[str, bytes]:
        rng, spec = self.rng, self.spec
        batch = rng.choice([1, 2])
        header, (activations, targets) = self.forward_base(batch)
        dtype, shape, data = activations
        kind = rng.choice(["nan", "inf", "oov", "dtype", "shape", "targets dtype", "missing", "batch mismatch"])
        if kind in ("nan", "inf"):
            values = bytearray(data)
            bad = struct.pack("<f", math.nan if kind == "nan" else rng.choice([math.inf, -math.inf]))
            for _ in range(rng.randrange(1, 4)):
                at = 4 * rng.randrange(len(values) // 4)
                values[at:at + 4] = bad
            if dtype == "int64":  # stage 0 takes token ids: NaN cannot be sent, out-of-vocabulary can
                values = bytearray(struct.pack("<q", -5)) + values[8:]
            activations = (dtype, shape, bytes(values))
        elif kind == "oov":
            values = bytearray(targets[2])
            at = 8 * rng.randrange(len(values) // 8)
            values[at:at + 8] = struct.pack("<q", rng.choice([spec.model.vocab_size, 1 << 40, -1, -(1 << 63)]))
            targets = (targets[0], targets[1], bytes(values))
        elif kind == "dtype":
            new = rng.choice(["float16", "bfloat16", "int64"] if dtype == "float32" else ["float32", "float16"])
            activations = _tensor(new, shape, rng=rng)
        elif kind == "shape":
            new = list(shape)
            new[rng.randrange(len(new))] += rng.choice([-1, 1, 7])
            new = rng.choice([new, new[:-1], [*shape, 1], [math.prod(shape)]])
            activations = _tensor(dtype, [max(d, 0) for d in new], rng=rng)
        elif kind == "targets dtype":
            targets = _tensor(rng.choice(["float32", "float16"]), targets[1], rng=rng)
        elif kind == "missing":
            return "forward tensors: missing", frame(header, rng.choice([[], [activations], [targets]]))
        else:
            header["batch_size"] = batch + 1 if batch < self.spec.microbatch_size else batch - 1
        return f"forward tensors: {kind}", frame(header, [activations, targets])

    # membership (rpc_notify)
    def bad_notice(self) -> tuple[str, bytes]:
        rng = self.rng
        if rng.random() < 0.2:  # a real kind with tensor bytes, which notices never carry
            return "notice with tensors", frame({"kind": "leave"}, [_tensor("float32", [rng.randrange(1, 16)], rng=rng)])
        kind = rng.choice(["join", "LEAVE", "leave ", "leave\x00", "crash", "ban", "stage", "*", "\u202eevael", *WRONG_VALUES])
        header = {"kind": kind}
        if rng.random() < 0.3:
            header["peer_id"] = rng.choice(self.target.peer_ids)  # trying to speak for another peer
        return "unknown notice kind", frame(header)

    # status (/murmuration/status/1.0.0)
    def bad_status(self) -> tuple[str, bytes]:
        rng = self.rng
        if rng.random() < 0.2:
            return "status request with tensors", frame({"want": "status"}, [_tensor("int64", [rng.randrange(1, 16)], rng=rng)])
        want = rng.choice(["Status", "status ", "everything", "metrics", "keys", b"status", ["status"], *WRONG_VALUES])
        return "unknown status request", frame({"want": want, "version": rng.randrange(5)})

    # replication: manifest, shard, probe
    def _stage_or_wrong(self) -> Any:
        return self.rng.choice([self.target.stage + 1, -1, 1 << 40, True, False, str(self.target.stage), None, MISSING, 1.0])

    def _shard_bytes_or_wrong(self) -> Any:
        return self.rng.choice([0, 1, 4095, (1 << 30) + 1, 1 << 62, -4096, True, 4096.0, "65536", None, MISSING])

    def bad_manifest(self) -> tuple[str, bytes]:
        rng = self.rng
        header = {"stage": self.target.stage, "shard_bytes": rng.choice([4096, 65536, 1 << 20])}
        field = rng.choice(["stage", "shard_bytes", "version"])
        if field == "stage":
            header["stage"] = self._stage_or_wrong()
        elif field == "shard_bytes":
            header["shard_bytes"] = self._shard_bytes_or_wrong()
        else:  # pinning a version this peer never held, or no version at all
            header["version"] = rng.choice([rng.randrange(10**9, 1 << 62), -1, -(1 << 63), "3", 1.5, True, [], math.nan])
        return f"manifest: {field}", frame(header)

    def bad_shard(self) -> tuple[str, bytes]:
        rng = self.rng
        header = {"stage": self.target.stage, "version": rng.randrange(10**9, 1 << 62),
                  "shard_bytes": rng.choice([4096, 65536]), "index": rng.randrange(4), "count": rng.choice([MISSING, 1, 2])}
        field = rng.choice(["stage", "version", "shard_bytes", "index", "count", "too many bytes"])
        if field == "stage":
            header["stage"] = self._stage_or_wrong()
        elif field == "version":
            header["version"] = rng.choice([-1, -(1 << 63), "0", 0.0, None, MISSING, True, [0]])
        elif field == "shard_bytes":
            header["shard_bytes"] = self._shard_bytes_or_wrong()
        elif field == "index":
            header["index"] = rng.choice([-1, (1 << 63) - 1, 1 << 62, "0", 0.5, None, MISSING, True])
        elif field == "count":
            header["count"] = rng.choice([0, -1, (1 << 20) + 1, 1 << 62, True, 2.0, "2"])
        else:
            header["count"], header["shard_bytes"] = 1 << 20, 1 << 20  # 1 TiB in one reply
        return f"shard: {field}", frame(header)

    def bad_probe(self) -> tuple[str, bytes]:
        rng = self.rng
        nbytes = rng.choice([-1, (4 << 20) + 1, 1 << 32, (1 << 64) - 1, -(1 << 63), True, 1.5, "1024", None, MISSING, [], math.inf])
        return "probe: nbytes", frame({"nbytes": nbytes})


def handler_strategies(kind: str, target: Target, rng: random.Random) -> list[Callable[[], Hostile]]:
    """The strategies for one kind of handler: framing attacks, then near-valid requests with a defect.

    ``kind``: forward, membership, status, manifest, shard or probe.
    """
    headers = Headers(target, rng)
    specific = {
        "forward": [headers.bad_forward_header, headers.bad_forward_tensors, headers.bad_forward_tensors],
        "membership": [headers.bad_notice, headers.bad_notice],
        "status": [headers.bad_status, headers.bad_status],
        "manifest": [headers.bad_manifest, headers.bad_manifest],
        "shard": [headers.bad_shard, headers.bad_shard],
        "probe": [headers.bad_probe, headers.bad_probe],
    }[kind]
    accepts_tensors = kind == "forward"

    def framed(strategy: Callable[[random.Random], Hostile]) -> Callable[[], Hostile]:
        def make() -> Hostile:
            message = strategy(rng)
            if message.complete is None:  # cut-short tensor bytes: whole only where no tensor is allowed
                return Hostile(message.strategy, message.data, complete=not accepts_tensors)
            return message
        return make

    def near_valid(strategy: Callable[[], tuple[str, bytes]]) -> Callable[[], Hostile]:
        def make() -> Hostile:
            name, data = strategy()
            return Hostile(name, data, complete=True)
        return make

    return [framed(s) for s in FRAMING] + [near_valid(s) for s in specific] * 3


def hostile_messages(kind: str, target: Target, *, seed: int) -> Iterator[Hostile]:
    """An endless, reproducible stream of hostile messages for one kind of handler."""
    rng = random.Random(f"{seed}:{kind}")
    strategies = handler_strategies(kind, target, rng)
    while True:
        for strategy in strategies:
            yield strategy()


# ---------------------------------------------------------------- the HTTP status port

def http_messages(*, seed: int) -> Iterator[tuple[str, bytes]]:
    """An endless, reproducible stream of requests the status port must answer with a 4xx."""
    rng = random.Random(f"{seed}:http")
    path = lambda: rng.choice(["/", "/status.json", "/metrics", "/x"])
    strategies: list[Callable[[], tuple[str, bytes]]] = [
        lambda: ("random bytes", rng.randbytes(rng.randrange(1, 200)).replace(b"\r\n\r\n", b"") + b"\r\n\r\n"),
        lambda: ("TLS hello", b"\x16\x03\x01\x00\xa5" + rng.randbytes(60) + b"\r\n\r\n"),
        lambda: ("bad request line", rng.choice([b"get / HTTP/1.1", b"GET / HTTP/9", b"GET /", b"GET status HTTP/1.1",
                                                 b"GET /\x00 HTTP/1.1", b"GET  / HTTP/1.1", b"GET / HTTP/1.1 x",
                                                 b"GET /" + b"a" * 3000 + b" HTTP/1.1", b"\xff\xfe / HTTP/1.1",
                                                 b"GETGETGETGETGETGETGET / HTTP/1.1"]) + b"\r\n\r\n"),
        lambda: ("bad header line", b"GET " + path().encode() + b" HTTP/1.1\r\n" + rng.choice(
            [b"Host", b"Host : x", b": x", b"X-\x00: y", b"Host: a\rb", b" folded: x", b"\x7f: y"]) + b"\r\n\r\n"),
        lambda: ("method not allowed", rng.choice([b"POST", b"PUT", b"DELETE", b"OPTIONS", b"CONNECT", b"TRACE"])
                 + b" " + path().encode() + b" HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"),
        lambda: ("head over 16 KiB", b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * rng.randrange(17_000, 40_000) + b"\r\n\r\n"),
        lambda: ("head cut short", b"GET " + path().encode() + b" HTTP/1.1\r\nHost: x" + b"\r\n" * rng.randrange(0, 2)),
        lambda: ("bare newlines", b"GET " + path().encode() + b" HTTP/1.1\n\n\r\n\r\n"),
    ]
    while True:
        for strategy in strategies:
            yield strategy()


# ---------------------------------------------------------------- DHT records

def garbage_peer_records(valid: dict[str, Any], *, seed: int) -> Iterator[tuple[str, Any]]:
    """Values a reader must drop: wrong types, and near-valid heartbeats with one field out of range."""
    rng = random.Random(f"{seed}:records")
    bad_fields = {
        "peer_id": ["", "x" * 200, 7, None], "role": ["admin", "", None, 1], "state": ["dead", None, 0],
        "stage": [-2, 64, 1 << 40, True, 1.5, "0"], "flops": [-1.0, math.nan, math.inf, 1e19, "fast", True],
        "samples_per_s": [-1.0, math.nan, 1e10], "num_samples": [-1, 1 << 63, 1.5, True],
        "version": [-1, 1 << 62, "1"], "loss": [math.inf, -math.inf, "low", True], "announced_at": [-1.0, math.nan, 1e12],
        "maddrs": ["/ip4/1.2.3.4", ["x"] * 17, [1], ["a" * 300]], "params_digest": [1, "d" * 200],
        "software_version": ["<script>", "x" * 40, 1], "bytes_sent": [-1, 1 << 62], "averaged_at": [math.inf],
        "peer_key": ["key", 1, b"k" * 1025], "peer_signature": ["sig", None, b"s" * 1025],
    }
    while True:
        if rng.random() < 0.3:
            yield "not a record", rng.choice([b"\x00" * rng.randrange(50), "peer", 1, None, [valid], 1.5, True,
                                              {"peer_id": valid["peer_id"]}, {"unknown": 1, **valid}])
            continue
        field = rng.choice(sorted(bad_fields))
        record = dict(valid)
        record[field] = rng.choice(bad_fields[field])
        yield f"peer record: {field}", record
