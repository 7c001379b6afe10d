"""On-disk store of a joiner's partial state download, so an interrupted join resumes.

DESIGN §1 step 5: "a download resumes". A store is a directory that holds the manifest being
fetched (``manifest.msgpack``) and one file per verified shard (``shard-00000012.bin``). Nothing
is trusted from disk: opening a store re-hashes every shard file against the manifest and
deletes the ones that do not match (torn writes, bit rot, or shards of another version whose
bytes differ). That is also why writes need no fsync: a shard half-written by a crash fails its
digest on the next open and is fetched again. Writes are atomic (temporary file, then
``os.replace``), so a reader never sees a partial file under a shard's final name.

One store per directory per process: ``open`` removes leftover temporary files. ``put_shard``
for distinct shards may run from several threads at once.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
from pathlib import Path

import msgpack

from replication.manifest import Manifest, ManifestError, ManifestLimits, is_shard_valid

__all__ = ["MANIFEST_FILE", "ShardStore"]

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.msgpack"
_TEMP_PREFIX = ".tmp-"
_SHARD_NAME = re.compile(r"shard-(\d{8})\.bin")
_MAX_MANIFEST_FILE_BYTES = 256 * 1024 * 1024


def _shard_name(index: int) -> str:
    return f"shard-{index:08d}.bin"


def _write_atomically(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Writes ``data`` to a temporary file in the same directory, then renames it over ``path``."""
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=_TEMP_PREFIX)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


class ShardStore:
    """Verified shards of one manifest on disk (seed 003 §III: the joiner's side of K).

    Use ``ShardStore.open`` (known manifest) or ``ShardStore.open_existing`` (resume).
    """

    def __init__(self, directory: Path, manifest: Manifest, held: set[int]) -> None:
        """Internal: use ``open`` or ``open_existing``, which verify the directory first."""
        self._directory = directory
        self._manifest = manifest
        self._held = held
        self._lock = threading.Lock()

    @classmethod
    def open(cls, directory: str | os.PathLike[str], manifest: Manifest) -> ShardStore:
        """Opens or creates the store for ``manifest``, keeping only shards that verify.

        If the directory holds another manifest, it is replaced; shards whose bytes still match
        the new manifest are kept (same bytes, same digest), the rest are deleted.
        """
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        for leftover in path.glob(_TEMP_PREFIX + "*"):
            leftover.unlink(missing_ok=True)
        if _read_manifest(path, ManifestLimits()) != manifest:
            _write_atomically(path / MANIFEST_FILE, msgpack.packb(manifest.to_wire()))
        held = _scan_shards(path, manifest)
        logger.info("shard store %s: %d of %d shards of stage %d version %d already held",
                    path, len(held), manifest.num_shards, manifest.stage, manifest.version)
        return cls(path, manifest, held)

    @classmethod
    def open_existing(
        cls, directory: str | os.PathLike[str], *, limits: ManifestLimits | None = None
    ) -> ShardStore | None:
        """Reopens an interrupted download from its own manifest; None if there is none usable."""
        path = Path(directory)
        manifest = _read_manifest(path, limits or ManifestLimits())
        return None if manifest is None else cls.open(path, manifest)

    @property
    def manifest(self) -> Manifest:
        """The manifest this store holds shards of."""
        return self._manifest

    @property
    def directory(self) -> Path:
        """Where the files live."""
        return self._directory

    def held_shards(self) -> frozenset[int]:
        """Indices of the shards on disk, each verified against the manifest when written or
        when the store was opened."""
        with self._lock:
            return frozenset(self._held)

    def missing_shards(self) -> list[int]:
        """Indices still to fetch, ascending."""
        held = self.held_shards()
        return [i for i in range(self._manifest.num_shards) if i not in held]

    def is_complete(self) -> bool:
        """Whether every shard is held."""
        return len(self.held_shards()) == self._manifest.num_shards

    def put_shard(self, index: int, data: bytes | bytearray | memoryview, *, verified: bool = False) -> None:
        """Verifies shard ``index`` and stores it atomically.

        Args:
            verified: the caller has just checked ``data`` with ``is_shard_valid`` (skips a
                second hash pass).

        Raises:
            ManifestError: the bytes are not shard ``index`` (wrong length or digest); the
                caller should blame the donor and re-plan that shard.
        """
        if not verified and not is_shard_valid(self._manifest, index, data):
            raise ManifestError(f"shard {index} does not match the manifest")
        _write_atomically(self._directory / _shard_name(index), data)
        with self._lock:
            self._held.add(index)

    def assemble(self) -> memoryview:
        """Returns the full state buffer (read-only), re-verifying every shard as it is read.

        Raises:
            ManifestError: shards are missing, or one changed on disk since it was written
                (it is deleted and counts as missing again).
        """
        missing = self.missing_shards()
        if missing:
            raise ManifestError(f"{len(missing)} shards still missing, first {missing[0]}")
        buffer = bytearray(self._manifest.total_bytes)
        view = memoryview(buffer)
        for index in range(self._manifest.num_shards):
            if not self._read_verified(index, view):
                self._drop(index)
                raise ManifestError(f"shard {index} changed on disk; fetch it again")
        return view.toreadonly()

    def remove(self) -> None:
        """Deletes the store's files (after the state was restored); the directory stays."""
        with self._lock:
            self._held.clear()
        for path in self._directory.iterdir():
            if _SHARD_NAME.fullmatch(path.name) or path.name == MANIFEST_FILE:
                path.unlink(missing_ok=True)

    def _read_verified(self, index: int, view: memoryview) -> bool:
        """Reads shard ``index`` into its place in ``view``; whether it still verifies."""
        start, end = self._manifest.shard_range(index)
        path = self._directory / _shard_name(index)
        try:
            if path.stat().st_size != end - start:
                return False
            with open(path, "rb") as file:
                num_read = file.readinto(view[start:end])
        except FileNotFoundError:
            return False
        return num_read == end - start and is_shard_valid(self._manifest, index, view[start:end])

    def _drop(self, index: int) -> None:
        with self._lock:
            self._held.discard(index)
        (self._directory / _shard_name(index)).unlink(missing_ok=True)


def _read_manifest(directory: Path, limits: ManifestLimits) -> Manifest | None:
    """The manifest stored in ``directory``, or None if absent or unreadable (then logged)."""
    path = directory / MANIFEST_FILE
    try:
        if path.stat().st_size > _MAX_MANIFEST_FILE_BYTES:
            raise ManifestError("manifest file is too large")
        return Manifest.from_wire(msgpack.unpackb(path.read_bytes()), limits=limits)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        logger.warning("ignoring unreadable manifest %s: %s", path, error)
        return None


def _is_file_valid(path: Path, manifest: Manifest, index: int) -> bool:
    start, end = manifest.shard_range(index)
    if path.stat().st_size != end - start:  # checked first: never read a huge foreign file
        return False
    return is_shard_valid(manifest, index, path.read_bytes())


def _scan_shards(directory: Path, manifest: Manifest) -> set[int]:
    """Indices of shard files that verify against ``manifest``; deletes every other one."""
    held = set()
    for path in directory.iterdir():
        match = _SHARD_NAME.fullmatch(path.name)
        if match is None:
            continue
        index = int(match.group(1))
        if index < manifest.num_shards and _is_file_valid(path, manifest, index):
            held.add(index)
        else:
            logger.info("dropping shard file %s: it does not match the manifest", path)
            path.unlink(missing_ok=True)
    return held
