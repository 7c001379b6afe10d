"""Tokenizers a run trains with: bytes (vocabulary 256), or byte-level BPE from the ``tokenizers``
library, pinned in the run spec by the hash of its ``tokenizer.json``.

The bootstrap trains a BPE tokenizer on the run's corpus (:func:`train_bpe`: offline, well under a
second for the built-in corpus) or loads one the user gives; the run spec names it ``bpe:<sha256 of
the file>``. A peer obtains the file from the swarm (``replication.run_files``) or from its own
``--tokenizer`` and refuses any file whose hash is not the run's (:func:`load_tokenizer`); nothing
is downloaded from a hub. Documents are joined by the end-of-text token, so a window that spans two
documents sees where one ends.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

BYTES = "bytes"
END_OF_TEXT = "<|endoftext|>"
DEFAULT_BPE_VOCAB = 4096  # the demo's: the built-in corpus (~465 KB) averages ~4 bytes per token
MAX_TOKENIZER_BYTES = 64 << 20  # a 256k-token vocabulary's tokenizer.json is ~20 MB
MIN_BPE_VOCAB, MAX_BPE_VOCAB = 260, 1 << 20


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used for this run: unreadable, malformed, or not the one its
    run spec names."""


class Tokenizer(Protocol):
    id: str  # what the run spec names: "bytes" or "bpe:<sha256>"
    vocab_size: int
    end_of_text: int | None  # the id that separates documents (None: bytes join them with a separator)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_documents(self, documents: Sequence[bytes], separator: bytes) -> np.ndarray: ...


class ByteTokenizer:
    """Every byte a token: the first round's tokenizer, and still the default."""

    id, vocab_size, end_of_text = BYTES, 256, None

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode(errors="replace")

    def encode_documents(self, documents: Sequence[bytes], separator: bytes) -> np.ndarray:
        """The documents joined by ``separator``, one token per byte (uint8)."""
        return np.frombuffer(separator.join(documents), dtype=np.uint8)


class BpeTokenizer:
    """A ``tokenizers`` tokenizer held with the exact bytes of its ``tokenizer.json`` (what peers
    exchange and the hash names)."""

    def __init__(self, blob: bytes) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        if len(blob) > MAX_TOKENIZER_BYTES:
            raise TokenizerError(f"the tokenizer file has {len(blob):,} bytes, more than {MAX_TOKENIZER_BYTES:,}")
        try:
            self._tokenizer = HfTokenizer.from_str(blob.decode())
        except Exception as e:  # a bad encoding, or the tokenizers library's own Exception subclass
            raise TokenizerError(f"the tokenizer file is not a tokenizer.json the tokenizers library reads: "
                                 f"{str(e)[:200]}") from None
        self.blob, self.id = blob, tokenizer_id(blob)
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.end_of_text = self._tokenizer.token_to_id(END_OF_TEXT)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    def encode_documents(self, documents: Sequence[bytes], separator: bytes) -> np.ndarray:
        """Each document's tokens, followed by the end-of-text token (or ``separator``'s tokens if the
        tokenizer has none), in the smallest unsigned dtype the vocabulary fits."""
        texts = [d.decode(errors="replace") for d in documents]
        end = [self.end_of_text] if self.end_of_text is not None else self.encode(separator.decode(errors="replace"))
        ids: list[int] = []
        for start in range(0, len(texts), 1024):  # batches: encode_batch runs on all cores
            for encoding in self._tokenizer.encode_batch(texts[start:start + 1024], add_special_tokens=False):
                ids.extend(encoding.ids)
                ids.extend(end)
        return np.asarray(ids, dtype=token_dtype(self.vocab_size))


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while the vocabulary fits (the nanoGPT token-shard layout), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def tokenizer_id(blob: bytes) -> str:
    return f"bpe:{hashlib.sha256(blob).hexdigest()}"


def train_bpe(documents: Iterable[bytes], vocab_size: int = DEFAULT_BPE_VOCAB) -> bytes:
    """A byte-level BPE tokenizer trained on ``documents``, as its ``tokenizer.json`` bytes. The same
    documents give the same file (checked in tests/unit/test_tokenizer.py)."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if not MIN_BPE_VOCAB <= vocab_size <= MAX_BPE_VOCAB:
        raise ValueError(f"--vocab-size must be between {MIN_BPE_VOCAB} and {MAX_BPE_VOCAB}, got {vocab_size}")
    tokenizer = HfTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((d.decode(errors="replace") for d in documents), trainer)
    return tokenizer.to_str().encode()


def load_tokenizer(run_tokenizer: str, blob: bytes | None = None) -> Tokenizer:
    """The tokenizer a run spec names; ``blob`` is its ``tokenizer.json`` unless the run uses bytes.

    Raises:
        TokenizerError: no file for a BPE run, or a file whose hash is not the one the spec names.
    """
    if run_tokenizer == BYTES:
        return ByteTokenizer()
    if blob is None:
        raise TokenizerError(f"this run uses the BPE tokenizer {run_tokenizer}, and no tokenizer file was given")
    if tokenizer_id(blob) != run_tokenizer:
        raise TokenizerError(f"the tokenizer file is {tokenizer_id(blob)[:16]}…, not the run's {run_tokenizer[:16]}…: "
                             f"use the run's own tokenizer.json, or leave --tokenizer out to fetch it from the swarm")
    return BpeTokenizer(blob)


def read_tokenizer_file(path: str) -> bytes:
    """A ``tokenizer.json``'s bytes; :class:`TokenizerError` if it cannot be read or is too large."""
    try:
        with open(path, "rb") as f:
            blob = f.read(MAX_TOKENIZER_BYTES + 1)
    except OSError as e:
        raise TokenizerError(f"cannot read the tokenizer file {path}: {e.strerror}") from None
    if len(blob) > MAX_TOKENIZER_BYTES:
        raise TokenizerError(f"the tokenizer file {path} is larger than {MAX_TOKENIZER_BYTES:,} bytes")
    return blob
