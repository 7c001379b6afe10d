"""What crosses a stage boundary, compressed: activations forward, their gradients backward (issue #16).

The run spec names one codec (``RunSpec.boundary_codec``, ``dht.records.BOUNDARY_CODECS``); every
peer of the run encodes and decodes with it, so it is a run property like ``precision``, never a
peer's choice. A codec turns one tensor into a fixed number of *wire tensors* (``dht.wire.DTYPES``)
and back:

=========  ================================  ==========================  =======================
codec      wire tensors                      bytes per value (fp32: 4)   ratio vs fp32
=========  ================================  ==========================  =======================
``none``   the tensor in the compute dtype   4 (fp32) or 2 (bf16 run)    1× or 2×
``bf16``   bfloat16                          2                           2×
``fp16``   float16, one float32 scale        2 (+ 4 bytes a tensor)      2×
``int8``   int8, a float32 scale per 64      1 + 4/64 = 1.0625           3.76×
=========  ================================  ==========================  =======================

Each codec's class docstring states its error bound; ``tests/unit/test_boundary_codec.py`` checks
it. A decoded tensor is in the receiver's compute dtype (``swarm.model.activation_dtype``): a bf16
run rounds it to bf16 after decoding, which adds at most ``2**-8`` of the decoded value.

Decoding is validated like every other message: the wire tensors' count, dtypes and shapes must be
exactly those the expected shape (from the run spec, never from the message) implies, before
anything is allocated (``dht.wire.read_message`` already bounds the payload by its header); scales
and values must be finite and in range; anything else is a ``ProtocolError`` naming the tensor.

Rounding is to nearest, with no error feedback: a boundary tensor is used once (one microbatch's
forward or backward), so there is no running sum for a residual to correct, unlike gradient
compression in data-parallel averaging. The gradient a stage receives is the gradient with respect
to the *decoded* activations the next stage computed on; the stage applies it to its own unrounded
outputs (a straight-through estimate), as SWARM does with its 8-bit boundary.

Spot checks (``swarm.spot_check``) see no difference: a check sends the second replica the very wire
tensors the first one got, decoding is deterministic, so both compute on identical inputs, and each
fingerprints its own outputs before they are encoded for the next hop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dht.records import BOUNDARY_CODECS
from dht.wire import DTYPE_NAMES, ProtocolError

INT8_BLOCK = 64  # values per int8 block: one float32 scale per 64 bytes (6 % overhead)
INT8_LEVELS = 127  # q in [-127, 127]: symmetric, so -x encodes as -q
FP16_TOP_EXPONENT = 14  # fp16 scaling maps the largest |x| into [2**14, 2**15), far below fp16's 65504
FP32_MIN_EXPONENT, FP32_MAX_EXPONENT = -126, 127  # the float32 scale stays a normal power of two
FP32_MAX = torch.finfo(torch.float32).max


def _check_wire(wire: Sequence[torch.Tensor], expected: Sequence[tuple[torch.dtype, tuple[int, ...]]], name: str) -> None:
    """Refuse unless ``wire`` is exactly the tensors ``expected`` lists (dtype and shape each)."""
    if len(wire) != len(expected):
        raise ProtocolError(f"{name} must travel as {len(expected)} tensor(s), got {len(wire)}")
    for index, (tensor, (dtype, shape)) in enumerate(zip(wire, expected)):
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            part = name if len(expected) == 1 else f"{name} part {index}"
            raise ProtocolError(f"{part} must be {DTYPE_NAMES[dtype]}{list(shape)}, "
                                f"got {DTYPE_NAMES.get(tensor.dtype, tensor.dtype)}{list(tensor.shape)}")


def require_finite(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if not bool(torch.isfinite(tensor).all()):
        raise ProtocolError(f"{what} holds NaN or Inf")
    return tensor


class BoundaryCodec:
    """Encodes one boundary tensor to wire tensors and decodes them back; stateless, shared.

    Attributes:
        name: the run spec's name of the codec.
        num_wire_tensors: how many wire tensors one encoded tensor takes (fixed per codec, so a
            message's tensor positions follow from the codec alone).
    """

    name = ""
    num_wire_tensors = 1

    def encode(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The wire tensors of ``tensor`` (any shape, a floating dtype, on any device)."""
        raise NotImplementedError

    def decode(self, wire: Sequence[torch.Tensor], *, shape: tuple[int, ...], dtype: torch.dtype,
               name: str = "activations") -> torch.Tensor:
        """The tensor of ``shape`` in ``dtype`` that ``wire`` encodes.

        Raises:
            ProtocolError: the wire tensors are not the ones ``shape`` implies, or hold NaN/Inf or
                values out of range.
        """
        raise NotImplementedError

    def wire_bytes(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        """Tensor bytes on the wire for one tensor of ``shape`` whose compute dtype is ``dtype``."""
        raise NotImplementedError

    def encode_activations(self, tensor: torch.Tensor, ids: torch.Tensor | None) -> list[torch.Tensor]:
        """Activations to wire tensors; ``ids``: the token ids their request carries (what a
        subspace run's boundary rebuilds from, ``swarm.subspace``; the other codecs ignore them)."""
        return self.encode(tensor)

    def decode_activations(self, wire: Sequence[torch.Tensor], ids: torch.Tensor, *, shape: tuple[int, ...],
                           dtype: torch.dtype, name: str = "activations") -> torch.Tensor:
        """Inverse of :meth:`encode_activations`, validated as :meth:`decode`."""
        return self.decode(wire, shape=shape, dtype=dtype, name=name)


class PlainCodec(BoundaryCodec):
    """``none``: the tensor as the stage computed it (fp32, or bf16 in a bf16 run). Exact."""

    name = "none"

    def encode(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def decode(self, wire, *, shape, dtype, name="activations"):
        _check_wire(wire, [(dtype, tuple(shape))], name)
        return require_finite(wire[0], name)

    def wire_bytes(self, shape, dtype=torch.float32):
        return math.prod(shape) * dtype.itemsize


class Bf16Codec(BoundaryCodec):
    """``bf16``: rounded to bfloat16 (to nearest even; 8 significant bits). Error:
    ``|x̂ - x| <= 2**-8 * |x|`` for normal values, ``+ 2**-134`` absolute for float32 subnormals;
    float32's range, so no scaling is needed (a finite ``|x|`` within ``2**-8`` of float32's maximum
    rounds to Inf and is refused)."""

    name = "bf16"

    def encode(self, tensor):
        return [tensor.to(torch.bfloat16)]

    def decode(self, wire, *, shape, dtype, name="activations"):
        _check_wire(wire, [(torch.bfloat16, tuple(shape))], name)
        return require_finite(wire[0], name).to(dtype)

    def wire_bytes(self, shape, dtype=torch.float32):
        return 2 * math.prod(shape)


class Fp16Codec(BoundaryCodec):
    """``fp16``: float16 values times one float32 power-of-two scale per tensor.

    Plain float16 would overflow past 65504 and flush activation gradients (often 1e-6 to 1e-9) to
    zero, so the tensor is scaled by ``s = 2**e`` that maps its largest magnitude ``m`` into
    ``[2**14, 2**15)`` (``e`` clamped to float32's normal exponents). Error:
    ``|x̂ - x| <= 2**-11 * |x| + 2**-39 * m``: float16's relative rounding over its 30 normal
    binades below the top, its absolute rounding below them. bf16 inputs (8 significant bits) are
    carried exactly within those 30 binades.
    """

    name = "fp16"
    num_wire_tensors = 2

    def encode(self, tensor):
        flat = tensor.detach().float()
        top = flat.abs().max() if flat.numel() else torch.tensor(0.0)
        if not bool(torch.isfinite(top)):  # NaN/Inf in: a NaN scale out, which the receiver refuses
            return [flat.to(torch.float16), torch.tensor([math.nan])]
        exponent = int(torch.frexp(top).exponent) - 1 - FP16_TOP_EXPONENT if float(top) > 0 else 0
        exponent = min(max(exponent, FP32_MIN_EXPONENT), FP32_MAX_EXPONENT)
        return [(flat * 2.0 ** -exponent).to(torch.float16), torch.tensor([2.0 ** exponent])]

    def decode(self, wire, *, shape, dtype, name="activations"):
        _check_wire(wire, [(torch.float16, tuple(shape)), (torch.float32, (1,))], name)
        scale = float(wire[1][0])
        if not (math.isfinite(scale) and scale > 0):
            raise ProtocolError(f"{name}'s scale must be a positive finite number, got {scale}")
        values = require_finite(wire[0], name).float() * scale
        return require_finite(values, f"{name} (scaled)").to(dtype)

    def wire_bytes(self, shape, dtype=torch.float32):
        return 2 * math.prod(shape) + 4


class Int8Codec(BoundaryCodec):
    """``int8``: blockwise absmax quantization (SWARM's and bitsandbytes' 8-bit scheme). The flat
    tensor is cut into blocks of ``INT8_BLOCK`` values (the last one shorter); a block with largest
    magnitude ``m`` is sent as ``q = round(x * 127 / m)`` in int8 and the float32 scale ``m / 127``.
    Error: ``|x̂ - x| <= m / 254`` per value, plus float32 rounding (under ``2**-22 * m``); a block
    of zeros is exact. Bytes: one per value and 4 per block, 3.76× fewer than float32.
    """

    name = "int8"
    num_wire_tensors = 2

    def encode(self, tensor):
        flat = tensor.detach().float().reshape(-1)
        num_values = flat.numel()
        num_blocks = -(-num_values // INT8_BLOCK)
        blocks = torch.nn.functional.pad(flat, (0, num_blocks * INT8_BLOCK - num_values)).view(num_blocks, INT8_BLOCK)
        scales = blocks.abs().amax(dim=1) / INT8_LEVELS
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
        quantized = torch.round(blocks / divisor).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
        return [quantized.reshape(-1)[:num_values], scales]  # NaN/Inf in: NaN scales out, refused

    def decode(self, wire, *, shape, dtype, name="activations"):
        num_values = math.prod(shape)
        num_blocks = -(-num_values // INT8_BLOCK)
        _check_wire(wire, [(torch.int8, (num_values,)), (torch.float32, (num_blocks,))], name)
        quantized, scales = wire
        if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            raise ProtocolError(f"{name}'s scales must be finite and >= 0")
        if num_values and int(quantized.min()) < -INT8_LEVELS:
            raise ProtocolError(f"{name} holds -128, which the int8 codec never sends")
        if num_blocks and float(scales.max()) * INT8_LEVELS > FP32_MAX:  # so every decoded value is finite
            raise ProtocolError(f"{name} (scaled) holds NaN or Inf: a scale over float32's maximum / 127")
        padding = num_blocks * INT8_BLOCK - num_values
        values = quantized.to(dtype=torch.float32)
        if padding:
            values = torch.nn.functional.pad(values, (0, padding))
        values = (values.view(num_blocks, INT8_BLOCK) * scales.unsqueeze(1)).view(-1)
        return (values[:num_values] if padding else values).reshape(shape).to(dtype)

    def wire_bytes(self, shape, dtype=torch.float32):
        num_values = math.prod(shape)
        return num_values + 4 * -(-num_values // INT8_BLOCK)


_CODECS: dict[str, BoundaryCodec] = {codec.name: codec for codec in (PlainCodec(), Bf16Codec(), Fp16Codec(), Int8Codec())}
if tuple(_CODECS) != BOUNDARY_CODECS:  # the run spec's list and the implementations must name the same codecs
    raise ImportError(f"boundary codecs {tuple(_CODECS)} differ from the run spec's {BOUNDARY_CODECS}")


def boundary_codec(name: str) -> BoundaryCodec:
    """The codec a run spec names (``RunSpec.boundary_codec``)."""
    try:
        return _CODECS[name]
    except KeyError:
        raise ValueError(f"boundary codec must be one of {', '.join(BOUNDARY_CODECS)}, got {name!r}") from None


def compression_ratio(codec: BoundaryCodec, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> float:
    """float32 bytes over wire bytes for one tensor of ``shape`` (compute dtype ``dtype``)."""
    wire = codec.wire_bytes(shape, dtype)
    return 4 * math.prod(shape) / wire if wire else 1.0
