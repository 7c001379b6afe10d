"""The memory a peer needs to train one stage: a cost model of what :class:`swarm.stage.Stage` holds.

A peer checks it before it takes a stage (``peer.profiler.stage_memory_budget``), the bootstrap
picks the number of stages by it (``--num-stages 0``), and a layout re-plan gives no peer more layers
than it offers memory for (``peer.relayout``). ``t`` = microbatch_size × seq_len tokens per
microbatch, ``P`` the stage's parameters and ``W = 4 P`` bytes, one float32 copy of them (the
masters are float32 in every precision).

* **Static, 4 W**: the master parameters, the weight version forwards run on (swarm/stage.py), and
  AdamW's ``exp_avg`` and ``exp_avg_sq``.
* **Held graph, A per microbatch**: what autograd saves for a backward, per token and block (read off
  the saved tensors of ``swarm.model``'s blocks; "floats" are float32, 4 bytes):

  - llama: ``10 d + 4 F + H + 2`` floats: the block's input; each RMSNorm's normalised input and
    1/rms; the normed input the projections share; q, k and v at all H heads (k and v after the
    grouped-query repeat); the attention output (the o_proj input is a view of it) and its
    log-sum-exp (H); the residual sum; gate, up, silu(gate) and their product (F = ``ffn_width``).
    Plus the rotary tables, ``2 seq_len head_dim`` per block and microbatch.
  - gpt: ``8 d + 2 F + H + 4`` floats: the input and each LayerNorm's mean and 1/std; the normed
    inputs; the fused qkv output (3 d; q, k and v are views of it); the attention output and
    log-sum-exp; the residual sum; the MLP's hidden before and after GELU.
  - ``precision = "bf16"`` (autocast): the matmuls' inputs and outputs are saved in bf16 (2 bytes),
    the norms' in float32; each held graph also keeps the bf16 copies autocast made of the block's
    matrices (2 bytes a weight). The residual stream is float32 on stage 0 (the embedding's output)
    and bf16 after (the input arrives in bf16); with a float32 residual each projection casts its
    input apart (llama: 9 d bf16 instead of 6 d). The exact sets are in :func:`block_saved_bytes`.
  - with activation checkpointing: the block's input alone, ``d`` elements of the residual stream.

  A stage adds the token ids (stage 0, int64), its output (``d`` in the activation dtype; every stage
  but the last) or the head (the last: the final norm's saved tensors, the head's input, the float32
  logits and their log-softmax, 2 V floats, the targets; in bf16 also the head matrix's copy).
* **Recompute, R**: with checkpointing, one block's full set of saved tensors, rebuilt in the backward.
* **Working set, K**: gradients alive together inside a backward: 3 F per token for llama (the
  SwiGLU product's gradient and its two factors', in the activation dtype), 2 F for gpt, 2 V floats
  at the head (the gradients of the log-probabilities and of the logits).
* **Gradients**: ``torch.autograd.grad`` returns the stage's weight gradients (W) at the end of a
  backward, and the stage adds them to its buffer (W; a clone the first time).

A first or middle stage holds the graphs of ``n`` microbatches (``max_in_flight``; under the ``flush``
schedule no more than a batch has); their gradients come back one at a time. A backward frees its
graph block by block while it builds the weight gradients, so it peaks at ``max(A, W)`` plus R + K.
The peak of a step is the largest of, over the static 4 W:

* the first backward: ``(n-1) A + max(A, W) + R + K``, and at its end ``(n-1) A + 2 W``;
* a later one, beside the buffer: ``W + (n-2) A + max(A, W) + R + K``; or ``W + (n-1) A + ...``
  where new microbatches keep the stage at ``n`` graphs while the buffer fills (a batch of more
  microbatches than are in flight, or the ``delayed`` schedule, whose microbatches flow across steps);
* the optimizer step: ``W`` of gradients and AdamW's temporary, one parameter's size.

The last stage runs a microbatch's forward, loss and backward in one go (``forward_loss_backward``):
it holds one graph, ``n`` = 1 and its buffer already exists from the second microbatch on.

Not modelled: attention scores. ``F.scaled_dot_product_attention`` runs the flash kernel on CPU and
flash or memory-efficient ones on CUDA, which never materialise the ``seq_len²`` scores; torch's math
fallback would save ``H seq_len`` floats more per token and block. Nor are network buffers (a
microbatch's serialized activations), CUDA's caching allocator, or glibc's heap slack
(bench/stage_memory.py measures with a fixed mmap threshold; with glibc's defaults a step's resident
peak came out 8-20 % higher). tests/unit/test_memory_estimate.py holds the model within 15 % of
steps measured on CPU, float32 and bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

from dht.layouts import even_stage_layers
from dht.records import ModelSpec, RunSpec
from swarm.model import block_matmul_params, layer_num_params

MIB = 2**20
FLOAT_BYTES = 4  # float32 parameters, optimizer state and activations
FIXED_OVERHEAD_BYTES = 600 * MIB  # interpreter, torch, hivemind, p2pd (bench/model_scale.py measures a peer's)


@dataclass(frozen=True)
class StageMemory:
    """The parts of :mod:`peer.memory_model`'s cost model for one stage, in bytes (the overhead apart)."""

    static_bytes: int  # 4 W
    gradient_bytes: int  # W
    held_bytes: int  # A, one microbatch's saved tensors
    recompute_bytes: int  # R (0 without checkpointing)
    working_bytes: int  # K
    largest_param_bytes: int  # AdamW's temporary at the step
    num_held: int  # n: graphs held at once (1 on the last stage)
    num_per_batch: int  # microbatches between two steps (0: no limit, the delayed schedule)

    @property
    def peak_bytes(self) -> int:
        """The largest of the phases (the module docstring)."""
        a, w, n = self.held_bytes, self.gradient_bytes, self.num_held
        during = max(a, w) + self.recompute_bytes + self.working_bytes
        # a backward that finds the buffer while n graphs are held: more microbatches to a batch than in flight
        buffer_beside_all = self.num_per_batch == 0 or self.num_per_batch > n
        phases = [w + self.largest_param_bytes, (n - 1) * a + during, (n - 1) * a + 2 * w]  # step, first backward
        if buffer_beside_all:
            phases.append(w + (n - 1) * a + during)
        elif n > 1:
            phases.append(w + (n - 2) * a + during)
        return self.static_bytes + max(phases)


