"""The llama family (swarm/model.py): RMSNorm, rotary positions, SwiGLU, grouped-query attention.
Any partition computes the one-stage forward with the same weights, the parameter count is exact,
attention is causal, and the forward through all stages is Hugging Face's ``LlamaForCausalLM``'s on
the same weights (transformers is a test extra, never a runtime requirement)."""

from __future__ import annotations

import pytest
import torch

from dht.records import ModelSpec, RunSpec
from swarm.model import StageModel, next_token_loss, stage_flops_per_sample, stage_num_params

LLAMA = ModelSpec(family="llama", d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=16)
PARTITIONS = [((0, 4),), ((0, 2), (2, 4)), ((0, 1), (1, 4)), ((0, 1), (1, 2), (2, 3), (3, 4))]


def spec_of(stage_layers, *, model: ModelSpec = LLAMA, seed: int = 3) -> RunSpec:
    return RunSpec(run_id="l", model=model, stage_layers=tuple(stage_layers), seed=seed, microbatch_size=2,
                   target_batch_size=4)


def tokens(batch: int = 3, seq_len: int = 16, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def run_pipeline(spec: RunSpec, inputs: torch.Tensor) -> torch.Tensor:
    x = inputs
    for k in range(spec.num_stages):
        x = StageModel(spec, k)(x)
    return x


@torch.no_grad()
@pytest.mark.parametrize("partition", PARTITIONS[1:], ids=str)
def test_any_partition_computes_the_single_stage_forward(partition):
    inputs = tokens()
    expected = run_pipeline(spec_of(PARTITIONS[0]), inputs)
    got = run_pipeline(spec_of(partition), inputs)
    assert got.shape == (3, 16, 256)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_llama_stage_has_no_position_embedding_and_no_bias():
    first, last = StageModel(spec_of(PARTITIONS[1]), 0), StageModel(spec_of(PARTITIONS[1]), 1)
    assert not hasattr(first, "pos_emb") and not any(name.endswith("bias") for name, _ in first.named_parameters())
    assert not any(name.endswith("bias") for name, _ in last.named_parameters())
    block = first.blocks[0]
    assert block.self_attn.k_proj.weight.shape == (2 * 8, 32)  # two key/value heads of width 8
    assert block.mlp.gate_proj.weight.shape == (LLAMA.ffn_width, 32) and LLAMA.ffn_width == 96  # 8/3 x 32, to 32


@pytest.mark.parametrize("model", [LLAMA, ModelSpec(family="llama", d_model=24, num_layers=3, num_heads=6, seq_len=5,
                                                    vocab_size=97, ffn_dim=40),
                                   ModelSpec(family="llama", d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
                                             seq_len=3, vocab_size=11)], ids=["gqa", "ffn", "mqa"])
def test_stage_num_params_counts_the_real_parameters(model):
    spec = spec_of(((0, 1), (1, model.num_layers)), model=model)
    for k in range(spec.num_stages):
        assert stage_num_params(spec, k) == sum(p.numel() for p in StageModel(spec, k).parameters())
        assert stage_flops_per_sample(spec, k) > 0


@torch.no_grad()
def test_attention_is_causal():
    model = StageModel(spec_of(PARTITIONS[0]), 0)
    a, b = tokens(seed=1), tokens(seed=1).clone()
    b[:, 10:] = (b[:, 10:] + 1) % 256  # change only the future of position 9
    torch.testing.assert_close(model(a)[:, :10], model(b)[:, :10], rtol=0, atol=0)
    assert not torch.allclose(model(a)[:, 10:], model(b)[:, 10:])


def test_the_loss_at_initialisation_is_near_uniform_and_falls_with_training():
    spec = spec_of(PARTITIONS[0])
    model = StageModel(spec, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    text = tokens(batch=8, seq_len=17, seed=4, vocab=16)  # a small alphabet: learnable quickly
    losses = []
    for _ in range(30):
        loss = next_token_loss(model(text[:, :-1]), text[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert abs(losses[0] - torch.log(torch.tensor(256.0)).item()) < 0.3
    assert losses[-1] < 0.7 * losses[0]


@torch.no_grad()
@pytest.mark.parametrize("num_kv_heads", [0, 2, 1])
def test_the_forward_through_all_stages_is_transformers_llama_on_the_same_weights(num_kv_heads):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = ModelSpec(family="llama", d_model=32, num_layers=3, num_heads=4, num_kv_heads=num_kv_heads, seq_len=16)
    spec = spec_of(((0, 1), (1, 3)), model=model)
    stages = [StageModel(spec, k) for k in range(spec.num_stages)]
    config = LlamaConfig(vocab_size=model.vocab_size, hidden_size=model.d_model, intermediate_size=model.ffn_width,
                         num_hidden_layers=model.num_layers, num_attention_heads=model.num_heads,
                         num_key_value_heads=model.kv_heads, max_position_embeddings=model.seq_len,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
                         mlp_bias=False)
    reference = LlamaForCausalLM(config).eval()
    weights = {"model.embed_tokens.weight": stages[0].tok_emb.weight, "model.norm.weight": stages[-1].ln_f.weight,
               "lm_head.weight": stages[-1].head.weight}
    for k, (start, _) in enumerate(spec.stage_layers):
        for offset, block in enumerate(stages[k].blocks):
            for name, value in block.state_dict().items():
                weights[f"model.layers.{start + offset}.{name}"] = value
    missing, unexpected = reference.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)
    inputs = tokens(batch=2)
    ours = run_pipeline(spec, inputs)
    theirs = reference(input_ids=inputs).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_the_run_spec_carries_the_family_and_a_gpt_spec_reads_as_before_the_family_existed():
    llama = spec_of(PARTITIONS[1])
    assert RunSpec.from_wire(llama.to_wire()) == llama and llama.to_wire()["model"]["family"] == "llama"
    gpt = RunSpec(run_id="g")
    assert set(gpt.to_wire()["model"]) == {"vocab_size", "d_model", "num_layers", "num_heads", "seq_len"}
    assert RunSpec.from_wire(gpt.to_wire()) == gpt
    with pytest.raises(ValueError, match="model family must be one of gpt, llama"):
        ModelSpec(family="mamba")
    with pytest.raises(ValueError, match="must divide num_heads"):
        ModelSpec(family="llama", num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="needs the llama family"):
        ModelSpec(num_kv_heads=2)
