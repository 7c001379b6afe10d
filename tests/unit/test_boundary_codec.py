"""The boundary codecs (swarm/boundary_codec.py): every codec round-trips within the error its
docstring states, for every shape (empty and odd sizes included) and both compute dtypes; the bytes
on the wire are what ``wire_bytes`` says; hostile wire tensors are refused with ProtocolError before
anything is allocated; the run spec carries the codec, and the stage server and the router encode
and decode with it."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random

import pytest
import torch

from dht.records import BOUNDARY_CODECS, ModelSpec, RunSpec
from dht.wire import ProtocolError
from peer.bootstrap import prepare_run
from peer.config import BootstrapConfig
from swarm import router as router_module
from swarm.boundary_codec import INT8_BLOCK, boundary_codec, compression_ratio
from swarm.router import NoPeerAvailableError, Router
from swarm.stage import Stage
from swarm.stage_server import StageServer

SHAPES = [(0,), (1,), (63,), (64,), (65,), (3, 5, 7), (2, 16, 32)]
CODECS = [boundary_codec(name) for name in BOUNDARY_CODECS]


def wide(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Values over many binades (1e-9 .. 1e4, both signs, some exact zeros): activations and gradients alike."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-9, 5, shape, generator=g).float()
    return torch.where(torch.rand(shape, generator=g) < 0.05, torch.zeros(shape), values)


def error_bound(name: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per value, the bound the codec's docstring states, plus the receiver's rounding to ``dtype``."""
    x = x.double()
    top = x.abs().max() if x.numel() else torch.tensor(0.0, dtype=torch.float64)
    if name == "none":
        bound = torch.zeros_like(x)
    elif name == "bf16":
        bound = 2.0**-8 * x.abs() + 2.0**-134
    elif name == "fp16":
        bound = 2.0**-11 * x.abs() + 2.0**-39 * top
    else:
        flat = torch.nn.functional.pad(x.reshape(-1), (0, -x.numel() % INT8_BLOCK)).view(-1, INT8_BLOCK)
        block_top = flat.abs().amax(dim=1, keepdim=True).expand_as(flat).reshape(-1)[: x.numel()].reshape(x.shape)
        bound = block_top / 254 * (1 + 2.0**-20)
    if dtype == torch.bfloat16 and name != "none":
        bound = bound + 2.0**-8 * (x.abs() + bound)  # the bf16 rounding after decoding (of a value off by the bound)
    return bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("codec", CODECS, ids=BOUNDARY_CODECS)
def test_every_codec_round_trips_within_its_stated_error(codec, shape, dtype):
    x = wide(shape).to(dtype)
    wire = codec.encode(x)
    assert len(wire) == codec.num_wire_tensors
    assert sum(t.numel() * t.element_size() for t in wire) == codec.wire_bytes(shape, dtype)
    decoded = codec.decode(wire, shape=shape, dtype=dtype)
    assert decoded.shape == shape and decoded.dtype == dtype
    error = (decoded.double() - x.double()).abs()
    assert bool((error <= error_bound(codec.name, x.float(), dtype)).all()), float((error - error_bound(codec.name, x.float(), dtype)).max())


@pytest.mark.parametrize("codec", CODECS, ids=BOUNDARY_CODECS)
def test_zeros_and_tiny_gradients_survive(codec):
    zeros = torch.zeros(4, 100)
    assert torch.equal(codec.decode(codec.encode(zeros), shape=(4, 100), dtype=torch.float32), zeros)
    tiny = torch.randn(4, 100, generator=torch.Generator().manual_seed(1)) * 1e-9  # an activation gradient's scale
    decoded = codec.decode(codec.encode(tiny), shape=(4, 100), dtype=torch.float32)
    assert float((decoded - tiny).norm() / tiny.norm()) < 0.01  # plain fp16 would flush most of these to 0


def test_the_bounds_are_tight_enough_to_mean_something():
    x = torch.randn(16, 64, 128, generator=torch.Generator().manual_seed(2))
    relative = {c.name: float((c.decode(c.encode(x), shape=x.shape, dtype=torch.float32) - x).norm() / x.norm()) for c in CODECS}
    assert relative["none"] == 0.0
    assert 0 < relative["fp16"] < 3e-4 and 0 < relative["bf16"] < 3e-3 and 0 < relative["int8"] < 1.5e-2