def activation_bytes(spec: RunSpec) -> int:
    """Bytes of an activation element between stages, and of a gradient inside the blocks."""
    return 2 if spec.precision == "bf16" else 4


def residual_bytes(spec: RunSpec, stage: int) -> int:
    """Bytes of a residual-stream element: float32, but bf16 after stage 0 of a bf16 run."""
    return 2 if spec.precision == "bf16" and stage > 0 else 4


def block_saved_bytes(model: ModelSpec, *, precision: str = "fp32", residual: int = 4,
                      checkpoint_activations: bool = False) -> int:
    """Bytes a block saves for its backward, per token (the module docstring); ``residual``: the
    bytes of a residual-stream element."""
    d, ffn, heads = model.d_model, model.ffn_width, model.num_heads
    if checkpoint_activations:
        return residual * d
    if precision == "bf16":  # the norms' tensors in float32, the matmuls' inputs and outputs in bf16
        if model.family == "llama":  # the norms upcast their input; a float32 one is cast per projection
            return 4 * (4 * d + heads + 2) + 2 * ((9 if residual == 4 else 6) * d + 4 * ffn)
        return residual * 2 * d + 4 * (heads + 4) + 2 * (6 * d + 2 * ffn)
    if model.family == "llama":
        return 4 * (10 * d + 4 * ffn + heads + 2)
    return 4 * (8 * d + 2 * ffn + heads + 4)


def block_graph_bytes(model: ModelSpec, *, precision: str = "fp32", checkpoint_activations: bool = False) -> int:
    """Bytes a block saves per microbatch whatever its size: llama's rotary cos and sin tables, and
    under bf16 autocast's copies of the block's matrices."""
    if checkpoint_activations:
        return 0
    element = 2 if precision == "bf16" else 4
    tables = 2 * model.seq_len * model.head_dim * element if model.family == "llama" else 0
    return tables + (2 * block_matmul_params(model) if precision == "bf16" else 0)


