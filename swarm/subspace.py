"""A stage boundary of ``k`` numbers per token instead of ``d_model``: node0's subspace constraint (issue #16).

With ``ModelSpec.boundary_subspace = k`` > 0, every stage but the last keeps the residual stream in
``base(tokens) + span(U)``:

* ``U`` is a fixed ``d_model × k`` orthonormal basis drawn from the run seed (the Q of a seeded
  Gaussian matrix's QR, computed on the CPU in float64, so every peer and device holds the same one);
* ``base`` is the embedding the run seed initialises (``swarm.model.initial_embeddings``): the
  token's row, plus for the gpt family the position's row;
* every *writer* of the residual stream in those stages is projected onto ``span(U)`` whenever the
  stage publishes weights (when it is built, after a state load or an averaging round, after every
  optimizer step; :meth:`Subspace.project`): the token (and position) embedding's change since
  initialisation, and each block's attention output projection and MLP down projection with their
  biases (``swarm.model.RESIDUAL_PROJECTIONS``).

So the activations ``x`` a stage sends are exactly ``base + U c``, and the boundary carries
``c = Uᵀ (x − base)``: ``k`` numbers per token, which the run's boundary codec then compresses
(``SubspaceCodec`` wraps it). The next stage rebuilds ``x = base + U c``. Backward, ``dL/dc = Uᵀ dL/dx``:
``k`` numbers too. Both directions are exact (up to float rounding and the codec's own error): the
pipeline computes the gradient of the model it trains, and forwards equal the unconstrained forward
of the same weights, so the Hugging Face export (``swarm.hf_export``) and spot checks are unchanged.

To rebuild ``base`` every stage needs the sample's token ids: the requests of a subspace run carry the
whole sample window, ``seq_len + 1`` ids (the inputs are its first ``seq_len``, the targets its last
``seq_len``; :func:`request_ids`), where other runs carry the targets.

What it costs is the constraint itself: up to the last stage's first block, what the model adds to
its token embeddings lives in ``k`` dimensions (the last stage is free). BENCHMARKS.md measures the
loss per sample against the unconstrained swarm. Why node0's scheme and not IOTA's learned bottleneck:
docs/compression.md. A block that a new layout moves out of the last stage is projected when its new
stage first publishes weights (its function changes once, by dropping what it wrote outside the
subspace); one that moves into the last stage is free from then on.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn

from dht.records import ModelSpec, RunSpec
from swarm.boundary_codec import BoundaryCodec, boundary_codec, compression_ratio, require_finite
from swarm.model import RESIDUAL_PROJECTIONS, StageModel, initial_embeddings

SUBSPACE_SEED_OFFSET = 3_000_017


class Subspace:
    """The basis and the base embeddings of a subspace run, and the maps between ``x`` and ``c``.

    Tables are kept on the CPU and copied once to each device asked for.
    """

    def __init__(self, model: ModelSpec, seed: int) -> None:
        if not model.boundary_subspace:
            raise ValueError("the run's model has no boundary subspace (ModelSpec.boundary_subspace is 0)")
        self.dims = model.boundary_subspace
        generator = torch.Generator().manual_seed(seed + SUBSPACE_SEED_OFFSET)
        q, r = torch.linalg.qr(torch.randn(model.d_model, self.dims, generator=generator, dtype=torch.float64))
        self._basis = (q * torch.sign(torch.diagonal(r))).float()  # the sign fix makes Q unique
        self._tokens, self._positions = initial_embeddings(model, seed)
        self._writers = RESIDUAL_PROJECTIONS[model.family]
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(basis, token base, position base or None) on ``device``."""
        if device not in self._on_device:
            positions = self._positions.to(device) if self._positions is not None else None
            self._on_device[device] = (self._basis.to(device), self._tokens.to(device), positions)
        return self._on_device[device]

    def base(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, d_model)`` float32: the initial embedding of ``tokens`` (and of the positions)."""
        _, token_table, position_table = self.tables(tokens.device)
        base = token_table[tokens]
        return base if position_table is None else base + position_table[: tokens.shape[1]]

    def coordinates(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``c = Uᵀ (x − base(tokens))``, float32 ``(…, k)``: what a stage's activations send."""
        return (x.detach().float() - self.base(tokens.to(x.device))) @ self.tables(x.device)[0]

    def lift(self, coordinates: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``base(tokens) + U c`` (activations), or ``U c`` when ``tokens`` is None (a gradient)."""
        x = coordinates.float() @ self.tables(coordinates.device)[0].T
        return x if tokens is None else x + self.base(tokens.to(coordinates.device))

    def reduce(self, gradient: torch.Tensor) -> torch.Tensor:
        """``Uᵀ g``, float32 ``(…, k)``: what a gradient with respect to ``x`` sends."""
        return gradient.detach().float() @ self.tables(gradient.device)[0]

    @torch.no_grad()
    def project(self, model: StageModel) -> None:
        """Project ``model``'s residual writers onto ``span(U)`` in place; the last stage is free."""
        if model.is_last:
            return
        basis, token_table, position_table = self.tables(next(model.parameters()).device)
        projector = basis @ basis.T
        if model.is_first:
            model.tok_emb.weight.copy_(token_table + (model.tok_emb.weight - token_table) @ projector)
            if position_table is not None:
                model.pos_emb.weight.copy_(position_table + (model.pos_emb.weight - position_table) @ projector)
        for block in model.blocks:
            for name, module in block.named_modules():
                if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in self._writers:
                    module.weight.copy_(basis @ (basis.T @ module.weight))
                    if module.bias is not None:
                        module.bias.copy_(projector @ module.bias)


@functools.lru_cache(maxsize=4)
def _subspace(model: ModelSpec, seed: int) -> Subspace:
    return Subspace(model, seed)


def subspace_of(spec: RunSpec) -> Subspace | None:
    """The run's :class:`Subspace` (one per process and run: the stage, its server and its router
    share its tables), or None when the model has none."""
    return _subspace(spec.model, spec.seed) if spec.model.boundary_subspace else None


def request_ids(spec: RunSpec, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The token ids a microbatch's requests carry: its targets (int64), or in a subspace run its
    whole window (``seq_len + 1`` ids: the first input, then the targets) as int32, half the bytes."""
    if not spec.model.boundary_subspace:
        return targets
    return torch.cat((inputs[:, :1], targets), dim=1).to(request_ids_layout(spec, len(inputs))[1])


def request_ids_layout(spec: RunSpec, batch_size: int) -> tuple[tuple[int, int], torch.dtype]:
    """The shape and dtype of the token ids :func:`request_ids` gives for ``batch_size`` samples."""
    if not spec.model.boundary_subspace:
        return (batch_size, spec.model.seq_len), torch.int64
    return (batch_size, spec.model.seq_len + 1), torch.int32


def scored_targets(spec: RunSpec, ids: torch.Tensor) -> torch.Tensor:
    """The targets the last stage scores from a request's ids: the targets, or a window's last
    ``seq_len`` ids, as int64."""
    return ids[:, -spec.model.seq_len:].long()


class SubspaceCodec(BoundaryCodec):
    """The boundary of a subspace run: ``c`` (activations) or ``Uᵀ g`` (gradients), ``k`` numbers
    per token, compressed by the run's codec (``inner``). Decoding validates the inner codec's wire
    tensors for the ``(…, k)`` shape, then lifts; a lifted tensor that overflows is refused."""

    def __init__(self, inner: BoundaryCodec, subspace: Subspace) -> None:
        self.inner, self.subspace = inner, subspace
        self.name = inner.name
        self.num_wire_tensors = inner.num_wire_tensors

    def encode(self, tensor):
        return self.inner.encode(self.subspace.reduce(tensor))

    def decode(self, wire, *, shape, dtype, name="activations"):
        return self._lifted(wire, None, shape, dtype, name)

    def encode_activations(self, tensor, ids):
        if ids is None:
            raise ValueError("a subspace run's activations travel with their sample's ids (request_ids)")
        return self.inner.encode(self.subspace.coordinates(tensor, ids[:, :-1]))  # the window's inputs

    def decode_activations(self, wire, ids, *, shape, dtype, name="activations"):
        return self._lifted(wire, ids[:, :-1], shape, dtype, name)

    def _lifted(self, wire, tokens, shape, dtype, name):
        reduced = self.inner.decode(wire, shape=(*shape[:-1], self.subspace.dims), dtype=torch.float32, name=name)
        return require_finite(self.subspace.lift(reduced, tokens), f"{name} (lifted from the subspace)").to(dtype)

    def wire_bytes(self, shape, dtype=torch.float32):
        return self.inner.wire_bytes((*shape[:-1], self.subspace.dims), torch.float32)


def stage_boundary_codec(spec: RunSpec) -> BoundaryCodec:
    """How this run's activations and gradients cross a stage boundary: its ``boundary_codec``, of
    the subspace coordinates in a subspace run."""
    codec = boundary_codec(spec.boundary_codec)
    subspace = subspace_of(spec)
    return codec if subspace is None else SubspaceCodec(codec, subspace)


def microbatch_ratios(spec: RunSpec) -> tuple[float, float]:
    """float32 bytes over wire bytes for one microbatch of ``spec`` at a stage boundary: (its
    activations alone, as the codec sends them; its activations and gradient with the token ids its
    request carries, against fp32 ones with int64 targets). Message headers are left out."""
    shape, codec = (spec.microbatch_size, spec.model.seq_len, spec.model.d_model), stage_boundary_codec(spec)
    ids_shape, ids_dtype = request_ids_layout(spec, spec.microbatch_size)
    ids = math.prod(ids_shape) * ids_dtype.itemsize
    fp32 = 2 * 4 * math.prod(shape) + 8 * math.prod(shape[:2])
    return compression_ratio(codec, shape), fp32 / (2 * codec.wire_bytes(shape) + ids)
