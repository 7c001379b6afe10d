"""A microbatch through two stages served over real hivemind P2P, checked against local autograd."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random

import pytest
import torch

from dht.records import ModelSpec, PeerRecord, RunSpec
from dht.registry import declare_peer
from swarm.data import TokenSampler, load_corpus
from swarm.flow_control import FlowWindow
from swarm.model import StageModel, activation_dtype, next_token_loss, stage_forward
from swarm.router import NoPeerAvailableError, Router
from dht.rpc import RemoteError, call_peer, forward_handler
from swarm.stage import Stage
from swarm.stage_server import StageServer
from swarm.subspace import stage_boundary_codec, subspace_of
from swarm.trainer import Trainer
from swarm.view import SwarmView

SPEC = RunSpec(run_id="itest", model=ModelSpec(d_model=32, num_layers=2, num_heads=2, seq_len=16),
               stage_layers=((0, 1), (1, 2)), microbatch_size=4, target_batch_size=1000)
CPU = torch.device("cpu")
MAX_PAYLOAD = 1 << 24


def sampler() -> TokenSampler:
    return TokenSampler(load_corpus(SPEC.dataset).text(), seq_len=SPEC.model.seq_len, seed=3)


async def serve_last_stage(dht, validator, spec: RunSpec = SPEC) -> tuple[Stage, StageServer, str]:
    p2p = await dht.replicate_p2p()
    peer_id = dht.peer_id.to_base58()
    stage = Stage(spec, 1, device=CPU)
    server = StageServer(p2p, stage, peer_id=peer_id, router=None, request_timeout=10, max_payload_bytes=MAX_PAYLOAD)
    await server.start()
    record = PeerRecord(peer_id=peer_id, role="reliable", state="training", stage=1, flops=1e9)
    assert await declare_peer(dht, validator, SPEC.run_id, record, ttl=60)
    return stage, server, peer_id


async def first_stage_trainer(dht, spec: RunSpec = SPEC) -> tuple[Stage, Trainer, Router]:
    p2p = await dht.replicate_p2p()
    view = SwarmView(dht, spec.run_id)
    await view.refresh()
    router = Router(p2p, view, run_id=spec.run_id, next_stage=1, next_stage_flops=1.0, request_timeout=10,
                    max_payload_bytes=MAX_PAYLOAD, rng=random.Random(0))
    stage = Stage(spec, 0, device=CPU)
    return stage, Trainer(stage, sampler(), router, peer_id=dht.peer_id.to_base58(), max_in_flight=1), router


def test_remote_pipeline_gradients_equal_local_autograd(dht_nodes):
    _, (dht0, _), (dht1, v1) = dht_nodes

    async def main():
        stage1, _, peer1 = await serve_last_stage(dht1, v1)
        stage0, trainer, _ = await first_stage_trainer(dht0)
        events = []
        trainer.on_microbatch = events.append
        loss = await trainer.run_microbatch()
        inputs, targets = sampler().sample(SPEC.microbatch_size)
        reference = [StageModel(SPEC, 0), StageModel(SPEC, 1)]
        expected = next_token_loss(reference[1](reference[0](inputs)), targets)
        expected.backward()
        assert loss == pytest.approx(expected.item(), rel=1e-5)
        for remote, local in ((stage0, reference[0]), (stage1, reference[1])):
            grads = remote.accumulated_gradients()
            for name, q in local.named_parameters():
                torch.testing.assert_close(grads[name], q.grad, rtol=1e-4, atol=1e-6, msg=name)
        assert stage1.counters.num_samples == stage0.counters.num_samples == SPEC.microbatch_size
        assert events[0]["route"] == [[dht0.peer_id.to_base58(), 0, 0], [peer1, 1, 0]]

    asyncio.run(main())


def test_a_bf16_run_sends_bf16_activations_keeps_fp32_masters_and_matches_local_bf16_autograd(dht_nodes):
    """precision "bf16": stage 0's activations travel in bf16 (an fp32 tensor is refused), the
    gradients land on fp32 master weights, and they equal local autograd through the same bf16
    forward (swarm.model.stage_forward) and stay close to the fp32 ones."""
    _, (dht0, _), (dht1, v1) = dht_nodes
    spec = dataclasses.replace(SPEC, precision="bf16")

    async def main():
        stage1, _, peer1 = await serve_last_stage(dht1, v1, spec)
        stage0, trainer, _ = await first_stage_trainer(dht0, spec)
        loss = await trainer.run_microbatch()
        inputs, targets = sampler().sample(spec.microbatch_size)
        reference = [StageModel(spec, 0), StageModel(spec, 1)]
        weights = [dict(m.named_parameters()) for m in reference]
        hidden = stage_forward(reference[0], weights[0], inputs, precision="bf16")
        assert hidden.dtype == torch.bfloat16
        logits = stage_forward(reference[1], weights[1], hidden, precision="bf16")
        assert logits.dtype == torch.float32
        expected = next_token_loss(logits, targets)
        expected.backward()
        assert loss == pytest.approx(expected.item(), rel=1e-3)
        fp32 = [StageModel(SPEC, 0), StageModel(SPEC, 1)]
        next_token_loss(fp32[1](fp32[0](inputs)), targets).backward()
        for remote, local, exact in ((stage0, reference[0], fp32[0]), (stage1, reference[1], fp32[1])):
            grads = remote.accumulated_gradients()
            for name, q in local.named_parameters():
                assert grads[name].dtype == torch.float32 and dict(remote.model.named_parameters())[name].dtype == torch.float32
                torch.testing.assert_close(grads[name], q.grad, rtol=2e-2, atol=1e-4, msg=name)
                cosine = torch.nn.functional.cosine_similarity(grads[name].flatten(), dict(exact.named_parameters())[name].grad.flatten(), dim=0)
                assert cosine > 0.98, (name, float(cosine))
        with pytest.raises(RemoteError, match="activations"):  # fp32 activations in a bf16 run
            await call_peer(await dht0.replicate_p2p(), peer1, forward_handler(spec.run_id),
                            {"mb_id": "x", "route": [["someone", 0, 0]], "batch_size": 4},
                            [torch.zeros(4, 16, 32), torch.zeros(4, 16, dtype=torch.int64)], timeout=10,
                            max_payload_bytes=MAX_PAYLOAD)

    asyncio.run(main())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_middle_stage_relays_activations_and_gradients_in_the_runs_dtype(dht_nodes, precision):
    """Three stages, the middle one a StageServer that routes on: its forward goes downstream and
    the gradient that comes back (checked against the run's dtype) flows upstream to stage 0."""
    _, (dht0, _), (dht1, v1) = dht_nodes
    spec = RunSpec(run_id=f"mid{precision}", model=ModelSpec(d_model=32, num_layers=3, num_heads=2, seq_len=16),
                   stage_layers=((0, 1), (1, 2), (2, 3)), microbatch_size=4, target_batch_size=1000, precision=precision)

    async def main():
        p2p1, peer1 = await dht1.replicate_p2p(), dht1.peer_id.to_base58()
        last = Stage(spec, 2, device=CPU)
        await StageServer(p2p1, last, peer_id=peer1, router=None, request_timeout=10, max_payload_bytes=MAX_PAYLOAD).start()
        view1 = SwarmView(dht1, spec.run_id)
        assert await declare_peer(dht1, v1, spec.run_id, PeerRecord(peer_id=peer1, role="reliable", state="training",
                                                                     stage=2, flops=1e9), ttl=60)
        await view1.refresh()
        middle = Stage(spec, 1, device=CPU)
        p2p0, peer0 = await dht0.replicate_p2p(), dht0.peer_id.to_base58()
        onward = Router(p2p0, view1, run_id=spec.run_id, next_stage=2, next_stage_flops=1.0, request_timeout=10,
                        max_payload_bytes=MAX_PAYLOAD, rng=random.Random(0))
        await StageServer(p2p0, middle, peer_id=peer0, router=onward, request_timeout=10, max_payload_bytes=MAX_PAYLOAD).start()
        first = Stage(spec, 0, device=CPU)
        inputs, targets = sampler().sample(spec.microbatch_size)
        hidden = await first.forward("m1", inputs)
        assert hidden.dtype == activation_dtype(spec)
        reply, tensors = await call_peer(p2p1, peer0, forward_handler(spec.run_id),
                                         {"mb_id": "m1", "route": [[peer1, 0, 0]], "batch_size": spec.microbatch_size},
                                         [hidden, targets], timeout=10, max_payload_bytes=MAX_PAYLOAD)
        assert reply["ok"] and math.isfinite(reply["loss"]) and tensors[0].dtype == activation_dtype(spec)
        assert tensors[0].shape == hidden.shape and bool(tensors[0].abs().sum() > 0)
        await first.backward("m1", tensors[0])
        assert middle.counters.num_samples == last.counters.num_samples == spec.microbatch_size
        assert all(g.abs().sum() > 0 for g in first.accumulated_gradients().values())

    asyncio.run(main())


def test_malformed_requests_are_refused_and_the_server_keeps_serving(dht_nodes):
    _, (dht0, _), (dht1, v1) = dht_nodes

    async def main():
        stage1, server, peer1 = await serve_last_stage(dht1, v1)
        p2p = await dht0.replicate_p2p()
        good_header = {"mb_id": "m1", "route": [["someone", 0, 0]], "batch_size": 2}
        acts = torch.randn(2, SPEC.model.seq_len, SPEC.model.d_model)
        targets = torch.zeros(2, SPEC.model.seq_len, dtype=torch.int64)
        hostile = [
            ({**good_header, "route": []}, [acts, targets], "route"),
            ({**good_header, "batch_size": 99}, [acts, targets], "batch_size"),
            (good_header, [acts[:, :3], targets], "activations must be"),
            (good_header, [acts * float("nan"), targets], "NaN"),
            (good_header, [acts, targets + 1000], "vocabulary"),
            (good_header, [acts], "carries 2 tensors"),
            ({**good_header, "route": [["someone", False, 0]]}, [acts, targets], "route hop 0"),
            ({**good_header, "route": [["", 0, 0]]}, [acts, targets], "route hop 0"),
        ]
        for header, tensors, reason in hostile:
            with pytest.raises(RemoteError, match=reason):
                await call_peer(p2p, peer1, forward_handler(SPEC.run_id), header, tensors, timeout=10, max_payload_bytes=MAX_PAYLOAD)
        assert server.num_refused == len(hostile)
        assert stage1.counters.num_samples == 0
        reply, grads = await call_peer(p2p, peer1, forward_handler(SPEC.run_id), good_header, [acts, targets],
                                       timeout=10, max_payload_bytes=MAX_PAYLOAD)
        assert reply["ok"] and grads[0].shape == acts.shape and stage1.counters.num_samples == 2

    asyncio.run(main())


def test_no_peer_of_next_stage_raises_and_releases_the_graph(dht_nodes):
    _, (dht0, _), _ = dht_nodes

    async def main():
        stage0, trainer, router = await first_stage_trainer(dht0)
        with pytest.raises(NoPeerAvailableError):
            await trainer.run_microbatch()
        assert stage0.num_held_graphs == 0  # the failed microbatch released its graph

    asyncio.run(main())


def test_the_trainer_keeps_what_the_flow_window_allows_in_flight_and_tells_it_every_round_trip(dht_nodes):
    """swarm/flow_control.py wired into the trainer: it starts at one microbatch in flight, every
    answer carries the next stage's compute queue, and more go out only once the window grew."""
    _, (dht0, _), (dht1, v1) = dht_nodes

    async def main():
        await serve_last_stage(dht1, v1)
        stage0, trainer, router = await first_stage_trainer(dht0)
        flow = FlowWindow(max_window=4, initial_window=1)
        trainer.flow, trainer.max_in_flight = flow, 4
        told, events = [], []
        tell = flow.on_round_trip
        flow.on_round_trip = lambda seconds, *, in_flight, queue=None: told.append((in_flight, queue, flow.window)) or tell(
            seconds, in_flight=in_flight, queue=queue)
        trainer.on_event = lambda event, **fields: events.append((event, fields))
        stop = asyncio.Event()
        running = asyncio.create_task(trainer.run(stop))
        async with asyncio.timeout(60):
            while not any(n > 1 for n, _, _ in told) or len(told) < 20:
                await asyncio.sleep(0.05)
        stop.set()
        await running
        assert told[0][0] == 1 and all(n <= window for n, _, window in told[:3]), told[:5]
        assert all(type(queue) is int and queue >= 0 for _, queue, _ in told), told
        assert all(n <= 4 for n, _, _ in told)
        grown = [fields for event, fields in events if event == "flow_window"]
        assert grown and grown[0]["before"] == 1 and grown[0]["window"] == 2, events[:5]

    asyncio.run(main())


def test_a_subspace_run_carries_k_numbers_per_token_through_a_middle_stage_and_matches_local_autograd(dht_nodes):
    """``boundary_subspace`` (swarm.subspace): a trainer, a middle stage that routes on and a last stage,
    over real P2P: every boundary carries (batch, seq, k) both ways plus the sample's window, the loss is
    the unconstrained forward's of the same (projected) weights, and every gradient equals local autograd
    of the model with its boundaries mapped through base + U Uᵀ(x − base)."""
    (dht_a, _), (dht_b, v_b), (dht_c, v_c) = dht_nodes
    spec = RunSpec(run_id="subsp", model=ModelSpec(d_model=32, num_layers=3, num_heads=2, seq_len=16, boundary_subspace=4),
                   stage_layers=((0, 1), (1, 2), (2, 3)), microbatch_size=4, target_batch_size=1000)

    async def serve(dht, validator, index: int, router: Router | None) -> tuple[Stage, StageServer]:
        p2p, peer_id = await dht.replicate_p2p(), dht.peer_id.to_base58()
        stage = Stage(spec, index, device=CPU)
        server = StageServer(p2p, stage, peer_id=peer_id, router=router, request_timeout=10, max_payload_bytes=MAX_PAYLOAD)
        await server.start()
        record = PeerRecord(peer_id=peer_id, role="reliable", state="training", stage=index, flops=1e9)
        assert await declare_peer(dht, validator, spec.run_id, record, ttl=60)
        return stage, server

    async def router_on(dht, next_stage: int) -> Router:
        view = SwarmView(dht, spec.run_id)
        await view.refresh()
        return Router(await dht.replicate_p2p(), view, run_id=spec.run_id, next_stage=next_stage, next_stage_flops=1.0,
                      request_timeout=10, max_payload_bytes=MAX_PAYLOAD, rng=random.Random(0), codec=stage_boundary_codec(spec))

    async def main():
        last, last_server = await serve(dht_c, v_c, 2, None)
        middle, middle_server = await serve(dht_b, v_b, 1, await router_on(dht_b, 2))
        arrived = []
        for server in (middle_server, last_server):  # what crosses each boundary, as the receiver decodes it
            def spy(wire, ids, *, decode=server.codec.decode_activations, **kwargs):
                arrived.append(([tuple(t.shape) for t in wire], tuple(ids.shape)))
                return decode(wire, ids, **kwargs)
            server.codec.decode_activations = spy
        first = Stage(spec, 0, device=CPU)
        trainer = Trainer(first, TokenSampler(load_corpus(spec.dataset).text(), seq_len=16, seed=3),
                          await router_on(dht_a, 1), peer_id=dht_a.peer_id.to_base58(), max_in_flight=1)
        loss = await trainer.run_microbatch()
        assert arrived == [([(4, 16, 4)], (4, 17))] * 2

        inputs, targets = TokenSampler(load_corpus(spec.dataset).text(), seq_len=16, seed=3).sample(4)
        reference = [Stage(spec, index, device=CPU) for index in range(3)]  # built and projected as the swarm's were
        subspace = subspace_of(spec)
        basis, base = subspace.tables(CPU)[0], subspace.base(inputs)
        through = lambda h: base + (h - base) @ basis @ basis.T  # noqa: E731 - the boundary, differentiably
        models = [stage.model for stage in reference]
        unconstrained = next_token_loss(models[2](models[1](models[0](inputs))), targets)
        assert loss == pytest.approx(float(unconstrained), rel=1e-5)  # lossless: the weights keep the boundary in the subspace
        expected = next_token_loss(models[2](through(models[1](through(models[0](inputs))))), targets)
        expected.backward()
        for remote, local in ((first, models[0]), (middle, models[1]), (last, models[2])):
            grads = remote.accumulated_gradients()
            for name, q in local.named_parameters():
                torch.testing.assert_close(grads[name], q.grad, rtol=1e-4, atol=1e-6, msg=name)
        for stage in (*reference, first, middle, last):
            stage.shutdown()

    asyncio.run(main())
