"""Training text: the corpus, its byte tokenizer and the microbatch sampler of stage-0 peers.

The default corpus is Python's own documentation (``pydoc_data.topics``, ~465 KB of English
technical prose), which ships with every CPython: every machine has it offline, and no peer
downloads anything at run time. ``--data FILE ...`` trains on the user's own text files instead;
the run spec then names their content hash, so every data-owning peer provably trains on the same
text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

BUILTIN_PYDOC = "builtin:pydoc"
VALIDATION_FRACTION = 0.05


class DataError(ValueError):
    """The corpus cannot be loaded or does not match the run's dataset."""


def files_dataset_id(paths: Sequence[str]) -> str:
    """``files:<sha256>`` over the files' contents in the given order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(_read_file(path))
        digest.update(b"\0")
    return f"files:{digest.hexdigest()}"


def load_corpus(dataset: str, paths: Sequence[str] = ()) -> bytes:
    """The corpus named by a run spec's ``dataset``; ``paths`` must be given for ``files:`` datasets.

    Raises:
        DataError: files missing, empty, or not the files the run was published with.
    """
    if dataset == BUILTIN_PYDOC:
        import pydoc_data.topics

        topics = pydoc_data.topics.topics
        return "\n\n".join(topics[name] for name in sorted(topics)).encode()
    if not dataset.startswith("files:"):
        raise DataError(f"unknown dataset {dataset!r}")
    if not paths:
        raise DataError(f"this run trains on its own text files ({dataset}); pass them with --data")
    if files_dataset_id(paths) != dataset:
        raise DataError(f"the files given with --data are not the run's dataset {dataset}")
    return b"\0".join(_read_file(path) for path in paths)


class TokenSampler:
    """Random windows of a byte corpus: inputs and their next-token targets.

    Two ways to draw, one per training semantics (docs/convergence.md):

    * :meth:`sample` draws from this sampler's own generator, which each data-owning peer seeds with
      (run seed, peer id), so peers draw different windows (``replica_sync = "periodic"``: every
      replica trains on its own data);
    * :meth:`sample_slot` draws the microbatch at one position of one batch of the run, from a
      generator seeded by (run seed, batch, position) alone: under ``replica_sync = "gradients"`` a
      batch is the whole swarm's, so whichever stage-0 replica injects position ``k`` of batch ``b``
      draws the same windows, replicas never draw the same position twice, and one process that
      steps on the same seed sees the same samples in the same batches.

    The last ``VALIDATION_FRACTION`` of the corpus is held out for evaluation.
    """

    def __init__(self, corpus: bytes, *, seq_len: int, seed: int) -> None:
        tokens = np.frombuffer(corpus, dtype=np.uint8)
        split = int(len(tokens) * (1 - VALIDATION_FRACTION))
        if split <= seq_len + 1 or len(tokens) - split <= seq_len + 1:
            raise DataError(f"the corpus ({len(tokens)} bytes) is too short for sequences of {seq_len}")
        self.train_tokens, self.val_tokens = tokens[:split], tokens[split:]
        self.seq_len = seq_len
        self._rng = np.random.default_rng(seed)

    def heldout_batches(self, num_sequences: int, microbatch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The held-out set every peer and every benchmark evaluates on: the first ``num_sequences``
        non-overlapping windows of the held-out slice (fewer if it is shorter), in microbatches.
        No randomness: the same corpus gives the same set in every process, so held-out losses of a
        swarm and of one process are comparable."""
        if num_sequences < 1 or microbatch_size < 1:
            raise ValueError("num_sequences and microbatch_size must be positive")
        window = self.seq_len + 1
        count = min(num_sequences, len(self.val_tokens) // window)
        windows = self.val_tokens[: count * window].reshape(count, window).astype(np.int64)
        return [(torch.from_numpy(windows[i : i + microbatch_size, :-1].copy()),
                 torch.from_numpy(windows[i : i + microbatch_size, 1:].copy()))
                for i in range(0, count, microbatch_size)]

    def sample(self, batch_size: int, *, validation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A microbatch: int64 ``inputs`` and ``targets`` of shape ``(batch_size, seq_len)``."""
        return self._windows(self._rng, batch_size, self.val_tokens if validation else self.train_tokens)

    def sample_slot(self, batch_size: int, *, seed: int, batch: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The training microbatch at position ``slot`` of batch ``batch`` of a run seeded ``seed``:
        the same windows in every process, whatever this sampler's own seed."""
        if min(seed, batch, slot) < 0:
            raise ValueError(f"seed, batch and slot must not be negative (got {seed}, {batch}, {slot})")
        return self._windows(np.random.default_rng([seed, batch, slot]), batch_size, self.train_tokens)

    def _windows(self, rng: np.random.Generator, batch_size: int, tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        starts = rng.integers(0, len(tokens) - self.seq_len, size=batch_size)  # last start: len - seq_len - 1
        windows = np.stack([tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        return torch.from_numpy(windows[:, :-1]), torch.from_numpy(windows[:, 1:])


def data_seed(run_seed: int, peer_id: str) -> int:
    """A data-order seed that differs per peer and is the same in every process (no ``hash()``)."""
    return int.from_bytes(hashlib.sha256(f"{run_seed}:{peer_id}".encode()).digest()[:8], "big")


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror}") from None
    if not data:
        raise DataError(f"data file {path} is empty")
    return data
