"""Stage models: any partition computes the same function with the same weights; cost model."""

from __future__ import annotations

import math

import pytest
import torch

from dht.layouts import even_stage_layers
from dht.records import ModelSpec, RunSpec
from swarm.model import StageModel, next_token_loss, stage_flops_per_sample, stage_num_params

TINY = ModelSpec(d_model=32, num_layers=4, num_heads=4, seq_len=16)


def tiny_spec(stage_layers, *, seed: int = 3, model: ModelSpec = TINY) -> RunSpec:
    return RunSpec(run_id="m", model=model, stage_layers=tuple(stage_layers), seed=seed, microbatch_size=2,
                   target_batch_size=4)


def tokens(batch: int = 3, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def run_pipeline(spec: RunSpec, inputs: torch.Tensor) -> torch.Tensor:
    x = inputs
    for k in range(spec.num_stages):
        x = StageModel(spec, k)(x)
    return x


PARTITIONS = [((0, 4),), ((0, 2), (2, 4)), ((0, 1), (1, 4)), ((0, 3), (3, 4)), ((0, 1), (1, 2), (2, 3), (3, 4))]


@torch.no_grad()
@pytest.mark.parametrize("partition", PARTITIONS[1:], ids=str)
def test_any_partition_computes_the_single_stage_forward(partition):
    inputs = tokens()
    expected = StageModel(tiny_spec(PARTITIONS[0]), 0)(inputs)
    got = run_pipeline(tiny_spec(partition), inputs)
    assert got.shape == (3, 16, 256)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@torch.no_grad()
def test_stage_0_then_stage_1_equals_the_one_stage_model():
    spec2 = tiny_spec(((0, 2), (2, 4)))
    first, last = StageModel(spec2, 0), StageModel(spec2, 1)
    assert first.is_first and not first.is_last and last.is_last and not last.is_first
    inputs = tokens(seed=5)
    hidden = first(inputs)
    assert hidden.shape == (3, 16, TINY.d_model) and hidden.dtype == torch.float32
    torch.testing.assert_close(last(hidden), StageModel(tiny_spec(PARTITIONS[0]), 0)(inputs), rtol=0, atol=0)


@pytest.mark.parametrize("partition", PARTITIONS[1:], ids=str)
def test_block_weights_depend_only_on_layer_index_and_seed(partition):
    whole = StageModel(tiny_spec(PARTITIONS[0]), 0)
    spec = tiny_spec(partition)
    for k, (start, end) in enumerate(partition):
        stage = StageModel(spec, k)
        assert len(stage.blocks) == end - start
        for offset, block in enumerate(stage.blocks):
            reference = whole.blocks[start + offset].state_dict()
            for name, value in block.state_dict().items():
                assert torch.equal(value, reference[name]), (k, offset, name)
        if stage.is_first:
            assert torch.equal(stage.tok_emb.weight, whole.tok_emb.weight)
            assert torch.equal(stage.pos_emb.weight, whole.pos_emb.weight)
        else:
            assert not hasattr(stage, "tok_emb")
        if stage.is_last:
            assert torch.equal(stage.head.weight, whole.head.weight)
        else:
            assert not hasattr(stage, "head")


def test_different_seed_gives_different_weights_and_blocks_differ():
    a, b = StageModel(tiny_spec(PARTITIONS[0], seed=1), 0), StageModel(tiny_spec(PARTITIONS[0], seed=2), 0)
    assert not torch.equal(a.blocks[0].qkv.weight, b.blocks[0].qkv.weight)
    assert not torch.equal(a.tok_emb.weight, b.tok_emb.weight)
    assert not torch.equal(a.blocks[0].qkv.weight, a.blocks[1].qkv.weight)


def test_init_is_independent_of_the_global_rng():
    torch.manual_seed(0)
    a = StageModel(tiny_spec(PARTITIONS[1]), 1)
    torch.manual_seed(12345)
    torch.rand(100)
    b = StageModel(tiny_spec(PARTITIONS[1]), 1)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


SPECS = [
    tiny_spec(PARTITIONS[0]),
    tiny_spec(((0, 1), (1, 2), (2, 3), (3, 4))),
    tiny_spec(((0, 2), (2, 4))),
    tiny_spec(((0, 3), (3, 5)), model=ModelSpec(d_model=24, num_layers=5, num_heads=3, seq_len=7, vocab_size=97)),
    tiny_spec(((0, 1), (1, 2)), model=ModelSpec(d_model=8, num_layers=2, num_heads=1, seq_len=3, vocab_size=11)),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: str(s.stage_layers))
def test_stage_num_params_counts_the_real_parameters(spec):
    total = 0
    for k in range(spec.num_stages):
        real = sum(p.numel() for p in StageModel(spec, k).parameters())
        assert stage_num_params(spec, k) == real
        total += real
    assert total == sum(stage_num_params(spec, k) for k in range(spec.num_stages))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: str(s.stage_layers))
