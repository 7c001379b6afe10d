"""The state layout a puller expects, known before it asks anyone, and the check of what it is offered.

A joiner knows from the run spec alone every tensor of the stage it pulls: names, dtypes, shapes
and so the exact byte total (``swarm.stage_state.served_state_template`` gives them, allocating
nothing). A donor's manifest that describes anything else (a tensor more or less, another dtype or
shape, another total) is refused as soon as it is parsed, before any buffer is sized from it, and
the manifest's own caps are set from the layout (:meth:`StateLayout.limits`): without this, a
27 KB manifest claiming 200 GiB made a joiner allocate 200 GiB (docs/replication.md, "The expected layout").

The same table check serves any other description of a stage's state (a checkpoint's header).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from replication.manifest import ALLOWED_DTYPES, Manifest, ManifestError, ManifestLimits

__all__ = ["ExpectedTensor", "StateLayout"]


@dataclass(frozen=True)
class ExpectedTensor:
    """One tensor of the expected state: its name, dtype (a manifest dtype name) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in ALLOWED_DTYPES:
            raise ValueError(f"tensor {self.name!r}: dtype {self.dtype!r} is not in {sorted(ALLOWED_DTYPES)}")
        if not isinstance(self.shape, tuple) or any(
                isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: shape must be a tuple of non-negative ints, got {self.shape!r}")

    @property
    def size_bytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class StateLayout:
    """The tensor table a state must have, sorted by name (what ``build_manifest`` lays out)."""

    tensors: tuple[ExpectedTensor, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if names != sorted(set(names)):
            raise ValueError("the tensors of a layout must be sorted by name, each once")

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> StateLayout:
        """The layout of ``tensors`` (meta tensors will do: only names, dtypes and shapes are read)."""
        return cls(tuple(ExpectedTensor(name, str(tensors[name].dtype).removeprefix("torch."),
                                        tuple(tensors[name].shape)) for name in sorted(tensors)))

    @property
    def total_bytes(self) -> int:
        return sum(t.size_bytes for t in self.tensors)

    def limits(self, base: ManifestLimits) -> ManifestLimits:
        """``base`` with its byte and tensor caps set to exactly this layout's: a manifest claiming
        more is refused while it is parsed (``Manifest.from_wire``), before its table is read."""
        return dataclasses.replace(base, max_total_bytes=max(self.total_bytes, 1),
                                   max_num_tensors=max(len(self.tensors), 1))

    def mismatch(self, table: Iterable[tuple[str, str, tuple[int, ...]]]) -> str | None:
        """The first difference between ``table`` ((name, dtype name, shape) rows) and this layout,
        as a phrase for an error message; None if they are the same."""
        offered = {}
        for name, dtype, shape in table:
            if name in offered:
                return f"tensor {name!r} is listed twice"
            offered[name] = (dtype, tuple(shape))
        expected = {t.name: t for t in self.tensors}
        missing, extra = sorted(set(expected) - set(offered)), sorted(set(offered) - set(expected))
        if extra:
            return f"it has tensor {extra[0]!r}, which the run spec's stage does not ({len(extra)} such)"
        if missing:
            return f"it lacks tensor {missing[0]!r} ({len(missing)} missing)"
        for name, entry in expected.items():
            if offered[name] != (entry.dtype, entry.shape):
                dtype, shape = offered[name]
                return f"tensor {name!r} is {dtype}{list(shape)} in it, {entry.describe()} in the run spec's stage"
        return None

    def check_manifest(self, manifest: Manifest) -> None:
        """Refuses a manifest that does not describe exactly this layout.

        Raises:
            ManifestError: naming the first difference (a tensor, a dtype, a shape or the total).
        """
        why = self.mismatch((t.name, t.dtype, t.shape) for t in manifest.tensors)
        if why is None and manifest.total_bytes != self.total_bytes:  # follows from the table; kept as a guard
            why = f"it describes {manifest.total_bytes} bytes where the run spec's stage holds {self.total_bytes}"
        if why is not None:
            raise ManifestError(f"the manifest is not of the state the run spec implies: {why}")
