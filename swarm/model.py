"""A decoder-only transformer of either family, built one pipeline stage at a time.

Two families (``ModelSpec.family``): ``gpt``, GPT-2 style (LayerNorm, learned positions, GELU MLP,
biases), and ``llama``, Llama style (RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention,
no biases; its block's names are those of Hugging Face's ``LlamaDecoderLayer``).

The model code is single-device (nanoGPT shape); pipelining is applied on top by giving each stage
its own slice of blocks. Stage 0 holds the token embedding (and, for gpt, the position embedding),
the last stage the final norm and the output head (untied, so that stages share no parameters).

Activation checkpointing (``checkpoint_activations``; the peer's ``--activation-checkpointing``): a
block keeps only its input for the backward and recomputes the rest when the gradient comes back,
so a stage holds ``d_model`` floats per token per block for each in-flight microbatch instead of a
block's whole set of saved activations (``peer.memory_model`` counts both), for about one more forward
of compute. The recompute runs on the very weight tensors the forward used, passed in explicitly:
:class:`swarm.stage.Stage` forwards through ``functional_call`` on a weight version, and by the time
the gradient returns the module holds its master parameters again.

Initialisation is deterministic per layer: block ``i`` is initialised from a generator seeded with
``(run seed, i)``, so the first peer of a stage builds exactly the weights every other peer would
build, whatever the partition and whichever device.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from dht.records import ModelSpec, RunSpec

EMBEDDING_SEED_OFFSET = 1_000_003
HEAD_SEED_OFFSET = 2_000_003
RMS_EPS = 1e-5  # the llama family's RMSNorm epsilon (Llama 2/3's)
ROPE_THETA = 10000.0  # the llama family's rotary base
# the residual projections, initialised with GPT-2's 1/sqrt(2 * layers) scaling, by family
RESIDUAL_PROJECTIONS = {"gpt": ("proj", "fc_proj"), "llama": ("o_proj", "down_proj")}


class Block(nn.Module):
    """Pre-norm GPT-2 block: causal self-attention then a GELU MLP (4 × d_model wide by default)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.ln_1 = nn.LayerNorm(spec.d_model)
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model)
        self.proj = nn.Linear(spec.d_model, spec.d_model)
        self.ln_2 = nn.LayerNorm(spec.d_model)
        self.fc = nn.Linear(spec.d_model, spec.ffn_width)
        self.fc_proj = nn.Linear(spec.ffn_width, spec.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
        heads = [t.view(batch, seq, self.num_heads, width // self.num_heads).transpose(1, 2) for t in (q, k, v)]
        attended = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class LlamaBlock(nn.Module):
    """Pre-norm Llama block: RMSNorm, causal self-attention with rotary positions and grouped-query
    heads, RMSNorm, SwiGLU MLP; no biases."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        width, head_dim = spec.d_model, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.kv_heads, head_dim
        self.input_layernorm = nn.RMSNorm(width, eps=RMS_EPS)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(width, spec.num_heads * head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(width, spec.kv_heads * head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(width, spec.kv_heads * head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(spec.num_heads * head_dim, width, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(width, eps=RMS_EPS)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(width, spec.ffn_width, bias=False)
        self.mlp.up_proj = nn.Linear(width, spec.ffn_width, bias=False)
        self.mlp.down_proj = nn.Linear(spec.ffn_width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        attn, h = self.self_attn, self.input_layernorm(x)
        q = attn.q_proj(h).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary_tables(seq, self.head_dim, device=x.device, dtype=q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if self.num_kv_heads != self.num_heads:  # each key/value head serves a group of query heads
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + attn.o_proj(attended.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))
        mlp, h = self.mlp, self.post_attention_layernorm(x)
        return x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))


def new_block(model: ModelSpec) -> nn.Module:
    """One block of the model's family (weights uninitialised: ``StageModel`` seeds them)."""
    return LlamaBlock(model) if model.family == "llama" else Block(model)


def rotary_tables(seq_len: int, head_dim: int, *, device: torch.device, dtype: torch.dtype,
                  theta: float = ROPE_THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin of rotary positions, ``(seq_len, head_dim)`` each, in the half-split layout
    Hugging Face's Llama uses (frequency ``i`` on dimensions ``i`` and ``i + head_dim / 2``)."""
    inverse = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inverse)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StageModel(nn.Module):
    """Blocks ``[start, end)`` of the model, plus the embedding (stage 0) and the head (last stage).

    Stage 0 takes token ids ``(batch, seq)`` int64; other stages take activations
    ``(batch, seq, d_model)``. The last stage returns logits, the others activations.
    ``checkpoint_activations``: recompute each block in the backward (the module docstring).
    """

    def __init__(self, spec: RunSpec, stage: int, *, checkpoint_activations: bool = False) -> None:
        super().__init__()
        if not 0 <= stage < spec.num_stages:
            raise ValueError(f"stage {stage} is not one of the run's {spec.num_stages} stages")
        model = spec.model
        self.stage = stage
        self.checkpoint_activations = checkpoint_activations
        self.is_first = stage == 0
        self.is_last = stage == spec.num_stages - 1
        llama = model.family == "llama"
        residual = RESIDUAL_PROJECTIONS[model.family]
        start, end = spec.stage_layers[stage]
        if self.is_first:
            self.tok_emb = nn.Embedding(model.vocab_size, model.d_model)
            embeddings = [self.tok_emb]
            if not llama:  # llama's positions are rotary, inside each block
                self.pos_emb = nn.Embedding(model.seq_len, model.d_model)
                embeddings.append(self.pos_emb)
            _init_from_seed(spec.seed + EMBEDDING_SEED_OFFSET, embeddings, residual=residual)
        self.blocks = nn.ModuleList()
        for index in range(start, end):
            block = new_block(model)
            _init_from_seed(spec.seed * 7919 + index, [block], num_layers=model.num_layers, residual=residual)
            self.blocks.append(block)
        if self.is_last:
            self.ln_f = nn.RMSNorm(model.d_model, eps=RMS_EPS) if llama else nn.LayerNorm(model.d_model)
            self.head = nn.Linear(model.d_model, model.vocab_size, bias=False)
            _init_from_seed(spec.seed + HEAD_SEED_OFFSET, [self.ln_f, self.head], residual=residual)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = inputs
        if self.is_first:
            x = self.tok_emb(inputs)
            if hasattr(self, "pos_emb"):
                x = x + self.pos_emb(torch.arange(inputs.shape[1], device=inputs.device))
        recompute = self.checkpoint_activations and torch.is_grad_enabled()
        for block in self.blocks:
            x = _checkpointed(block, x) if recompute else block(x)
        if self.is_last:
            x = self.head(self.ln_f(x))
        return x


def _checkpointed(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``block(x)`` keeping only ``x`` (and references to the weights) for the backward. The weights
    are read now and handed to the recompute, which must not read the module later (see the module
    docstring). No dropout anywhere: no random state to preserve."""
    names, weights = zip(*block.named_parameters())

    def run(inputs: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        return functional_call(block, dict(zip(names, tensors)), (inputs,))

    return checkpoint(run, x, *weights, use_reentrant=False, preserve_rng_state=False)


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
    block_params = block_matmul_params(model)
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
    if model.family == "llama":  # the matrices, no biases; two RMSNorm weights
        block = block_matmul_params(model) + 2 * d
        params = [block] * model.num_layers
        params[0] += model.vocab_size * d
        params[-1] += d + d * model.vocab_size
        return tuple(params)
    block = block_matmul_params(model) + 9 * d + model.ffn_width  # + biases (3d, d, ffn, d) and two LayerNorms (4d)
    params = [block] * model.num_layers
    params[0] += (model.vocab_size + model.seq_len) * d
    params[-1] += 2 * d + d * model.vocab_size
    return tuple(params)


def block_matmul_params(model: ModelSpec) -> int:
    """Weights of one block's matrices (what its matmuls cost): attention and MLP."""
    d, ffn = model.d_model, model.ffn_width
    if model.family == "llama":
        kv = model.kv_heads * model.head_dim
        return 2 * d * d + 2 * d * kv + 3 * d * ffn  # q and o; k and v; gate, up and down
    return 4 * d * d + 2 * d * ffn  # qkv and proj; fc and fc_proj


def activation_dtype(spec: RunSpec) -> torch.dtype:
    """The dtype of activations and their gradients between stages: bf16 in a bf16 run."""
    return torch.bfloat16 if spec.precision == "bf16" else torch.float32


def stage_forward(model: StageModel, weights: dict[str, torch.Tensor], inputs: torch.Tensor, *,
                  precision: str) -> torch.Tensor:
    """``model``'s forward on ``weights`` (fp32 masters) as the run's precision computes it. Under
    "bf16": inside bf16 autocast (matmuls in bf16, reductions and norms as autocast keeps them), the
    activations rounded to bf16 (what the wire carries, so a spot check fingerprints what was sent)
    and the logits back to fp32 for the loss. The rounding is differentiable: the backward sees it."""
    if precision != "bf16":
        return functional_call(model, weights, (inputs,))
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16):
        outputs = functional_call(model, weights, (inputs,))
    return outputs.float() if model.is_last else outputs.to(torch.bfloat16)


def initial_embeddings(model: ModelSpec, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The token embedding stage 0 is built with (and the gpt family's position embedding, else
    None), computed without building the stage: the base of a subspace run (``swarm.subspace``)."""
    generator = torch.Generator().manual_seed(seed + EMBEDDING_SEED_OFFSET)  # as _init_from_seed draws them
    tokens = torch.randn((model.vocab_size, model.d_model), generator=generator) * 0.02
    if model.family == "llama":
        return tokens, None
    return tokens, torch.randn((model.seq_len, model.d_model), generator=generator) * 0.02


def _init_from_seed(seed: int, modules: list[nn.Module], *, num_layers: int = 1,
                    residual: tuple[str, ...] = RESIDUAL_PROJECTIONS["gpt"]) -> None:
    generator = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * num_layers)  # GPT-2: scale the residual projections
    for module in modules:
        for name, sub in module.named_modules():
            if isinstance(sub, nn.Linear):
                std = residual_std if name.rsplit(".", 1)[-1] in residual else 0.02
                with torch.no_grad():
                    sub.weight.copy_(torch.randn(sub.weight.shape, generator=generator) * std)
                    if sub.bias is not None:
                        sub.bias.zero_()
            elif isinstance(sub, nn.Embedding):
                with torch.no_grad():
                    sub.weight.copy_(torch.randn(sub.weight.shape, generator=generator) * 0.02)