def test_stage_flops_positive(spec):
    for k in range(spec.num_stages):
        flops = stage_flops_per_sample(spec, k)
        assert isinstance(flops, float) and flops > 0 and math.isfinite(flops)


def test_stage_flops_proportional_to_layers():
    model = ModelSpec(d_model=64, num_layers=12, num_heads=4, seq_len=32)
    spec = RunSpec(run_id="f", model=model, stage_layers=((0, 1), (1, 3), (3, 6), (6, 10), (10, 12)))
    per_layer = stage_flops_per_sample(spec, 0)
    for k in range(spec.num_stages - 1):  # all but the last, which also holds the head
        start, end = spec.stage_layers[k]
        assert stage_flops_per_sample(spec, k) == pytest.approx((end - start) * per_layer, rel=1e-12)
    head = 6 * model.d_model * model.vocab_size * model.seq_len
    assert stage_flops_per_sample(spec, 4) == pytest.approx(2 * per_layer + head, rel=1e-12)
    # the documented model: ~6 FLOPs per weight per token plus attention
    assert per_layer == 6 * 12 * 64 * 64 * 32 + 12 * 32 * 64 * 32
    # the stages of an even split cost about the same, and the sum is independent of the partition
    whole = RunSpec(run_id="f", model=model, stage_layers=((0, 12),))
    assert sum(stage_flops_per_sample(spec, k) for k in range(5)) == pytest.approx(stage_flops_per_sample(whole, 0))
    even = RunSpec(run_id="f", model=model, stage_layers=even_stage_layers(12, 4))
    assert stage_flops_per_sample(even, 0) == stage_flops_per_sample(even, 2)


def test_loss_at_init_is_near_uniform():
    spec = tiny_spec(PARTITIONS[0])
    inputs = tokens(batch=8, seed=11)
    targets = tokens(batch=8, seed=12)
    with torch.no_grad():
        loss = next_token_loss(StageModel(spec, 0)(inputs), targets)
    assert loss.dim() == 0
    assert abs(float(loss) - math.log(256)) < 0.1


def test_loss_is_mean_cross_entropy_per_token():
    logits = torch.zeros(2, 3, 5)
    logits[..., 1] = 100.0
    targets = torch.ones(2, 3, dtype=torch.int64)
    assert float(next_token_loss(logits, targets)) == pytest.approx(0.0, abs=1e-6)
    assert float(next_token_loss(torch.zeros(2, 3, 5), targets)) == pytest.approx(math.log(5))


def test_attention_is_causal():
    model = StageModel(tiny_spec(PARTITIONS[0]), 0)
    a, b = tokens(batch=1, seed=1), tokens(batch=1, seed=1).clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    with torch.no_grad():
        out_a, out_b = model(a), model(b)
    torch.testing.assert_close(out_a[:, :10], out_b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(out_a[:, 10:], out_b[:, 10:])


@pytest.mark.parametrize("stage", [-1, 2, 5])
def test_stage_outside_the_run_is_rejected(stage):
    with pytest.raises(ValueError):
        StageModel(tiny_spec(PARTITIONS[1]), stage)
