"""The measured peak memory of one training step of one stage on CPU, in a fresh process.

    python -m bench.stage_memory --preset tiny --num-stages 2 --stage 0 [--max-in-flight 4]
        [--microbatch-size 16] [--precision fp32] [--activation-checkpointing]

What is measured is what a peer's :class:`swarm.stage.Stage` does for one batch under the default
``flush`` schedule, through its public calls: a first or middle stage runs the forward of
``max_in_flight`` microbatches (each keeps its graph, as the pipeline holds them), then the backward
of each (a random output gradient standing for the one the next stage returns), then the optimizer
step; the last stage runs ``forward_loss_backward`` on ``max_in_flight`` microbatches, then the step.
The batch is ``max_in_flight`` microbatches (``target_batch_size``), as with the peer's defaults
(64 samples, microbatches of 16, 4 in flight).

How: the step runs in a child process (nothing of an earlier measurement is left in its heap), which

1. sets ``MALLOC_MMAP_THRESHOLD_`` (64 KiB) before it starts, so every buffer of a tensor of 64 KiB
   or more is its own mapping, handed back to the kernel when the tensor is freed. By default glibc
   raises its threshold to the largest buffer freed so far (up to 32 MiB) and keeps freed buffers
   in its heap for reuse, so the resident peak is the live tensors plus however the heap happens to
   be fragmented: on 2026-11-26 the same step (``small``, stage 0 of 2, microbatches of 2) peaked at
   529 MiB with the fixed threshold, run after run, and at 630-637 MiB with glibc's defaults
   (``glibc_defaults`` measures that way; bench/model_scale.py reports both);
2. warms up: one microbatch through the very stage (a step of a batch of one), so that torch's lazy
   initialisation and its kernels' one-off buffers for these shapes count as the process's, not
   as the step's. They are a fixed cost of a peer that trains this shape, but not of its steps:
   oneDNN's bf16 kernels on CPU keep about 8-14 MiB for a ``tiny`` or ``small`` stage's shapes,
   which a warm-up on a smaller model charged to the step (float32's kernels about 1-2 MiB);
3. hands the warm-up's freed heap pages back to the kernel (``malloc_trim``: a step that reused them
   would not show them), resets the kernel's peak-RSS mark (``echo 5 > /proc/self/clear_refs``,
   Linux >= 4.0), reads
   VmRSS, runs the step, and reads VmHWM: the peak is VmHWM - that VmRSS. It includes everything the
   step allocated, torch's tensors and the rest (Python objects, MKL's buffers), and nothing the
   process held before (interpreter, torch: ``peer.profiler.FIXED_OVERHEAD_BYTES`` stands for that).

Left out: a peer's network buffers (a microbatch's serialized activations in and out), hivemind's
processes, CUDA (on a GPU, ``torch.cuda.max_memory_allocated`` is the figure to compare with).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the repository's packages come first
    sys.path.insert(0, str(ROOT))

MMAP_THRESHOLD_BYTES = 64 * 1024  # see the module docstring, 1.
WORKER_TIMEOUT = 600.0  # seconds one measurement may take (medium's step on two cores takes about a minute)


def measure_step_peak(spec_wire: dict, stage: int, *, max_in_flight: int, checkpoint_activations: bool,
                      num_threads: int = 1, timeout: float = WORKER_TIMEOUT, glibc_defaults: bool = False) -> dict:
    """Run one step of ``stage`` in a fresh process (the module docstring); returns its report:
    ``peak_bytes`` (VmHWM - VmRSS before the stage was built), ``baseline_bytes`` and ``seconds``.
    ``spec_wire`` is ``RunSpec.to_wire()``; its ``target_batch_size`` is made ``max_in_flight``
    microbatches. ``glibc_defaults``: leave malloc as a peer has it (no fixed mmap threshold)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if not glibc_defaults:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD_BYTES)
    args = [sys.executable, "-m", "bench.stage_memory", "--worker", json.dumps(spec_wire), "--stage", str(stage),
            "--max-in-flight", str(max_in_flight), "--num-threads", str(num_threads)]
    if checkpoint_activations:
        args.append("--activation-checkpointing")
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"the memory worker failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _read_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


