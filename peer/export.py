"""Export a run's model into a Hugging Face folder, from its stage checkpoints or from a live swarm.

    .venv/bin/python -m peer.export --checkpoint-dir ckpt --run-id demo --out hf-demo
    .venv/bin/python -m peer.export --bootstrap /ip4/…/p2p/… --run-id demo --out hf-demo

From checkpoints it reads ``<dir>/<run_id>-stage<k>.safetensors`` for every stage (the files peers
write with ``--checkpoint-dir``; each carries the run spec it was written under, checked against the
others and loaded with the same checks a resuming peer applies). From a live swarm it joins the DHT
as a visitor and pulls the newest state of every stage from its holders as a joiner would
(``peer.gather``), without taking part in training. Either way it writes ``config.json`` and
``model.safetensors`` that ``transformers`` loads as ``LlamaForCausalLM`` (llama family) or
``GPT2LMHeadModel`` (gpt family): ``AutoModelForCausalLM.from_pretrained("hf-demo")``. A BPE run's
tokenizer goes with it (``tokenizer.json`` and ``tokenizer_config.json``, which
``AutoTokenizer.from_pretrained("hf-demo")`` loads): the one peers wrote beside their checkpoints, or
``--tokenizer FILE``, either checked against the hash the run spec names. A byte-token run has no
tokenizer file: ``list(text.encode())`` is the input, ``bytes(ids).decode(errors="replace")`` the
output. ``transformers`` is not needed to export, only to load the result.

A mistake (no checkpoint, a stage missing, checkpoints of different runs or layouts) ends in one
sentence and exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from dht.records import RunSpec
from peer.checkpoint import CheckpointError, checkpoint_path, checkpoint_spec, load_checkpoint
from peer.config import PeerConfig
from peer.errors import UserError
from peer.gather import gather_model, stage_parameters
from peer.join import bootstrap_peer_ids, fetch_spec, open_swarm_dht
from peer.training_data import TOKENIZER_FILE
from swarm.generation import SAMPLE_PROMPT, continue_text, stage_models
from swarm.hf_export import hf_config, hf_state_dict
from swarm.tokenizer import BYTES, END_OF_TEXT, BpeTokenizer, ByteTokenizer, TokenizerError, load_tokenizer, read_tokenizer_file
from swarm.view import SwarmView

MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"


def export_checkpoints(checkpoint_dir: Path, run_id: str, out_dir: Path, *, tokenizer_file: Path | None = None) -> dict:
    """Write the Hugging Face folder ``out_dir`` from the run's stage checkpoints in ``checkpoint_dir``;
    returns what was exported (family, parameters, each stage's step). ``UserError`` on a mistake."""
    spec, parameters, steps = load_run_checkpoints(checkpoint_dir, run_id)
    tokenizer = run_tokenizer(spec, tokenizer_file or checkpoint_dir / TOKENIZER_FILE)
    return write_export(spec, parameters, steps, tokenizer, out_dir)


async def export_live(config: PeerConfig, out_dir: Path) -> dict:
    """Write the Hugging Face folder ``out_dir`` from the newest state of every stage of the live run
    ``config.run_id``, reached through ``config.bootstrap``; ``UserError`` on a mistake."""
    dht, _validator = await open_swarm_dht(config, is_visitor=True)  # client mode, a fresh identity
    view = None
    try:
        spec = await fetch_spec(dht, config.run_id, timeout=config.join_timeout, owner=config.run_owner,
                                bootstraps=bootstrap_peer_ids(config.bootstrap))
        view = SwarmView(dht, spec.run_id)
        model = await gather_model(await dht.replicate_p2p(), spec, view, config=config, peer_id=dht.peer_id.to_base58())
        tokenizer = model.tokenizer if isinstance(model.tokenizer, BpeTokenizer) else None
        return write_export(model.spec, model.parameters, model.steps, tokenizer, out_dir)
    finally:
        if view is not None:
            await view.shutdown()
        dht.shutdown()


def write_export(spec: RunSpec, parameters: dict[int, dict[str, torch.Tensor]], steps: dict[int, int],
                 tokenizer: BpeTokenizer | None, out_dir: Path) -> dict:
    tensors = hf_state_dict(spec, parameters)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / MODEL_FILE), metadata={"format": "pt"})
    config = hf_config(spec)
    if tokenizer is not None:
        write_tokenizer(out_dir, tokenizer, spec)
        config.update(bos_token_id=tokenizer.end_of_text, eos_token_id=tokenizer.end_of_text)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return {"family": spec.model.family, "parameters": sum(t.numel() for t in tensors.values()),
            "stage_steps": steps, "out": str(out_dir)}