def test_bytes_on_the_wire_per_microbatch():
    shape = (16, 64, 128)  # the default spec's activations per microbatch
    assert compression_ratio(boundary_codec("none"), shape) == 1.0
    assert compression_ratio(boundary_codec("none"), shape, torch.bfloat16) == 2.0
    assert compression_ratio(boundary_codec("bf16"), shape) == 2.0
    assert 1.999 < compression_ratio(boundary_codec("fp16"), shape) < 2.0
    assert compression_ratio(boundary_codec("int8"), shape) == pytest.approx(4 * 64 / 68)
    assert compression_ratio(boundary_codec("int8"), shape) > 3.7


# ---- hostile wire tensors ------------------------------------------------------------------------

def hostile_cases():
    shape = (2, 70)
    good = {c.name: c.encode(wide(shape, seed=3)) for c in CODECS}
    nan = torch.tensor([math.nan])
    yield "none", [good["none"][0].double()], "float32"
    yield "none", [good["none"][0].reshape(70, 2)], "float32"
    yield "none", [], "1 tensor"
    yield "none", [torch.full(shape, math.inf)], "NaN or Inf"
    yield "bf16", [good["bf16"][0].half()], "bfloat16"
    yield "bf16", [torch.full(shape, math.nan, dtype=torch.bfloat16)], "NaN or Inf"
    yield "fp16", [good["fp16"][0], nan], "scale"
    yield "fp16", [good["fp16"][0], torch.tensor([math.inf])], "scale"
    yield "fp16", [good["fp16"][0], torch.tensor([-1.0])], "scale"
    yield "fp16", [good["fp16"][0], torch.tensor([0.0])], "scale"
    yield "fp16", [good["fp16"][0], torch.tensor([1e38])], "NaN or Inf"  # finite parts, infinite product
    yield "fp16", [good["fp16"][0], torch.tensor([1.0, 1.0])], "float32[1]"
    yield "fp16", [good["fp16"][0]], "2 tensor"
    yield "int8", [good["int8"][0], good["int8"][1].double()], "float32"
    yield "int8", [good["int8"][0][:-1], good["int8"][1]], "int8[140]"
    yield "int8", [good["int8"][0].to(torch.int64), good["int8"][1]], "int8"
    yield "int8", [good["int8"][0], good["int8"][1][:2]], "float32[3]"
    yield "int8", [good["int8"][0], torch.tensor([1.0, nan.item(), 1.0])], "scales"
    yield "int8", [good["int8"][0], torch.tensor([1.0, -1.0, 1.0])], "scales"
    yield "int8", [good["int8"][0], torch.tensor([1.0, math.inf, 1.0])], "scales"
    yield "int8", [torch.full((140,), 127, dtype=torch.int8), torch.full((3,), 3e36)], "NaN or Inf"
    yield "int8", [torch.full((140,), -128, dtype=torch.int8), good["int8"][1]], "-128"
    yield "int8", [*good["int8"], good["int8"][1]], "2 tensor"
    # a wire tensor claiming a huge shape (meta: no memory behind it) is refused by its shape alone
    yield "int8", [torch.empty(2**40, dtype=torch.int8, device="meta"), good["int8"][1]], "int8[140]"
    yield "none", [torch.empty(2**20, 2**20, device="meta")], "float32[2, 70]"


@pytest.mark.parametrize("name, wire, message", list(hostile_cases()))
def test_hostile_wire_tensors_are_refused_with_a_protocol_error(name, wire, message):
    with pytest.raises(ProtocolError) as caught:
        boundary_codec(name).decode(wire, shape=(2, 70), dtype=torch.float32)
    assert message in str(caught.value)


@pytest.mark.parametrize("codec", CODECS, ids=BOUNDARY_CODECS)
def test_non_finite_inputs_encode_to_what_the_receiver_refuses(codec):
    x = wide((3, 40))
    x[1, 7] = math.nan
    with pytest.raises(ProtocolError, match="NaN or Inf|scale"):
        codec.decode(codec.encode(x), shape=(3, 40), dtype=torch.float32)


# ---- the run spec carries the codec --------------------------------------------------------------

