"""peer.export: a run's stage checkpoints become a Hugging Face folder that transformers loads
(LlamaForCausalLM for the llama family, GPT2LMHeadModel for gpt), computes the swarm's logits with
(within 1e-4) and generates from; mistakes end in one sentence."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dht.records import ModelSpec, RunSpec
from peer.checkpoint import checkpoint_path, save_checkpoint
from peer.errors import UserError
from peer.export import export_checkpoints, main
from swarm.tokenizer import BpeTokenizer, train_bpe
from swarm.model import StageModel
from swarm.stage import Stage

MODELS = {"llama": ModelSpec(family="llama", d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, seq_len=16),
          "gpt": ModelSpec(d_model=32, num_layers=3, num_heads=4, seq_len=16)}


def write_checkpoints(directory, family: str, *, stages: tuple[int, ...] | None = None, tokenizer: str = "bytes",
                      vocab_size: int = 256) -> RunSpec:
    """Checkpoints of every stage (or of ``stages``) of a two-stage run, each trained one step off
    the seed's weights so that the export is not of an initialisation anyone could rebuild."""
    model = dataclasses.replace(MODELS[family], vocab_size=vocab_size)
    spec = RunSpec(run_id="exp", model=model, stage_layers=((0, 1), (1, 3)), microbatch_size=2,
                   target_batch_size=2, seed=5, tokenizer=tokenizer)
    for index in range(spec.num_stages) if stages is None else stages:
        stage = Stage(spec, index, device=torch.device("cpu"))
        try:
            with torch.no_grad():
                for param in stage.model.parameters():
                    param.add_(0.01 * torch.randn(param.shape, generator=torch.Generator().manual_seed(index)))
            state = stage.state_tensors()
            save_checkpoint(checkpoint_path(directory, spec.run_id, index), state, spec=spec, stage=index, version=7)
        finally:
            stage.shutdown()
    return spec


def our_logits(spec: RunSpec, directory, inputs: torch.Tensor) -> torch.Tensor:
    from peer.checkpoint import load_checkpoint

    x = inputs
    for index in range(spec.num_stages):
        model = StageModel(spec, index)
        _, state = load_checkpoint(checkpoint_path(directory, spec.run_id, index), spec=spec, stage=index)
        model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
        x = model(x)
    return x


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_the_export_loads_in_transformers_computes_the_swarms_logits_and_generates(tmp_path, family):
    from transformers import AutoModelForCausalLM

    spec = write_checkpoints(tmp_path / "ckpt", family)
    result = export_checkpoints(tmp_path / "ckpt", "exp", tmp_path / "hf")
    assert result["family"] == family and result["stage_steps"] == {0: 7, 1: 7}
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM" if family == "llama" else "GPT2LMHeadModel"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert sum(p.numel() for p in model.parameters()) == result["parameters"]
    inputs = torch.tensor([list(b"def main():\n    pr")[:16]])
    torch.testing.assert_close(model(input_ids=inputs).logits, our_logits(spec, tmp_path / "ckpt", inputs),
                               rtol=0, atol=1e-4)
    generated = model.generate(inputs[:, :8], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 14) and int(generated.max()) < 256


def test_a_missing_stage_or_directory_is_one_sentence(tmp_path, capsys):
    write_checkpoints(tmp_path / "ckpt", "llama", stages=(0,))
    with pytest.raises(UserError, match=r"exp-stage1.safetensors does not exist: the run has 2 stages"):
        export_checkpoints(tmp_path / "ckpt", "exp", tmp_path / "hf")
    assert main(["--checkpoint-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not exist: give the --checkpoint-dir" in err and err.count("\n") == 1


def test_checkpoints_of_another_model_are_refused(tmp_path):
    write_checkpoints(tmp_path / "ckpt", "llama", stages=(0,))
    other = RunSpec(run_id="exp", model=MODELS["gpt"], stage_layers=((0, 1), (1, 3)), microbatch_size=2,
                    target_batch_size=2)
    stage = Stage(other, 1, device=torch.device("cpu"))
    try:
        save_checkpoint(checkpoint_path(tmp_path / "ckpt", "exp", 1), stage.state_tensors(), spec=other, stage=1,
                        version=3)
    finally:
        stage.shutdown()
    with pytest.raises(UserError, match="written for another model or layout"):
        export_checkpoints(tmp_path / "ckpt", "exp", tmp_path / "hf")


@torch.no_grad()
def test_a_bpe_runs_export_carries_its_tokenizer_and_generates_text(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    blob = train_bpe([b"the model learns the words of the corpus " * 40, b"def main():\n    return 0\n" * 30], 300)
    tokenizer = BpeTokenizer(blob)
    write_checkpoints(tmp_path / "ckpt", "llama", tokenizer=tokenizer.id, vocab_size=tokenizer.vocab_size)
    with pytest.raises(UserError, match="peers write the run's tokenizer.json beside their checkpoints"):
        export_checkpoints(tmp_path / "ckpt", "exp", tmp_path / "hf")  # none there yet
    other = tmp_path / "other.json"
    other.write_bytes(train_bpe([b"another corpus entirely " * 40], 280))
    with pytest.raises(UserError, match="not the run's"):
        export_checkpoints(tmp_path / "ckpt", "exp", tmp_path / "hf", tokenizer_file=other)
    (tmp_path / "ckpt" / "tokenizer.json").write_bytes(blob)  # as a peer with --checkpoint-dir writes it
    export_checkpoints(tmp_path / "ckpt", "exp", tmp_path / "hf")
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def main():\n    return the words"
    ids = hf_tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == tokenizer.encode(text) and hf_tokenizer.decode(ids[0]) == text
    assert hf_tokenizer.eos_token_id == tokenizer.end_of_text
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    generated = model.generate(ids[:, :8], max_new_tokens=6, do_sample=False)
    assert generated.shape[1] > 8 and isinstance(hf_tokenizer.decode(generated[0]), str)
