"""Test-only fault injection: make this peer misbehave on purpose, so tests can check it is caught.

Not a user option, and not in ``--help``. A peer started with ``MURMURATION_INJECT_FAULTS`` (names
separated by commas or spaces) misbehaves as named, and only if ``MURMURATION_ALLOW_FAULT_INJECTION=1``
is set too; otherwise it refuses to start. Faults:

* ``corrupt_shards``: its replication server answers every second request for state pieces with one
  byte of each piece flipped (replication/), the others correctly: a joiner must catch it by the
  digests, drop it, re-fetch its pieces from other donors and strike it.
* ``wrong_outputs``: its stage's forwards return the outputs negated (swarm/stage.py): spot checks
  (swarm/spot_check.py) must catch it.

Every fault is applied here, in one place, by replacing one override point of the object it breaks.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from typing import Any

from peer.errors import UserError

ALLOW_ENV = "MURMURATION_ALLOW_FAULT_INJECTION"
FAULTS_ENV = "MURMURATION_INJECT_FAULTS"
FAULTS = ("corrupt_shards", "wrong_outputs")


def is_allowed(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(ALLOW_ENV, "") == "1"


def read_faults(env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The faults ``MURMURATION_INJECT_FAULTS`` asks for (none if unset).

    Raises:
        UserError: faults asked for without ``MURMURATION_ALLOW_FAULT_INJECTION=1``, or unknown ones.
    """
    env = os.environ if env is None else env
    names = frozenset(name for name in re.split(r"[,\s]+", env.get(FAULTS_ENV, "")) if name)
    if not names:
        return names
    if not is_allowed(env):
        raise UserError(f"{FAULTS_ENV} makes this peer misbehave on purpose and is for tests only; "
                        f"unset it (or set {ALLOW_ENV}=1 in a test).")
    unknown = sorted(names - set(FAULTS))
    if unknown:
        raise UserError(f"{FAULTS_ENV} names unknown faults {', '.join(unknown)}; known: {', '.join(FAULTS)}.")
    return names


def inject_wrong_outputs(stage: Any) -> None:
    """``stage`` (a swarm.stage.Stage) returns its forwards' outputs negated from now on."""
    _require_allowed()
    stage.output_fault = lambda outputs: -outputs


def inject_corrupt_shards(server: Any) -> None:
    """``server`` (a replication.server.ReplicationServer) corrupts every second request it serves."""
    _require_allowed()
    honest_load = server.load_shard
    served = itertools.count()

    async def load_shard(version: int, shard_bytes: int, index: int, count: int = 1, **kwargs: Any):
        data = await honest_load(version, shard_bytes, index, count, **kwargs)
        if next(served) % 2 == 0:
            return data
        data = bytearray(data)
        for offset in range(0, len(data), shard_bytes):  # one byte in the middle of each piece
            data[offset + min(shard_bytes, len(data) - offset) // 2] ^= 0x40
        return data

    server.load_shard = load_shard


def _require_allowed() -> None:
    if not is_allowed():
        raise UserError(f"fault injection is for tests only: set {ALLOW_ENV}=1 to allow it.")
