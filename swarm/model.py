"""A GPT-style decoder, built one pipeline stage at a time.

The model code is single-device (nanoGPT shape); pipelining is applied on top by giving each stage
its own slice of blocks. Stage 0 holds the token and position embeddings, the last stage the final
LayerNorm and the output head (untied, so that stages share no parameters).

Initialisation is deterministic per layer: block ``i`` is initialised from a generator seeded with
``(run seed, i)``, so the first peer of a stage builds exactly the weights every other peer would
build, whatever the partition and whichever device.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from dht.records import ModelSpec, RunSpec

EMBEDDING_SEED_OFFSET = 1_000_003
HEAD_SEED_OFFSET = 2_000_003


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then a 4x MLP."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.ln_1 = nn.LayerNorm(spec.d_model)
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model)
        self.proj = nn.Linear(spec.d_model, spec.d_model)
        self.ln_2 = nn.LayerNorm(spec.d_model)
        self.fc = nn.Linear(spec.d_model, 4 * spec.d_model)
        self.fc_proj = nn.Linear(4 * spec.d_model, spec.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
        heads = [t.view(batch, seq, self.num_heads, width // self.num_heads).transpose(1, 2) for t in (q, k, v)]
        attended = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class StageModel(nn.Module):
    """Blocks ``[start, end)`` of the model, plus the embedding (stage 0) and the head (last stage).

    Stage 0 takes token ids ``(batch, seq)`` int64; other stages take activations
    ``(batch, seq, d_model)``. The last stage returns logits, the others activations.
    """

    def __init__(self, spec: RunSpec, stage: int) -> None:
        super().__init__()
        if not 0 <= stage < spec.num_stages:
            raise ValueError(f"stage {stage} is not one of the run's {spec.num_stages} stages")
        model = spec.model
        self.stage = stage
        self.is_first = stage == 0
        self.is_last = stage == spec.num_stages - 1
        start, end = spec.stage_layers[stage]
        if self.is_first:
            self.tok_emb = nn.Embedding(model.vocab_size, model.d_model)
            self.pos_emb = nn.Embedding(model.seq_len, model.d_model)
            _init_from_seed(spec.seed + EMBEDDING_SEED_OFFSET, [self.tok_emb, self.pos_emb])
        self.blocks = nn.ModuleList()
        for index in range(start, end):
            block = Block(model)
            _init_from_seed(spec.seed * 7919 + index, [block], num_layers=model.num_layers)
            self.blocks.append(block)
        if self.is_last:
            self.ln_f = nn.LayerNorm(model.d_model)
            self.head = nn.Linear(model.d_model, model.vocab_size, bias=False)
            _init_from_seed(spec.seed + HEAD_SEED_OFFSET, [self.ln_f, self.head])

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = inputs
        if self.is_first:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
            x = self.tok_emb(inputs) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            x = self.head(self.ln_f(x))
        return x


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each next token (nats per token)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def stage_flops_per_sample(spec: RunSpec, stage: int) -> float:
    """Forward + backward FLOPs of one sequence through ``stage`` (≈ 6 × params × tokens + attention).

    Cost model (nanoGPT/PaLM accounting): a matmul with ``P`` weights costs ``2P`` FLOPs per token
    forward and ``4P`` backward; attention adds ``12 · seq · d_model`` per token per block (forward
    and backward of QKᵀ and AV). Embedding lookups are free; the head is a matmul.
    """
    start, end = spec.stage_layers[stage]
    return sum(layer_flops_per_sample(spec)[start:end])  # the last stage holds the last block, with the head


def layer_flops_per_sample(spec: RunSpec) -> tuple[float, ...]:
    """Forward + backward FLOPs of one sequence through each block, the head counted with the last
    block (the per-layer profile the planner re-splits layers by; a stage's cost is its blocks' sum).
    The cost model is :func:`stage_flops_per_sample`'s."""
    model = spec.model
    block_params = 12 * model.d_model * model.d_model
    per_block = float((6 * block_params + 12 * model.seq_len * model.d_model) * model.seq_len)
    flops = [per_block] * model.num_layers
    flops[-1] += float(6 * model.d_model * model.vocab_size * model.seq_len)
    return tuple(flops)


def stage_num_params(spec: RunSpec, stage: int) -> int:
    """Parameters of a stage, counted from the spec without allocating anything."""
    start, end = spec.stage_layers[stage]
    return sum(layer_num_params(spec)[start:end])  # the first stage holds block 0, the last the last block


def layer_num_params(spec: RunSpec) -> tuple[int, ...]:
    """Parameters of each block, the embeddings counted with the first block and the final
    LayerNorm and head with the last (they always share those blocks' stages)."""
    model = spec.model
    d = model.d_model
    block = 12 * d * d + 13 * d  # qkv, proj, fc, fc_proj weights and biases; two LayerNorms
    params = [block] * model.num_layers
    params[0] += (model.vocab_size + model.seq_len) * d
    params[-1] += 2 * d + d * model.vocab_size
    return tuple(params)


def _init_from_seed(seed: int, modules: list[nn.Module], *, num_layers: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * num_layers)  # GPT-2: scale the residual projections
    for module in modules:
        for name, sub in module.named_modules():
            if isinstance(sub, nn.Linear):
                std = residual_std if name.endswith("proj") else 0.02
                with torch.no_grad():
                    sub.weight.copy_(torch.randn(sub.weight.shape, generator=generator) * std)
                    if sub.bias is not None:
                        sub.bias.zero_()
            elif isinstance(sub, nn.Embedding):
                with torch.no_grad():
                    sub.weight.copy_(torch.randn(sub.weight.shape, generator=generator) * 0.02)