def test_the_codec_is_a_run_property_left_off_the_wire_when_none():
    spec = RunSpec(run_id="c")
    assert spec.boundary_codec == "none" and "boundary_codec" not in spec.to_wire()  # older peers read it as before
    int8 = dataclasses.replace(spec, boundary_codec="int8")
    assert int8.to_wire()["boundary_codec"] == "int8" and RunSpec.from_wire(int8.to_wire()) == int8
    assert "int8 at stage boundaries" in int8.describe() and "boundaries" not in spec.describe()
    with pytest.raises(ValueError, match="boundary_codec must be one of none, bf16, fp16, int8"):
        RunSpec(run_id="c", boundary_codec="zip")
    with pytest.raises(ValueError, match="--boundary-codec must be one of"):
        BootstrapConfig(boundary_codec="int4")
    with pytest.raises(ValueError, match="boundary codec must be one of"):
        boundary_codec("int4")
    assert prepare_run(BootstrapConfig(boundary_codec="fp16"))[0].boundary_codec == "fp16"


SPEC = RunSpec(run_id="c", model=ModelSpec(d_model=16, num_layers=2, num_heads=2, seq_len=8), stage_layers=((0, 1), (1, 2)),
               microbatch_size=2, target_batch_size=4, boundary_codec="int8")


def last_stage_server(spec: RunSpec) -> StageServer:
    return StageServer(None, Stage(spec, 1, device=torch.device("cpu")), peer_id="me", router=None, request_timeout=5,
                       max_payload_bytes=1 << 20)


def test_the_stage_server_decodes_with_the_runs_codec_and_refuses_another_runs():
    activations, targets = wide((2, 8, 16), seed=4), torch.randint(0, 256, (2, 8))
    int8_server, plain_server = last_stage_server(SPEC), last_stage_server(dataclasses.replace(SPEC, boundary_codec="none"))
    wire = [*boundary_codec("int8").encode(activations), targets]
    decoded, got_targets = int8_server._check_forward_tensors(wire, 2)
    assert torch.equal(got_targets, targets) and (decoded - activations).abs().max() <= activations.abs().max() / 254 * 1.001
    with pytest.raises(ProtocolError, match="carries 2 tensors .*none boundary codec.*got 3"):
        plain_server._check_forward_tensors(wire, 2)  # a peer of the same run id under another codec
    with pytest.raises(ProtocolError, match="carries 3 tensors .*int8 boundary codec.*got 2"):
        int8_server._check_forward_tensors([activations, targets], 2)

    async def answer():
        return await int8_server._process_forward({"mb_id": "m", "route": [["up", 0, 0]], "batch_size": 2}, wire)
    reply, reply_tensors = asyncio.run(answer())
    assert reply["ok"] and len(reply_tensors) == 2 and reply_tensors[0].dtype == torch.int8  # the gradient, encoded
    int8_server.stage.shutdown()
    plain_server.stage.shutdown()


class _View:
    def members(self, stage):
        return []

    def is_gone(self, peer_id):
        return False


def test_the_router_sends_encoded_activations_and_returns_the_decoded_gradient(monkeypatch):
    codec = boundary_codec("int8")
    activations, targets = wide((2, 8, 16), seed=5), torch.randint(0, 256, (2, 8))
    gradient = wide((2, 8, 16), seed=6) * 1e-6
    sent = []

    async def fake_call(p2p, peer_id, handler, header, tensors, *, timeout, max_payload_bytes, stripes=1):
        sent.append(list(tensors))
        return {"ok": True, "loss": 1.0, "route": header["route"]}, answers.pop(0)

    monkeypatch.setattr(router_module, "call_peer", fake_call)
    router = Router(None, _View(), run_id="c", next_stage=1, next_stage_flops=1.0, request_timeout=5,
                    max_payload_bytes=1 << 20, rng=random.Random(0), codec=codec)
    header = {"mb_id": "m", "route": [["me", 0, 0]], "batch_size": 2, "path": ["next"]}
    answers = [codec.encode(gradient), [codec.encode(gradient)[0], torch.tensor([math.nan, 1.0, 1.0, 1.0])]]
    reply, tensors = asyncio.run(router.forward(header, [activations, targets]))
    assert [t.dtype for t in sent[0]] == [torch.int8, torch.float32, torch.int64] and torch.equal(sent[0][2], targets)
    assert len(tensors) == 1 and tensors[0].shape == activations.shape and tensors[0].dtype == torch.float32
    assert (tensors[0] - gradient).abs().max() <= gradient.abs().max() / 254 * 1.001
    with pytest.raises(NoPeerAvailableError, match="malformed gradient.*scales"):
        asyncio.run(router.forward(header, [activations, targets]))
    assert len(sent) == 2  # a gradient that does not decode is not sent to another replica (it was counted there)