async def _one_step(stage, spec, *, max_in_flight: int) -> None:
    """One batch of ``max_in_flight`` microbatches through ``stage`` and its optimizer step."""
    import torch

    model, mb = spec.model, spec.microbatch_size
    generator = torch.Generator().manual_seed(0)

    def inputs() -> torch.Tensor:
        if stage.is_first:
            return torch.randint(0, model.vocab_size, (mb, model.seq_len), generator=generator)
        return torch.randn(mb, model.seq_len, model.d_model, generator=generator)

    if stage.is_last:
        for _ in range(max_in_flight):
            targets = torch.randint(0, model.vocab_size, (mb, model.seq_len), generator=generator)
            loss, _ = await stage.forward_loss_backward(inputs(), targets)
            stage.record_microbatch(mb, loss)
    else:
        for k in range(max_in_flight):
            await stage.forward(f"mb{k}", inputs())
        for k in range(max_in_flight):
            grad = torch.randn(mb, model.seq_len, model.d_model, generator=generator) * 1e-3
            await stage.backward(f"mb{k}", grad)
            stage.record_microbatch(mb)
    await stage.wait_step_done()
    if stage.version != 1:
        raise RuntimeError(f"the stage took {stage.version} steps, not one")


def _run_step(spec, stage_index: int, *, max_in_flight: int, checkpoint_activations: bool) -> None:
    import torch

    from swarm.stage import Stage

    async def go() -> None:
        stage = Stage(spec, stage_index, device=torch.device("cpu"), checkpoint_activations=checkpoint_activations)
        try:
            await _one_step(stage, spec, max_in_flight=max_in_flight)
        finally:
            stage.shutdown()

    asyncio.run(go())


def worker(spec_json: str, stage: int, *, max_in_flight: int, checkpoint_activations: bool, num_threads: int) -> dict:
    """The child process's part: warm up, reset the peak mark, one step, the peak (module docstring)."""
    import time

    import torch

    from dht.records import RunSpec

    torch.set_num_threads(num_threads)
    spec = RunSpec.from_wire(json.loads(spec_json))
    spec = dataclasses.replace(spec, target_batch_size=max_in_flight * spec.microbatch_size)
    # the warm-up: one microbatch through the very stage (the module docstring, 2.)
    _run_step(dataclasses.replace(spec, target_batch_size=spec.microbatch_size), stage, max_in_flight=1,
              checkpoint_activations=checkpoint_activations)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the warm-up's freed heap pages go back: a reuse would hide them
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    baseline_kib = _read_status_kib("VmRSS")
    started = time.monotonic()
    _run_step(spec, stage, max_in_flight=max_in_flight, checkpoint_activations=checkpoint_activations)
    seconds = time.monotonic() - started
    peak_kib = _read_status_kib("VmHWM")
    return {"peak_bytes": (peak_kib - baseline_kib) * 1024, "baseline_bytes": baseline_kib * 1024,
            "seconds": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--max-in-flight", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=16)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--precision", default="fp32", help="the run's precision: fp32 or bf16")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--worker", metavar="SPEC_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.stage, max_in_flight=args.max_in_flight,
                                checkpoint_activations=args.activation_checkpointing, num_threads=args.num_threads)))
        return
    from dht.layouts import even_stage_layers
    from dht.records import RunSpec
    from peer.memory_model import stage_memory
    from swarm.presets import preset

    model = preset(args.preset)
    spec = RunSpec(run_id="memory", model=model, stage_layers=even_stage_layers(model.num_layers, args.num_stages),
                   microbatch_size=args.microbatch_size, target_batch_size=args.max_in_flight * args.microbatch_size,
                   precision=args.precision)
    flags = {"max_in_flight": args.max_in_flight, "checkpoint_activations": args.activation_checkpointing}
    measured = measure_step_peak(spec.to_wire(), args.stage, num_threads=args.num_threads, **flags)
    estimated = stage_memory(spec, args.stage, **flags).peak_bytes
    print(json.dumps({"bench": "stage_memory", "preset": args.preset, "stage": args.stage, **measured,
                      "estimated_bytes": estimated, "ratio": round(estimated / measured["peak_bytes"], 3)}))


if __name__ == "__main__":
    main()