def head_saved_bytes(model: ModelSpec, *, precision: str = "fp32", residual: int = 4) -> int:
    """Bytes the last stage saves per token after its last block: the final norm's saved tensors
    (llama's in float32: it upcasts), the head's input, the float32 logits and their log-softmax,
    the int64 targets."""
    d = model.d_model
    norm = 4 * (2 * d + 1) if model.family == "llama" else residual * d + 8
    return norm + (2 if precision == "bf16" else 4) * d + 8 * model.vocab_size + 8


def working_bytes(model: ModelSpec, *, precision: str = "fp32", is_last: bool) -> int:
    """Bytes of gradients alive together inside a backward, per token (K)."""
    block = (3 if model.family == "llama" else 2) * model.ffn_width * (2 if precision == "bf16" else 4)
    return max(block, 8 * model.vocab_size) if is_last else block


def num_held(spec: RunSpec, *, max_in_flight: int) -> int:
    """Graphs a first or middle stage holds at most: ``max_in_flight``, but under ``flush`` no more
    than one batch's microbatches."""
    if spec.pipeline_schedule == "flush":
        return max(1, min(max_in_flight, -(-spec.target_batch_size // spec.microbatch_size)))
    return max_in_flight


def stage_memory(spec: RunSpec, stage: int, *, max_in_flight: int, checkpoint_activations: bool = False) -> StageMemory:
    """The cost model's parts for training ``stage`` of ``spec`` on one peer."""
    model, precision = spec.model, spec.precision
    start, end = spec.stage_layers[stage]
    is_first, is_last = stage == 0, stage == spec.num_stages - 1
    tokens = spec.microbatch_size * model.seq_len
    residual = residual_bytes(spec, stage)
    flags = {"precision": precision, "checkpoint_activations": checkpoint_activations}
    per_token = (end - start) * block_saved_bytes(model, residual=residual, **flags) + (8 if is_first else 0)
    per_token += (head_saved_bytes(model, precision=precision, residual=residual) if is_last
                  else activation_bytes(spec) * model.d_model)
    if precision == "bf16" and model.family == "llama" and not is_first and not checkpoint_activations:
        per_token += 2 * model.d_model  # the bf16 input, held beside the first norm's float32 copy of it
    graph = (end - start) * block_graph_bytes(model, **flags)
    graph += 2 * model.vocab_size * model.d_model if is_last and precision == "bf16" else 0  # the head's copy
    recompute = 0
    if checkpoint_activations:
        recompute = tokens * block_saved_bytes(model, precision=precision, residual=residual) + block_graph_bytes(
            model, precision=precision)
    params = sum(layer_num_params(spec)[start:end])
    return StageMemory(
        static_bytes=4 * FLOAT_BYTES * params + subspace_bytes(model), gradient_bytes=FLOAT_BYTES * params,
        held_bytes=tokens * per_token + graph, recompute_bytes=recompute,
        working_bytes=tokens * working_bytes(model, precision=precision, is_last=is_last),
        largest_param_bytes=FLOAT_BYTES * largest_param(model, is_first=is_first, is_last=is_last),
        num_held=1 if is_last else num_held(spec, max_in_flight=max_in_flight),
        num_per_batch=0 if spec.pipeline_schedule == "delayed" else -(-spec.target_batch_size // spec.microbatch_size))


def largest_param(model: ModelSpec, *, is_first: bool, is_last: bool) -> int:
    """Elements of a stage's largest parameter tensor (AdamW's step works one tensor at a time)."""
    d, ffn = model.d_model, model.ffn_width
    sizes = [d * ffn, d * d if model.family == "llama" else 3 * d * d]
    if is_first or is_last:
        sizes.append(model.vocab_size * d)
    return max(sizes)


def stage_memory_bytes(spec: RunSpec, stage: int, *, max_in_flight: int, checkpoint_activations: bool = False) -> int:
    """Bytes a peer needs to train ``stage``: the cost model's peak plus ``FIXED_OVERHEAD_BYTES``."""
    parts = stage_memory(spec, stage, max_in_flight=max_in_flight, checkpoint_activations=checkpoint_activations)
    return parts.peak_bytes + FIXED_OVERHEAD_BYTES


def layer_memory_bytes(spec: RunSpec, *, max_in_flight: int, checkpoint_activations: bool = False) -> tuple[int, ...]:
    """What each block adds to a stage's need, additively (for the re-planner, which sums them over a
    stage's layers): its parameters six times (static, buffer, gradients) and its saved tensors for
    ``max_in_flight`` microbatches (a float32 residual stream); the embedding and token ids count
    with the first block, the head with the last. For any stage, :func:`stage_memory_bytes` is at
    most its blocks' sum plus :func:`stage_overhead_bytes`: the sum bounds every phase of the
    module docstring."""
    model, precision = spec.model, spec.precision
    n = num_held(spec, max_in_flight=max_in_flight)
    tokens = spec.microbatch_size * model.seq_len
    flags = {"precision": precision, "checkpoint_activations": checkpoint_activations}
    block = tokens * block_saved_bytes(model, **flags) + block_graph_bytes(model, **flags)
    sizes = [6 * FLOAT_BYTES * params + n * block for params in layer_num_params(spec)]
    sizes[0] += n * tokens * 8
    head_copy = 2 * model.vocab_size * model.d_model if precision == "bf16" else 0
    sizes[-1] += n * (tokens * head_saved_bytes(model, precision=precision) + head_copy)
    return tuple(sizes)


def stage_overhead_bytes(spec: RunSpec, *, max_in_flight: int, checkpoint_activations: bool = False) -> int:
    """What any stage needs beyond its blocks' :func:`layer_memory_bytes`: ``FIXED_OVERHEAD_BYTES``,
    the held inputs and outputs, the working set and checkpointing's recompute."""
    model, precision = spec.model, spec.precision
    tokens = spec.microbatch_size * model.seq_len
    io_bytes = activation_bytes(spec) + (2 if precision == "bf16" else 0)  # the output; llama's bf16 input
    held_io = num_held(spec, max_in_flight=max_in_flight) * tokens * model.d_model * io_bytes
    recompute = 0
    if checkpoint_activations:
        recompute = tokens * block_saved_bytes(model, precision=precision) + block_graph_bytes(model, precision=precision)
    return (FIXED_OVERHEAD_BYTES + held_io + recompute + tokens * working_bytes(model, precision=precision, is_last=True)
            + subspace_bytes(model))


def subspace_bytes(model: ModelSpec) -> int:
    """A subspace run's fixed tables, on every stage (``swarm.subspace``): the base embeddings and the basis."""
    if not model.boundary_subspace:
        return 0
    rows = model.vocab_size + (model.seq_len if model.family == "gpt" else 0) + model.boundary_subspace
    return FLOAT_BYTES * rows * model.d_model


def stage_bound_bytes(spec: RunSpec, stage: int, *, max_in_flight: int, checkpoint_activations: bool = False) -> int:
    """The re-planner's figure for ``stage``: its blocks' :func:`layer_memory_bytes` plus
    :func:`stage_overhead_bytes` (at least :func:`stage_memory_bytes`)."""
    start, end = spec.stage_layers[stage]
    flags = {"max_in_flight": max_in_flight, "checkpoint_activations": checkpoint_activations}
    return sum(layer_memory_bytes(spec, **flags)[start:end]) + stage_overhead_bytes(spec, **flags)


def memory_table(model: ModelSpec, *, num_stages: int, microbatch_size: int, max_in_flight: int,
                 target_batch_size: int | None = None) -> dict:
    """Parameters and the memory a stage needs (``stage_memory_bytes``: the most any stage of the
    split needs), with and without activation checkpointing, for the whole model as one stage and
    for ``num_stages`` even stages; the batch is ``max_in_flight`` microbatches unless given."""
    batch = target_batch_size or max_in_flight * microbatch_size
    row: dict = {"params": sum(layer_num_params(RunSpec(run_id="t", model=model, stage_layers=((0, model.num_layers),))))}
    for key, stages in (("one_stage", 1), ("split", num_stages)):
        spec = RunSpec(run_id="t", model=model, stage_layers=even_stage_layers(model.num_layers, stages),
                       microbatch_size=microbatch_size, target_batch_size=batch)
        for checkpointing in (False, True):
            need = max(stage_memory_bytes(spec, k, max_in_flight=max_in_flight, checkpoint_activations=checkpointing)
                       for k in range(stages))
            row[f"{key}_bytes{'_checkpointed' if checkpointing else ''}"] = need
    return row | {"num_stages": num_stages, "microbatch_size": microbatch_size, "max_in_flight": max_in_flight}

