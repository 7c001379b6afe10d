"""A run's model in Hugging Face's layout: the ``config.json`` and tensor names ``transformers`` loads.

The llama family maps onto ``LlamaForCausalLM`` (its blocks already carry Hugging Face's names), the
gpt family onto ``GPT2LMHeadModel`` (fused QKV as ``c_attn``, weights transposed for its ``Conv1D``,
exact GELU). Both keep the output head untied from the embedding, as the swarm trains them. Pure
functions of the run spec and the stages' parameters: reading checkpoints and writing the folder is
``peer.export``'s.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dht.records import RunSpec
from swarm.model import RMS_EPS, ROPE_THETA

GPT2_BLOCK_NAMES = {  # ours -> GPT-2's, and whether the weight is transposed (GPT-2's Conv1D is in x out)
    "ln_1.weight": ("ln_1.weight", False), "ln_1.bias": ("ln_1.bias", False),
    "qkv.weight": ("attn.c_attn.weight", True), "qkv.bias": ("attn.c_attn.bias", False),
    "proj.weight": ("attn.c_proj.weight", True), "proj.bias": ("attn.c_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False), "ln_2.bias": ("ln_2.bias", False),
    "fc.weight": ("mlp.c_fc.weight", True), "fc.bias": ("mlp.c_fc.bias", False),
    "fc_proj.weight": ("mlp.c_proj.weight", True), "fc_proj.bias": ("mlp.c_proj.bias", False),
}


def hf_config(spec: RunSpec) -> dict:
    """The ``config.json`` of the run's model."""
    model = spec.model
    if model.family == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": model.vocab_size,
                "hidden_size": model.d_model, "intermediate_size": model.ffn_width,
                "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
                "num_key_value_heads": model.kv_heads, "head_dim": model.head_dim, "hidden_act": "silu",
                "max_position_embeddings": model.seq_len, "rms_norm_eps": RMS_EPS, "rope_theta": ROPE_THETA,
                "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32"}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": model.vocab_size,
            "n_embd": model.d_model, "n_layer": model.num_layers, "n_head": model.num_heads,
            "n_inner": model.ffn_width, "n_positions": model.seq_len, "activation_function": "gelu",
            "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "tie_word_embeddings": False, "torch_dtype": "float32"}


def hf_state_dict(spec: RunSpec, stage_parameters: Mapping[int, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The whole model's tensors under Hugging Face's names, from every stage's parameters (named as
    ``StageModel.state_dict()``: ``tok_emb.weight``, ``blocks.<i>.…`` with ``i`` local to the stage,
    ``ln_f.…``, ``head.weight``). ``ValueError`` if a stage is missing or a tensor is unexpected."""
    missing = [k for k in range(spec.num_stages) if k not in stage_parameters]
    if missing:
        raise ValueError(f"no parameters for stage(s) {missing} of {spec.num_stages}")
    llama, out = spec.model.family == "llama", {}
    for stage, (start, _) in enumerate(spec.stage_layers):
        for name, tensor in stage_parameters[stage].items():
            out_name, transpose = _hf_name(name, start, llama)
            out[out_name] = (tensor.t() if transpose else tensor).detach().to("cpu").contiguous()
    return out


def _hf_name(name: str, first_layer: int, llama: bool) -> tuple[str, bool]:
    top = {"tok_emb.weight": "model.embed_tokens.weight" if llama else "transformer.wte.weight",
           "pos_emb.weight": "transformer.wpe.weight", "head.weight": "lm_head.weight",
           "ln_f.weight": "model.norm.weight" if llama else "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"}
    if name in top and not (llama and name in ("pos_emb.weight", "ln_f.bias")):
        return top[name], False
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit():
        layer = first_layer + int(parts[1])
        if llama:
            return f"model.layers.{layer}.{parts[2]}", False
        if parts[2] in GPT2_BLOCK_NAMES:
            inner, transpose = GPT2_BLOCK_NAMES[parts[2]]
            return f"transformer.h.{layer}.{inner}", transpose
    raise ValueError(f"no Hugging Face name for the stage tensor {name!r}")
