"""Training data: the corpus, its formats and the microbatch sampler of stage-0 peers.

The default corpus is Python's own documentation (``pydoc_data.topics``, ~465 KB of English
technical prose), which ships with every CPython: every machine has it offline, and no peer
downloads anything at run time. ``--data FILE ...`` trains on the user's own files instead, each
read by its suffix:

* ``.jsonl`` — JSON Lines, one document per line in its ``"text"`` field;
* ``.parquet`` — a ``text`` column, one document per row (needs ``pyarrow``);
* ``.bin`` — a pre-tokenized shard: a flat array of token ids, the nanoGPT layout (``uint16``, or
  what its ``<file>.json`` sidecar says; ``python -m peer.prepare_data`` writes both);
* anything else — plain UTF-8 text, one document per file.

The run spec names the files' content hash (sidecars included), so every data-owning peer provably
trains on the same data; a token shard's sidecar also names the tokenizer that made it, and a run
of another tokenizer refuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from swarm.tokenizer import Tokenizer, token_dtype

BUILTIN_PYDOC = "builtin:pydoc"
VALIDATION_FRACTION = 0.05
TOKEN_SHARD_SUFFIX = ".bin"
SIDECAR_SUFFIX = ".json"  # beside a token shard: {"tokenizer", "dtype", "tokens"}
TEXT_FIELD = "text"  # of a JSON Lines record and of a Parquet table
SHARD_DTYPES = ("uint16", "uint32")
_HASH_CHUNK = 1 << 22
Tokens = bytes | np.ndarray  # what a sampler draws from: byte tokens, or the ids of any tokenizer


class DataError(ValueError):
    """The corpus cannot be loaded or does not match the run's dataset."""


@dataclass(frozen=True)
class Corpus:
    """A run's training data: text documents, or token ids already made by ``shard_tokenizer``."""

    documents: tuple[bytes, ...] = ()
    separator: bytes = b"\0"  # joins documents for the byte tokenizer (BPE puts its end-of-text token)
    tokens: np.ndarray | None = None
    shard_tokenizer: str | None = None  # what the shards' sidecars name (None: not said)

    def text(self) -> bytes:
        """The documents joined: the byte tokenizer's tokens (a token-shard corpus has no text)."""
        if self.tokens is not None:
            raise DataError("this dataset is pre-tokenized token shards: it has no text")
        return self.separator.join(self.documents)

    def encode(self, tokenizer: Tokenizer) -> np.ndarray:
        """The corpus as ``tokenizer``'s token ids; a shard corpus as it is, checked against it."""
        if self.tokens is None:
            return tokenizer.encode_documents(self.documents, self.separator)
        if self.shard_tokenizer is not None and self.shard_tokenizer != tokenizer.id:
            raise DataError(f"the token shards were made with tokenizer {self.shard_tokenizer[:16]}…, and this run's "
                            f"is {tokenizer.id[:16]}…: prepare them again with the run's tokenizer")
        if self.tokens.size and int(self.tokens.max()) >= tokenizer.vocab_size:
            raise DataError(f"the token shards hold ids up to {int(self.tokens.max())}, beyond the run tokenizer's "
                            f"{tokenizer.vocab_size}: prepare them again with the run's tokenizer")
        return self.tokens


def files_dataset_id(paths: Sequence[str]) -> str:
    """``files:<sha256>`` over the files' contents in the given order (a token shard's sidecar with it)."""
    digest = hashlib.sha256()
    for path in paths:
        for part in _dataset_parts(path):
            _hash_file(digest, part)
        digest.update(b"\0")
    return f"files:{digest.hexdigest()}"


def load_corpus(dataset: str, paths: Sequence[str] = ()) -> Corpus:
    """The corpus named by a run spec's ``dataset``; ``paths`` must be given for ``files:`` datasets.

    Raises:
        DataError: files missing, empty, unreadable in their format, or not the files the run was
            published with.
    """
    if dataset == BUILTIN_PYDOC:
        import pydoc_data.topics

        topics = pydoc_data.topics.topics
        return Corpus(documents=tuple(topics[name].encode() for name in sorted(topics)), separator=b"\n\n")
    if not dataset.startswith("files:"):
        raise DataError(f"unknown dataset {dataset!r}")
    if not paths:
        raise DataError(f"this run trains on its own data files ({dataset}); pass them with --data")
    if files_dataset_id(paths) != dataset:
        raise DataError(f"the files given with --data are not the run's dataset {dataset}")
    shards = [p for p in paths if p.endswith(TOKEN_SHARD_SUFFIX)]
    if shards and len(shards) != len(paths):
        raise DataError("--data mixes token shards (.bin) with text files: prepare all of them as shards")
    if shards:
        return _shard_corpus(shards)
    documents: list[bytes] = []
    for path in paths:
        documents.extend(file_documents(path))
    return Corpus(documents=tuple(documents))


