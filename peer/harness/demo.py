"""The README's first command: a real local swarm that trains the default model, with live progress.

    python -m peer.harness.demo [--num-peers 4] [--duration 150] [--microbatches N] [--preset tiny] [--tokenizer bpe]

Starts run_bootstrap.py (the Llama-style ``tiny`` preset; a BPE tokenizer it trains on the built-in
corpus, which the peers obtain from the swarm) and N run_peer.py processes on 127.0.0.1 (they find
each other through the DHT and negotiate their stages themselves), prints the swarm's loss,
tokens/s and peers per stage and its latest held-out loss (measured through the pipeline by the
stage-0 peers) every few seconds, stops every process after ``--duration`` seconds of training
(or sooner, once the last stage has computed ``--microbatches``: a test waits on that event), and prints the initial and final loss. The peers checkpoint their stages when they leave; the demo
then exports the run to a Hugging Face folder (``peer.export``) and prints what the model writes
after a fixed prompt. Exits 0 if the loss fell and the export was written.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

from peer.errors import UserError
from peer.export import export_checkpoints, sample_checkpoints
from peer.harness.local_swarm import LocalSwarm, wait_for
from swarm.generation import SAMPLE_PROMPT

LOSS_WINDOW = 20  # microbatches averaged for the initial and the final loss
DEMO_VOCAB = 4096


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-peers", type=int, default=4, help="peer processes to start (default: 4)")
    parser.add_argument("--num-stages", type=int, default=2, help="pipeline stages (default: 2)")
    parser.add_argument("--duration", type=float, default=150.0, help="seconds of training (default: 150)")
    parser.add_argument("--microbatches", type=int, default=0,
                        help="stop sooner, once the last stage has computed this many microbatches (default: 0, off)")
    parser.add_argument("--workdir", default=f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}", help="where logs go")
    parser.add_argument("--print-period", type=float, default=5.0, help="seconds between progress lines")
    parser.add_argument("--preset", default="tiny", help="the model (run_bootstrap.py --preset; default: tiny)")
    parser.add_argument("--tokenizer", default="bpe", help="bpe (trained on the corpus) or bytes (default: bpe)")
    parser.add_argument("--vocab-size", type=int, default=DEMO_VOCAB, help=f"with --tokenizer bpe (default: {DEMO_VOCAB})")
    args = parser.parse_args(argv)
    if args.num_peers < args.num_stages:
        parser.error("need at least one peer per stage")
    swarm = LocalSwarm(args.workdir)
    try:
        status = run_demo(swarm, args)
    except (TimeoutError, RuntimeError) as e:
        print(f"demo failed: {e}\n{swarm.logs()}", file=sys.stderr)
        return 1
    finally:
        print("stopping every process ...", flush=True)
        swarm.shutdown()
        print(f"logs and metrics: {Path(args.workdir).resolve()}")
    return status or export_and_sample(Path(args.workdir), swarm.run_id)


def export_and_sample(workdir: Path, run_id: str) -> int:
    """Export the stage checkpoints the peers wrote as they left, and print a sample of the model."""
    checkpoints, out = workdir / "checkpoints", workdir / "hf"
    try:
        result = export_checkpoints(checkpoints, run_id, out)
        sample = sample_checkpoints(checkpoints, run_id, prompt=SAMPLE_PROMPT)
    except UserError as e:
        print(f"demo failed: could not export the run: {e}", file=sys.stderr)
        return 1
    print(f"exported {result['parameters']:,} parameters to {out}: transformers' "
          f"AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load it")
    print(f"sample: {SAMPLE_PROMPT!r} → {sample!r}")
    return 0


def run_demo(swarm: LocalSwarm, args: argparse.Namespace) -> int:
    maddrs = swarm.start_bootstrap("--num-stages", str(args.num_stages), "--averaging-period", "10",
                                   "--preset", args.preset, "--tokenizer", args.tokenizer,
                                   "--vocab-size", str(args.vocab_size))
    print(f"bootstrap up at {maddrs[0]}", flush=True)
    # all at once (concurrent joiners negotiate among themselves): peers that share one machine
    # measure their FLOP/s together, under the same load; one started alone a second before the
    # others measured up to 5x faster than they did, and they placed themselves 1 + 3 around it
    for _ in range(args.num_peers):
        swarm.start_peer("--num-threads", "1", "--checkpoint-dir", str(Path(args.workdir) / "checkpoints"))
    wait_for(lambda: all(p.events("status") or not p.is_alive() for p in swarm.peers), 120, "every peer to train")
    dead = [p for p in swarm.peers if not p.is_alive()]
    if dead:
        raise RuntimeError(f"{dead[0].name} exited while joining")
    until = f" or {args.microbatches} microbatches" if args.microbatches else ""
    print(f"{args.num_peers} peers training; running for {args.duration:.0f}s{until}", flush=True)
    started = time.monotonic()
    while time.monotonic() - started < args.duration:
        if args.microbatches and len(last_stage_losses(swarm)) >= args.microbatches:
            print(f"the last stage computed {args.microbatches} microbatches", flush=True)
            break
        time.sleep(min(args.print_period, max(0.0, args.duration - (time.monotonic() - started))))
        print(progress_line(swarm, time.monotonic() - started, args.print_period), flush=True)
    initial, final = loss_trend(swarm)
    vocab = 256 if args.tokenizer == "bytes" else args.vocab_size
    print(f"initial loss {initial:.3f} → final loss {final:.3f} (nats/token; ln {vocab} = {math.log(vocab):.3f} is "
          f"chance); held-out loss {latest_val_loss(swarm):.3f}")
    return 0 if final < initial else 1


def progress_line(swarm: LocalSwarm, elapsed: float, window: float) -> str:
    now = time.time()
    last_stage = max((e["stage"] for p in swarm.peers for e in p.events("status")[-1:]), default=0)
    microbatches = [e for p in swarm.peers for e in p.events("microbatch")]
    recent = [e for e in microbatches if e["t"] > now - window]
    losses = [e["loss"] for e in recent if e["stage"] == last_stage and e.get("loss") is not None]
    tokens = sum(e.get("tokens", 0) for e in recent if e["stage"] == 0) / window
    stages: dict[int, int] = {}
    for peer in swarm.peers:
        status = peer.events("status")[-1:]
        if status and peer.is_alive():
            stages[status[0]["stage"]] = stages.get(status[0]["stage"], 0) + 1
    loss = statistics.mean(losses) if losses else math.nan
    layout = ", ".join(f"stage {k}: {n} peer{'s' * (n != 1)}" for k, n in sorted(stages.items()))
    return f"[{elapsed:5.0f}s] loss {loss:.3f} | held-out {latest_val_loss(swarm):.3f} | {tokens:,.0f} tokens/s | {layout}"


def latest_val_loss(swarm: LocalSwarm) -> float:
    """The newest held-out loss any stage-0 peer measured through the pipeline (NaN before the first)."""
    evals = [e for p in swarm.peers for e in p.events("eval")]
    return max(evals, key=lambda e: e["t"])["val_loss"] if evals else math.nan


def last_stage_losses(swarm: LocalSwarm) -> list[tuple[float, float]]:
    """(time, loss) of every microbatch the last stage computed, oldest first."""
    stages = [e["stage"] for p in swarm.peers for e in p.events("microbatch")]
    if not stages:
        return []
    last = max(stages)
    return sorted((e["t"], e["loss"]) for p in swarm.peers for e in p.events("microbatch")
                  if e["stage"] == last and e.get("loss") is not None)


def loss_trend(swarm: LocalSwarm) -> tuple[float, float]:
    """Mean loss of the first and of the last LOSS_WINDOW microbatches the last stage computed."""
    losses = last_stage_losses(swarm)
    if not losses:
        raise RuntimeError("no microbatch completed")
    if len(losses) < 2 * LOSS_WINDOW:
        raise RuntimeError(f"only {len(losses)} microbatches completed")
    return (statistics.mean(l for _, l in losses[:LOSS_WINDOW]), statistics.mean(l for _, l in losses[-LOSS_WINDOW:]))


if __name__ == "__main__":
    sys.exit(main())