def sample_checkpoints(checkpoint_dir: Path, run_id: str, *, tokenizer_file: Path | None = None,
                       prompt: str = SAMPLE_PROMPT) -> str:
    """A continuation of ``prompt`` by the model the run's stage checkpoints hold
    (``swarm.generation``); ``UserError`` on a mistake, as for an export."""
    spec, parameters, _ = load_run_checkpoints(checkpoint_dir, run_id)
    tokenizer = run_tokenizer(spec, tokenizer_file or checkpoint_dir / TOKENIZER_FILE) or ByteTokenizer()
    return continue_text(stage_models(spec, parameters), tokenizer, seq_len=spec.model.seq_len, prompt=prompt)


def load_run_checkpoints(checkpoint_dir: Path, run_id: str) -> tuple[RunSpec, dict[int, dict[str, torch.Tensor]], dict[int, int]]:
    """The run's spec, every stage's parameters (named as ``StageModel.state_dict()``) and step, from
    its stage checkpoints, checked as a resuming peer checks them; ``UserError`` on a mistake."""
    first = checkpoint_path(checkpoint_dir, run_id, 0)
    try:
        spec = checkpoint_spec(first)
    except FileNotFoundError:
        raise UserError(f"{first} does not exist: give the --checkpoint-dir and --run-id the peers wrote "
                        "checkpoints with (--checkpoint-dir of run_peer.py).") from None
    except CheckpointError as e:
        raise UserError(f"{e}.") from None
    parameters, steps = {}, {}
    for stage in range(spec.num_stages):
        path = checkpoint_path(checkpoint_dir, run_id, stage)
        try:  # the same checks as a resuming peer's: this run and stage, this model and layout
            steps[stage], state = load_checkpoint(path, spec=spec, stage=stage)
        except FileNotFoundError:
            raise UserError(f"{path} does not exist: the run has {spec.num_stages} stages and every one needs "
                            "a checkpoint.") from None
        except CheckpointError as e:
            raise UserError(f"{e}.") from None
        parameters[stage] = stage_parameters(state)
    return spec, parameters, steps


def run_tokenizer(spec: RunSpec, path: Path) -> BpeTokenizer | None:
    """The BPE tokenizer the run names, read from ``path`` and checked (None for a byte-token run)."""
    if spec.tokenizer == BYTES:
        return None
    try:
        return load_tokenizer(spec.tokenizer, read_tokenizer_file(str(path)))
    except TokenizerError as e:
        raise UserError(f"{e}; peers write the run's tokenizer.json beside their checkpoints, or give it with "
                        f"--tokenizer.") from None


def write_tokenizer(out_dir: Path, tokenizer: BpeTokenizer, spec: RunSpec) -> None:
    """``tokenizer.json`` as the run used it, and the ``tokenizer_config.json`` that makes
    ``AutoTokenizer`` load it as a fast tokenizer with its end-of-text token."""
    (out_dir / TOKENIZER_FILE).write_bytes(tokenizer.blob)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": spec.model.seq_len,
              "bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "unk_token": None, "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peer.export", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint-dir", help="the folder peers wrote stage checkpoints to")
    source.add_argument("--bootstrap", nargs="+", help="multiaddr(s) of a bootstrap or any live peer of the run")
    parser.add_argument("--run-id", default="demo", help="the run to export")
    parser.add_argument("--run-owner", help="with --bootstrap: the run owner's key, as the bootstrap's join line prints it")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write (created if missing)")
    parser.add_argument("--tokenizer", help="a BPE run's tokenizer.json (default: the one in --checkpoint-dir, or the swarm's)")
    args = parser.parse_args(argv)
    try:
        if args.bootstrap:
            config = PeerConfig(bootstrap=tuple(args.bootstrap), run_id=args.run_id, run_owner=args.run_owner,
                                tokenizer=args.tokenizer)
            result = asyncio.run(export_live(config, Path(args.out)))
        else:
            result = export_checkpoints(Path(args.checkpoint_dir), args.run_id, Path(args.out),
                                        tokenizer_file=Path(args.tokenizer) if args.tokenizer else None)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except ValueError as e:  # a setting the user got wrong (e.g. a malformed run id)
        print(f"error: {e}.", file=sys.stderr)
        return 2
    steps = ", ".join(f"stage {k} step {v}" for k, v in sorted(result["stage_steps"].items()))
    print(f"exported run {args.run_id} ({result['family']}, {result['parameters']:,} parameters; {steps}) to "
          f"{result['out']}: AutoModelForCausalLM.from_pretrained({result['out']!r}) loads it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
