"""A short continuation of a fixed prompt from the whole model: what a volunteer reads to see the
model learn in words rather than in a loss curve.

The stages run one after another in this process (from checkpoints or an export, never the live
pipeline: a sample must not take a training microbatch's place). Sampling is top-k with a fixed
seed, so two samples differ only because the weights did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dht.records import RunSpec
from swarm.model import StageModel
from swarm.tokenizer import Tokenizer

SAMPLE_PROMPT = "The "
SAMPLE_TOKENS = 40
SAMPLE_TEMPERATURE, SAMPLE_TOP_K, SAMPLE_SEED = 0.8, 20, 0


def stage_models(spec: RunSpec, parameters: Mapping[int, Mapping[str, torch.Tensor]]) -> list[StageModel]:
    """Every stage of ``spec``'s model with ``parameters[k]`` (named as ``StageModel.state_dict()``)."""
    models = []
    for index in range(spec.num_stages):
        model = StageModel(spec, index)
        model.load_state_dict(dict(parameters[index]))
        models.append(model.eval())
    return models


@torch.no_grad()
def continue_text(models: Sequence[StageModel], tokenizer: Tokenizer, *, seq_len: int, prompt: str = SAMPLE_PROMPT,
                  new_tokens: int = SAMPLE_TOKENS, temperature: float = SAMPLE_TEMPERATURE, top_k: int = SAMPLE_TOP_K,
                  seed: int = SAMPLE_SEED) -> str:
    """Up to ``new_tokens`` tokens after ``prompt`` (stopping at the end-of-text token), decoded."""
    if new_tokens < 1 or temperature <= 0 or top_k < 1:
        raise ValueError("new_tokens and top_k must be positive, and temperature above 0")
    prompt_ids = tokenizer.encode(prompt)
    ids = list(prompt_ids)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(new_tokens):
        x = torch.tensor([ids[-seq_len:]], dtype=torch.int64)
        for model in models:
            x = model(x)
        top = torch.topk(x[0, -1].float() / temperature, k=min(top_k, x.shape[-1]))
        choice = int(top.indices[torch.multinomial(torch.softmax(top.values, dim=-1), 1, generator=generator)])
        if choice == tokenizer.end_of_text:
            break
        ids.append(choice)
    return tokenizer.decode(ids[len(prompt_ids):])
