"""The subspace boundary (issue #16, ``swarm.subspace``): what crosses is k numbers per token each way,
exactly, because every stage but the last keeps its residual stream in base + span(U)."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch

from dht.records import ModelSpec, RunSpec
from dht.wire import ProtocolError
from peer.bootstrap import build_run_spec
from peer.config import BootstrapConfig
from peer.memory_model import stage_memory_bytes, subspace_bytes
from swarm.boundary_codec import boundary_codec, compression_ratio
from swarm.model import RESIDUAL_PROJECTIONS, StageModel, initial_embeddings, next_token_loss
from swarm.stage import Stage
from swarm.stage_server import StageServer
from swarm.subspace import Subspace, SubspaceCodec, request_ids, stage_boundary_codec, subspace_of

CPU = torch.device("cpu")
GPT = RunSpec(run_id="sub", model=ModelSpec(d_model=32, num_layers=3, num_heads=2, seq_len=12, boundary_subspace=4),
              stage_layers=((0, 1), (1, 2), (2, 3)), microbatch_size=3, target_batch_size=1000)
LLAMA = dataclasses.replace(GPT, model=ModelSpec(family="llama", d_model=32, num_layers=3, num_heads=4, num_kv_heads=2,
                                                 seq_len=12, boundary_subspace=4))


def tokens(spec: RunSpec, seed: int = 0, extra: int = 0) -> torch.Tensor:
    return torch.randint(0, spec.model.vocab_size, (spec.microbatch_size, spec.model.seq_len + extra),
                         generator=torch.Generator().manual_seed(seed))


def off_subspace(x: torch.Tensor, subspace: Subspace, ids: torch.Tensor) -> float:
    """How far ``x`` is from base(ids) + span(U), relative to its size."""
    return float((subspace.lift(subspace.coordinates(x, ids), ids) - x).abs().max() / x.abs().max())


@pytest.mark.parametrize("spec", [GPT, LLAMA], ids=["gpt", "llama"])
def test_the_base_is_the_embedding_stage_0_is_built_with(spec):
    plain = dataclasses.replace(spec, model=dataclasses.replace(spec.model, boundary_subspace=0))
    model = StageModel(plain, 0)
    token_table, position_table = initial_embeddings(spec.model, spec.seed)
    assert torch.equal(token_table, model.tok_emb.weight.detach())
    if spec.model.family == "gpt":
        assert torch.equal(position_table, model.pos_emb.weight.detach())
    else:
        assert position_table is None


def test_the_basis_is_orthonormal_the_same_in_every_process_and_differs_by_seed():
    first, again = Subspace(GPT.model, 0), Subspace(GPT.model, 0)
    basis = first.tables(CPU)[0]
    assert basis.shape == (32, 4)
    torch.testing.assert_close(basis.T @ basis, torch.eye(4), atol=1e-6, rtol=0)
    assert torch.equal(basis, again.tables(CPU)[0])
    assert not torch.allclose(basis, Subspace(GPT.model, 1).tables(CPU)[0])
    assert subspace_of(GPT) is subspace_of(GPT.with_layout(1, ((0, 2), (2, 3))))  # one per process and run
    assert subspace_of(dataclasses.replace(GPT, model=dataclasses.replace(GPT.model, boundary_subspace=0))) is None


@pytest.mark.parametrize("spec", [GPT, LLAMA], ids=["gpt", "llama"])
def test_training_keeps_every_boundary_in_the_subspace_and_the_last_stage_free(spec):
    """Stages built and stepped as a swarm's are (AdamW, the projection at every publish): what stages 0
    and 1 send stays in base + span(U); without the projection it would not (the claim can fail)."""
    stages = [Stage(spec, index, device=CPU) for index in range(3)]
    subspace = subspace_of(spec)
    for step in range(4):
        ids = tokens(spec, seed=step, extra=1)
        hidden = [None, None]
        x = ids[:, :-1]
        for index, stage in enumerate(stages[:2]):
            x = stage.model(x)
            hidden[index] = x
        loss = next_token_loss(stages[2].model(x), ids[:, 1:])
        loss.backward()
        for stage in stages:
            stage._clip_and_step()
        for index in range(2):
            assert off_subspace(hidden[index].detach(), subspace, ids[:, :-1]) < 1e-5, (step, index)
    unprojected = StageModel(spec, 1)
    for module in unprojected.modules():  # a free copy of stage 1 after a step's worth of change
        if isinstance(module, torch.nn.Linear):
            module.weight.data += 0.05 * torch.randn_like(module.weight)
    x = stages[0].model(tokens(spec))
    assert off_subspace(unprojected(x).detach(), subspace, tokens(spec)) > 1e-2
    writer = next(m for name, m in stages[2].model.blocks[0].named_modules()
                  if name.rsplit(".", 1)[-1] in RESIDUAL_PROJECTIONS[spec.model.family])
    basis = subspace.tables(CPU)[0]
    assert float((writer.weight - basis @ (basis.T @ writer.weight)).abs().max()) > 1e-3  # the last stage is free
    for stage in stages:
        stage.shutdown()


def test_the_codec_carries_k_numbers_per_token_each_way_and_the_backward_is_the_forward_maps_adjoint():
    codec = stage_boundary_codec(GPT)
    subspace = subspace_of(GPT)
    stage0 = Stage(GPT, 0, device=CPU)
    ids = tokens(GPT, extra=1)
    x = stage0.model(ids[:, :-1]).detach()
    wire = codec.encode_activations(x, ids)
    assert [tuple(t.shape) for t in wire] == [(3, 12, 4)] and wire[0].dtype == torch.float32
    decoded = codec.decode_activations(wire, ids, shape=tuple(x.shape), dtype=torch.float32)
    torch.testing.assert_close(decoded, x, atol=1e-5, rtol=0)  # lossless for what a projected stage sends
    gradient = torch.randn(x.shape)
    back = codec.encode(gradient)
    assert [tuple(t.shape) for t in back] == [(3, 12, 4)]
    lifted = codec.decode(back, shape=tuple(x.shape), dtype=torch.float32)
    # d/dx of <lift(c), g> through c = Uᵀ(x − base) is U Uᵀ g: the gradient the upstream stage gets
    basis = subspace.tables(CPU)[0]
    torch.testing.assert_close(lifted, gradient @ basis @ basis.T, atol=1e-6, rtol=1e-5)
    c = torch.randn(3, 12, 4)
    assert float(((subspace.lift(c) * gradient).sum() - (c * subspace.reduce(gradient)).sum()).abs()) < 1e-3
    stage0.shutdown()


def test_an_int8_subspace_boundary_compresses_at_least_32x_and_round_trips_within_int8s_bound():
    spec = dataclasses.replace(GPT, boundary_codec="int8",
                               model=dataclasses.replace(GPT.model, d_model=128, num_heads=4, boundary_subspace=8))
    codec = stage_boundary_codec(spec)
    assert isinstance(codec, SubspaceCodec) and codec.name == "int8" and codec.num_wire_tensors == 2
    shape = (16, 64, 128)
    assert compression_ratio(codec, shape) == pytest.approx(4 * 128 / (8 + 4 * 8 / 64))  # 60.2x
    ids = tokens(spec, extra=1)
    stage0 = Stage(spec, 0, device=CPU)
    x = stage0.model(ids[:, :-1]).detach()
    wire = codec.encode_activations(x, ids)
    assert sum(t.numel() * t.element_size() for t in wire) == codec.wire_bytes(tuple(x.shape))
    coordinates = subspace_of(spec).coordinates(x, ids[:, :-1])
    error = codec.decode_activations(wire, ids, shape=tuple(x.shape), dtype=torch.float32) - x
    assert float(error.norm(dim=-1).max()) <= float(coordinates.abs().max()) / 254 * math.sqrt(8) * 1.01
    stage0.shutdown()


def test_hostile_subspace_wire_is_refused():
    codec = stage_boundary_codec(GPT)
    ids = tokens(GPT, extra=1)
    with pytest.raises(ProtocolError, match="must be float32\\[3, 12, 4\\]"):  # full-width activations
        codec.decode_activations([torch.zeros(3, 12, 32)], ids, shape=(3, 12, 32), dtype=torch.float32)
    with pytest.raises(ProtocolError, match="NaN or Inf"):
        codec.decode_activations([torch.full((3, 12, 4), math.nan)], ids, shape=(3, 12, 32), dtype=torch.float32)
    wide = dataclasses.replace(GPT, model=dataclasses.replace(GPT.model, d_model=18, boundary_subspace=16))
    basis = subspace_of(wide).tables(CPU)[0]
    assert float(basis[0].abs().sum()) > 1.5  # so coordinates at float32's maximum lift past it
    overflowing = (torch.finfo(torch.float32).max * torch.sign(basis[0])).expand(3, 12, 16)
    with pytest.raises(ProtocolError, match="lifted from the subspace"):  # finite coordinates that overflow
        stage_boundary_codec(wide).decode([overflowing.contiguous()], shape=(3, 12, 18), dtype=torch.float32)


def test_the_stage_server_takes_the_window_and_refuses_bare_targets():
    spec = dataclasses.replace(GPT, stage_layers=((0, 2), (2, 3)))
    server = StageServer(None, Stage(spec, 1, device=CPU), peer_id="me", router=None, request_timeout=5,
                         max_payload_bytes=1 << 20)
    window = tokens(spec, extra=1)
    inputs, targets = window[:, :-1], window[:, 1:]
    ids = request_ids(spec, inputs, targets)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), window)
    x = Stage(spec, 0, device=CPU).model(inputs).detach()
    wire = [*server.codec.encode_activations(x, ids), ids]
    decoded, got = server._check_forward_tensors(wire, 3)
    torch.testing.assert_close(decoded, x, atol=1e-5, rtol=0)
    assert torch.equal(got, ids)
    with pytest.raises(ProtocolError, match="targets must be int32\\[3, 13\\]"):
        server._check_forward_tensors([wire[0], targets], 3)
    with pytest.raises(ProtocolError, match="targets must be int32"):  # the window, but int64
        server._check_forward_tensors([wire[0], ids.long()], 3)
    hostile = ids.clone()
    hostile[0, 0] = spec.model.vocab_size  # an id outside the vocabulary would index past the base table
    with pytest.raises(ProtocolError, match="outside the vocabulary"):
        server._check_forward_tensors([wire[0], hostile], 3)

    async def answer():
        return await server._process_forward({"mb_id": "m", "route": [["up", 0, 0]], "batch_size": 3}, wire)
    reply, reply_tensors = asyncio.run(answer())
    expected = next_token_loss(server.stage.model(x), targets)
    assert reply["ok"] and reply["loss"] == pytest.approx(float(expected), rel=1e-5)  # scored on the window's targets
    assert [tuple(t.shape) for t in reply_tensors] == [(3, 12, 4)]  # the gradient: k numbers per token
    server.stage.shutdown()


def test_the_bootstrap_sets_the_subspace_and_refuses_one_as_wide_as_the_model():
    spec = build_run_spec(BootstrapConfig(boundary_subspace=8, boundary_codec="int8"))
    assert spec.model.boundary_subspace == 8 and "8-dimensional boundary" in spec.describe()
    assert RunSpec.from_wire(spec.to_wire()) == spec
    assert "boundary_subspace" not in build_run_spec(BootstrapConfig()).to_wire()["model"]  # old specs hash as before
    with pytest.raises(ValueError, match="--boundary-subspace must be below the model's d_model \\(128\\)"):
        build_run_spec(BootstrapConfig(boundary_subspace=128))
    with pytest.raises(ValueError, match="--boundary-subspace must be 0"):
        BootstrapConfig(boundary_subspace=-1)


def test_the_memory_model_counts_the_tables_every_stage_holds():
    plain = dataclasses.replace(GPT, model=dataclasses.replace(GPT.model, boundary_subspace=0))
    extra = 4 * (256 + 12 + 4) * 32
    assert subspace_bytes(GPT.model) == extra and subspace_bytes(plain.model) == 0
    for stage in range(3):
        assert stage_memory_bytes(GPT, stage, max_in_flight=2) - stage_memory_bytes(plain, stage, max_in_flight=2) == extra
    assert boundary_codec("none").wire_bytes((1, 2, 3)) == 24
