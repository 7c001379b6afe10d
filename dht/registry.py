"""Thin declare_*/fetch_* calls over the DHT: the run spec, the run registry and peer heartbeats.

Reads return only records that parse and validate; anything else is logged and dropped, so a
malformed or hostile record never reaches the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from dht.records import RUNS_KEY, PeerRecord, RunSpec, peers_key, spec_key

logger = logging.getLogger(__name__)
T = TypeVar("T")

SPEC_TTL = 6 * 3600.0


def dht_time() -> float:
    """Seconds on the DHT's clock (what record expirations are measured in)."""
    return get_dht_time()


async def declare_run_spec(dht: hivemind.DHT, validator: RSASignatureValidator, spec: RunSpec) -> bool:
    """Publish the run spec, signed, and list the run in the registry of runs."""
    owner = validator.local_public_key
    expiration = get_dht_time() + SPEC_TTL
    wire = spec.to_wire()
    stored = await dht.store(spec_key(spec.run_id), wire, expiration, subkey=owner, return_future=True)
    listed = await dht.store(RUNS_KEY, wire, expiration, subkey=spec.run_id.encode() + owner, return_future=True)
    return bool(stored) and bool(listed)


async def fetch_run_specs(dht: hivemind.DHT, run_id: str) -> list[RunSpec]:
    """Every valid spec published under ``run_id``, oldest publisher key first (deterministic)."""
    specs = await _fetch_valid(dht, spec_key(run_id), RunSpec.from_wire, what=f"run spec for {run_id}")
    return [spec for spec in specs if spec.run_id == run_id]


async def fetch_run_ids(dht: hivemind.DHT) -> list[str]:
    """Run ids listed in the registry (what to suggest when a user names an unknown run)."""
    run_ids = set()
    for _, value in await _fetch_dictionary(dht, RUNS_KEY):
        if isinstance(value, dict) and isinstance(value.get("run_id"), str):
            run_ids.add(value["run_id"])
    return sorted(run_ids)


async def declare_peer(
    dht: hivemind.DHT, validator: RSASignatureValidator, run_id: str, record: PeerRecord, *, ttl: float
) -> bool:
    """Store this peer's heartbeat; it expires ``ttl`` seconds from now unless refreshed."""
    expiration = get_dht_time() + ttl
    key = peers_key(run_id)
    return bool(
        await dht.store(key, record.to_wire(), expiration, subkey=validator.local_public_key, return_future=True)
    )


async def fetch_peers(dht: hivemind.DHT, run_id: str) -> list[PeerRecord]:
    """Live peer records of the run, sorted by peer id; malformed ones are logged and dropped."""
    records: dict[str, PeerRecord] = {}
    for record in await _fetch_valid(dht, peers_key(run_id), PeerRecord.from_wire, what=f"peer record in run {run_id}"):
        # two keys claiming one peer id: keep the fresher one (highest version)
        previous = records.get(record.peer_id)
        if previous is None or record.version >= previous.version:
            records[record.peer_id] = record
    return [records[k] for k in sorted(records)]


async def _fetch_valid(dht: hivemind.DHT, key: str, parse: Callable[[Any], T], *, what: str) -> list[T]:
    """The values under ``key`` that ``parse`` accepts; each one it rejects is logged and dropped."""
    parsed = []
    for _, value in await _fetch_dictionary(dht, key):
        try:
            parsed.append(parse(value))
        except ValueError as e:
            logger.warning(f"ignoring a malformed {what}: {e}")
    return parsed


async def _fetch_dictionary(dht: hivemind.DHT, key: str) -> list[tuple[Any, Any]]:
    found = await dht.get(key, latest=True, return_future=True)
    if found is None or not isinstance(found.value, dict):
        return []
    now = get_dht_time()
    items = [(subkey, item.value) for subkey, item in found.value.items() if item.expiration_time > now]
    return sorted(items, key=lambda kv: repr(kv[0]))
