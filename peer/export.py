"""Export a run's model from its stage checkpoints into a Hugging Face folder.

    .venv/bin/python -m peer.export --checkpoint-dir ckpt --run-id demo --out hf-demo

Reads ``<dir>/<run_id>-stage<k>.safetensors`` for every stage (the files peers write with
``--checkpoint-dir``; each carries the run spec it was written under, checked against the others and
loaded with the same checks a resuming peer applies), and writes ``config.json`` and
``model.safetensors`` that ``transformers`` loads as ``LlamaForCausalLM`` (llama family) or
``GPT2LMHeadModel`` (gpt family): ``AutoModelForCausalLM.from_pretrained("hf-demo")``. Tokens are
bytes (vocabulary 256): ``list(text.encode())`` is the input, ``bytes(ids).decode(errors="replace")``
the output. ``transformers`` is not needed to export, only to load the result.

A mistake (no checkpoint, a stage missing, checkpoints of different runs or layouts) ends in one
sentence and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors.torch import save_file

from peer.checkpoint import CheckpointError, checkpoint_path, checkpoint_spec, load_checkpoint
from peer.errors import UserError
from swarm.hf_export import hf_config, hf_state_dict

MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"


def export_checkpoints(checkpoint_dir: Path, run_id: str, out_dir: Path) -> dict:
    """Write the Hugging Face folder ``out_dir`` from the run's stage checkpoints in ``checkpoint_dir``;
    returns what was exported (family, parameters, each stage's step). ``UserError`` on a mistake."""
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
        parameters[stage] = {name.removeprefix("model."): t for name, t in state.items() if name.startswith("model.")}
    tensors = hf_state_dict(spec, parameters)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / MODEL_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(hf_config(spec), indent=2, sort_keys=True) + "\n")
    return {"family": spec.model.family, "parameters": sum(t.numel() for t in tensors.values()),
            "stage_steps": steps, "out": str(out_dir)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", required=True, help="the folder peers wrote stage checkpoints to")
    parser.add_argument("--run-id", default="demo", help="the run whose checkpoints to export")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write (created if missing)")
    args = parser.parse_args(argv)
    try:
        result = export_checkpoints(Path(args.checkpoint_dir), args.run_id, Path(args.out))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    steps = ", ".join(f"stage {k} step {v}" for k, v in sorted(result["stage_steps"].items()))
    print(f"exported run {args.run_id} ({result['family']}, {result['parameters']:,} parameters; {steps}) to "
          f"{result['out']}: AutoModelForCausalLM.from_pretrained({result['out']!r}) loads it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