def file_documents(path: str) -> list[bytes]:
    """The documents of one text, JSON Lines or Parquet file (``DataError`` if unreadable)."""
    if path.endswith(".jsonl"):
        return _jsonl_documents(path)
    if path.endswith(".parquet"):
        return _parquet_documents(path)
    return [_read_file(path)]


def _jsonl_documents(path: str) -> list[bytes]:
    documents = []
    for number, line in enumerate(_read_file(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path} line {number} is not JSON: {e}") from None
        if not isinstance(record, dict) or not isinstance(record.get(TEXT_FIELD), str):
            raise DataError(f"{path} line {number} has no {TEXT_FIELD!r} string field")
        documents.append(record[TEXT_FIELD].encode())
    if not documents:
        raise DataError(f"{path} holds no JSON Lines records")
    return documents


def _parquet_documents(path: str) -> list[bytes]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        column = pq.read_table(path, columns=[TEXT_FIELD]).column(TEXT_FIELD).to_pylist()
    except (OSError, KeyError, ValueError) as e:  # pyarrow's errors derive from these
        raise DataError(f"cannot read the {TEXT_FIELD!r} column of {path}: {str(e)[:200]}") from None
    documents = [text.encode() for text in column if isinstance(text, str)]
    if not documents:
        raise DataError(f"{path} has no text in its {TEXT_FIELD!r} column")
    return documents


def read_shard_sidecar(path: str) -> dict:
    """A token shard's sidecar (``{}`` if it has none), checked."""
    try:
        with open(path + SIDECAR_SUFFIX, "rb") as f:
            sidecar = json.loads(f.read(1 << 16))
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read the sidecar {path}{SIDECAR_SUFFIX}: {e}") from None
    if not isinstance(sidecar, dict) or sidecar.get("dtype", "uint16") not in SHARD_DTYPES:
        raise DataError(f"the sidecar {path}{SIDECAR_SUFFIX} must be a map with a dtype of {', '.join(SHARD_DTYPES)}")
    return sidecar


def _shard_corpus(paths: Sequence[str]) -> Corpus:
    arrays, tokenizers = [], set()
    for path in paths:
        sidecar = read_shard_sidecar(path)
        dtype = np.dtype(sidecar.get("dtype", "uint16"))
        if os.path.getsize(path) % dtype.itemsize:
            raise DataError(f"{path} is not a whole number of {dtype.name} token ids")
        arrays.append(np.memmap(path, dtype=dtype, mode="r"))
        tokenizers.add(sidecar.get("tokenizer"))
    if len(tokenizers) > 1:
        raise DataError("the token shards were made with different tokenizers (their sidecars say)")
    tokens = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    return Corpus(tokens=tokens, shard_tokenizer=tokenizers.pop())


def write_token_shard(path: str, tokens: np.ndarray, *, tokenizer: str, vocab_size: int) -> None:
    """A token shard and its sidecar, each written whole or not at all."""
    dtype = token_dtype(vocab_size)
    _write_whole(path, np.ascontiguousarray(tokens, dtype=dtype).tobytes())
    write_shard_sidecar(path, tokenizer=tokenizer, dtype=dtype, tokens=int(tokens.size))


def write_shard_sidecar(path: str, *, tokenizer: str, dtype: np.dtype, tokens: int) -> None:
    """The sidecar of the token shard ``path``: the tokenizer that made it, its dtype, its length."""
    _write_whole(path + SIDECAR_SUFFIX, json.dumps({"tokenizer": tokenizer, "dtype": np.dtype(dtype).name,
                                                     "tokens": tokens}).encode())


def _write_whole(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


class TokenSampler:
    """Windows of a token array: inputs and their next-token targets.

    Each epoch cuts the training tokens into non-overlapping windows (each ``seq_len`` + 1 tokens,
    the last token of one the first of the next), at a shift and in an order drawn from (seed,
    epoch), and draw ``g`` of a stream is window ``g mod n`` of epoch ``g // n``. Two ways to draw,
    one per training semantics (docs/convergence.md):

    * :meth:`sample_slot` (``replica_sync = "gradients"``, the default): the microbatch at position
      ``slot`` of batch ``batch`` of the run is the run seed's stream from draw ``(batch · slots +
      slot) · batch_size`` on. Whichever stage-0 replica injects that position draws the same
      windows, one process stepping on the same seed sees the same samples in the same batches, and
      since replicas never draw the same position, **no two stage-0 peers draw a common window
      within an epoch**, without exchanging a word about data (tests/unit/test_data.py).
    * :meth:`sample` (``replica_sync = "periodic"``): this sampler's own stream, seeded per peer
      (:func:`data_seed`): a peer never repeats a window within an epoch, and two peers' streams are
      independent orders (``N`` draws each of ``n`` windows share about ``N²/n``).

    The last ``VALIDATION_FRACTION`` of the tokens is held out for evaluation. ``tokens`` may be
    bytes (the byte tokenizer's ids) or an integer array (e.g. a memory-mapped token shard).
    """

    def __init__(self, tokens: Tokens, *, seq_len: int, seed: int) -> None:
        if isinstance(tokens, (bytes, bytearray)):
            tokens = np.frombuffer(tokens, dtype=np.uint8)
        split = int(len(tokens) * (1 - VALIDATION_FRACTION))
        if split <= 2 * seq_len + 1 or len(tokens) - split <= seq_len + 1:
            raise DataError(f"the corpus ({len(tokens)} tokens) is too short for sequences of {seq_len}")
        self.train_tokens, self.val_tokens = tokens[:split], tokens[split:]
        self.seq_len, self.seed = seq_len, seed
        self.windows_per_epoch = (len(self.train_tokens) - 1 - seq_len) // seq_len
        self._rng = np.random.default_rng(seed)  # validation draws
        self._drawn = 0  # this sampler's own stream
        self._epoch: tuple[int, int, int, np.ndarray] | None = None  # (seed, epoch, shift, order)

    def heldout_batches(self, num_sequences: int, microbatch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The held-out set every peer and every benchmark evaluates on: the first ``num_sequences``
        non-overlapping windows of the held-out slice (fewer if it is shorter), in microbatches.
        No randomness: the same corpus gives the same set in every process, so held-out losses of a
        swarm and of one process are comparable."""
        if num_sequences < 1 or microbatch_size < 1:
            raise ValueError("num_sequences and microbatch_size must be positive")
        window = self.seq_len + 1
        count = min(num_sequences, len(self.val_tokens) // window)
        windows = np.asarray(self.val_tokens[: count * window]).reshape(count, window).astype(np.int64)
        return [(torch.from_numpy(windows[i : i + microbatch_size, :-1].copy()),
                 torch.from_numpy(windows[i : i + microbatch_size, 1:].copy()))
                for i in range(0, count, microbatch_size)]

    def sample(self, batch_size: int, *, validation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A microbatch: int64 ``inputs`` and ``targets`` of shape ``(batch_size, seq_len)``; the next
        ``batch_size`` draws of this sampler's own stream (or random held-out windows)."""
        if validation:
            starts = self._rng.integers(0, len(self.val_tokens) - self.seq_len, size=batch_size)
            return self._windows(self.val_tokens, starts)
        first, self._drawn = self._drawn, self._drawn + batch_size
        return self._windows(self.train_tokens, self._starts(self.seed, first, batch_size))

    def sample_slot(self, batch_size: int, *, seed: int, batch: int, slot: int,
                    slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The training microbatch at position ``slot`` (of ``slots``) of batch ``batch`` of a run
        seeded ``seed``: the same windows in every process, whatever this sampler's own seed."""
        if min(seed, batch, slot) < 0 or not 0 <= slot < slots:
            raise ValueError(f"seed, batch and slot must not be negative, and slot below slots "
                             f"(got {seed}, {batch}, {slot} of {slots})")
        return self._windows(self.train_tokens, self._starts(seed, (batch * slots + slot) * batch_size, batch_size))

    def _starts(self, seed: int, first: int, count: int) -> np.ndarray:
        """Where draws ``first`` .. ``first + count - 1`` of ``seed``'s stream start."""
        n, starts = self.windows_per_epoch, []
        for draw in range(first, first + count):
            epoch = draw // n
            if self._epoch is None or self._epoch[:2] != (seed, epoch):
                rng = np.random.default_rng([seed, epoch])
                self._epoch = (seed, epoch, int(rng.integers(self.seq_len)), rng.permutation(n))
            _, _, shift, order = self._epoch
            starts.append(shift + int(order[draw % n]) * self.seq_len)
        return np.asarray(starts)

    def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        windows = np.stack([tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        return torch.from_numpy(windows[:, :-1]), torch.from_numpy(windows[:, 1:])


def data_seed(run_seed: int, peer_id: str) -> int:
    """A data-order seed that differs per peer and is the same in every process (no ``hash()``)."""
    return int.from_bytes(hashlib.sha256(f"{run_seed}:{peer_id}".encode()).digest()[:8], "big")


def _dataset_parts(path: str) -> list[str]:
    """The files one ``--data`` path stands for in the dataset hash: itself, and a shard's sidecar."""
    if path.endswith(TOKEN_SHARD_SUFFIX) and os.path.exists(path + SIDECAR_SUFFIX):
        return [path, path + SIDECAR_SUFFIX]
    return [path]


def _hash_file(digest: "hashlib._Hash", path: str) -> None:
    size = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
                size += len(chunk)
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror}") from None
    if not size:
        raise DataError(f"data file {path} is empty")


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror}") from None
    if not data:
        raise DataError(f"data file {path} is empty")
    return data
