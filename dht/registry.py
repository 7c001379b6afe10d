"""Thin declare_*/fetch_* calls over the DHT: the run spec, the run registry and peer heartbeats.

Reads return only records that parse and validate; anything else is logged and dropped, so a
malformed or hostile record never reaches the caller.

Writes are guarded too, on every node that stores our keys (:class:`RunRecordValidator`): under
the registry, spec and peers keys a node accepts only dictionary entries whose subkey names an
owner key (so hivemind's ``RSASignatureValidator`` checks their signature) and whose expiration is
at most ``MAX_RECORD_TTL`` away. Without it one plain value stored under ``<run_id>.peers`` with a
far expiration replaces the whole dictionary on the nodes that hold it: every heartbeat of the run
vanishes and no new one is accepted until that value expires (found by tests/fuzz).

A run spec is *owned* by the record key that signs it: :func:`owner_fingerprint` names that key in
32 hex digits (the bootstrap prints it in its join line, ``--run-owner``). A bootstrap also binds
its record key to its libp2p peer id (the identity key's signature under ``OWNER_DOMAIN``), so a
peer that dialled ``/p2p/<id>`` can tell the spec of the bootstrap it dialled from one a stranger
published under the same run id (``peer.join.SpecChooser`` decides whom to trust).

A peer record also has to be *bound* to the peer id it claims (:mod:`dht.identity`): its binding
is the identity key's signature of the run id and the record key (the subkey) it is stored under.
:func:`declare_peer` adds it; :func:`fetch_peers` drops a record whose binding fails, with the
reason logged (rate-limited). Since the binding names the record key, two records claiming one
peer id cannot both be bound: only the peer's own counts.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import weakref
from collections.abc import Iterable
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from dht.clock import SYSTEM_CLOCK
from dht.identity import (
    MAX_PEER_KEY_BYTES,
    MAX_SIGNATURE_BYTES,
    OWNER_DOMAIN,
    BindingCache,
    BindingError,
    identity_of,
    verify_binding,
)
from dht.records import RUNS_KEY, PeerRecord, RunSpec, peers_key, spec_key
from dht.rpc import RefusalLog

logger = logging.getLogger(__name__)

SPEC_TTL = 6 * 3600.0
MAX_RECORD_TTL = 2 * SPEC_TTL  # a record expiring later than this is refused (clock skew allowed for)
_OWNER_MARKER = b"[owner:"
BINDINGS = BindingCache()  # verdicts on (peer id, record key) bindings, process-wide
RECORD_REFUSALS = RefusalLog(noun="record")  # unbound records: each distinct one logged once, bounded


class RunRecordValidator(RecordValidatorBase):
    """Refuses, under the keys of the given runs (and the registry), a plain value, an entry whose
    subkey names no owner key, and an expiration more than ``MAX_RECORD_TTL`` ahead.

    hivemind hands a validator the key as its DHT id (a hash), so the protected keys are hashed
    here. Picklable: hivemind sends it to the DHT's process.
    """

    def __init__(self, run_ids: Iterable[str] = ()) -> None:
        self.run_ids: set[str] = set()
        self._key_ids: set[bytes] = {DHTID.generate(source=RUNS_KEY).to_bytes()}
        self.add_runs(run_ids)

    def add_runs(self, run_ids: Iterable[str]) -> None:
        for run_id in run_ids:
            self.run_ids.add(run_id)
            self._key_ids.update(DHTID.generate(source=key).to_bytes() for key in (spec_key(run_id), peers_key(run_id)))

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self._key_ids:
            return True
        if record.subkey in (DHTProtocol.IS_REGULAR_VALUE, DHTProtocol.IS_DICTIONARY, None):
            logger.debug("refused a plain value under a protected record key")
            return False
        if _OWNER_MARKER not in record.subkey:
            logger.debug("refused an unsigned entry under a protected record key")
            return False
        if record.expiration_time > HIVEMIND_CLOCK.dht_time() + MAX_RECORD_TTL:
            logger.debug("refused an entry expiring too far ahead under a protected record key")
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, RunRecordValidator):
            return False
        self.add_runs(other.run_ids)
        return True


_protected_runs: weakref.WeakKeyDictionary[hivemind.DHT, set[str]] = weakref.WeakKeyDictionary()


async def _install_validator(_dht: hivemind.DHT, node: Any, *, validator: RunRecordValidator) -> None:
    node.protocol.record_validator.extend([validator])


async def protect_run_keys(dht: hivemind.DHT, run_id: str) -> None:
    """Guard ``run_id``'s spec and peers keys on this node (once per node and run; see the module doc)."""
    runs = _protected_runs.setdefault(dht, set())
    if run_id in runs:
        return
    runs.add(run_id)
    await dht.run_coroutine(functools.partial(_install_validator, validator=RunRecordValidator([run_id])),
                            return_future=True)


# The calls here are the record store on hivemind's DHT, whose nodes compare expirations with the
# machine's wall clock (hivemind's get_dht_time): they read that clock, and nothing else does.
HIVEMIND_CLOCK = SYSTEM_CLOCK


def owner_fingerprint(record_key: bytes) -> str:
    """The 32 hex digits that name a run's owner: a hash of the record key that signs its spec."""
    return hashlib.sha256(record_key).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class PublishedSpec:
    """A run spec as found in the DHT.

    Attributes:
        spec: the spec.
        owner: :func:`owner_fingerprint` of the record key that signed it.
        bootstrap: the peer id whose identity key vouched for that record key (``OWNER_DOMAIN``),
            or "" when the publisher bound none or its binding does not verify.
    """

    spec: RunSpec
    owner: str
    bootstrap: str = ""


async def declare_run_spec(dht: hivemind.DHT, validator: RSASignatureValidator, spec: RunSpec) -> bool:
    """Publish the run spec, signed and bound to this node's peer id, and list the run in the registry."""
    await protect_run_keys(dht, spec.run_id)
    owner = validator.local_public_key
    expiration = HIVEMIND_CLOCK.dht_time() + SPEC_TTL
    wire = spec.to_wire()
    entry = dict(wire)
    identity = identity_of(dht)
    if identity is not None:
        peer_key, signature = identity.bind(spec.run_id, owner, OWNER_DOMAIN)
        entry["owner_binding"] = {"peer_id": identity.peer_id, "peer_key": peer_key, "signature": signature}
    stored = await dht.store(spec_key(spec.run_id), entry, expiration, subkey=owner, return_future=True)
    listed = await dht.store(RUNS_KEY, wire, expiration, subkey=spec.run_id.encode() + owner, return_future=True)
    return bool(stored) and bool(listed)


async def fetch_run_specs(dht: hivemind.DHT, run_id: str) -> list[PublishedSpec]:
    """Every valid spec published under ``run_id`` with its owner, by owner fingerprint (deterministic)."""
    await protect_run_keys(dht, run_id)
    published = []
    for subkey, value in await _fetch_dictionary(dht, spec_key(run_id)):
        if not isinstance(subkey, bytes) or not isinstance(value, dict):
            continue
        entry = dict(value)
        binding = entry.pop("owner_binding", None)
        try:
            spec = RunSpec.from_wire(entry)
        except ValueError as e:
            logger.warning(f"ignoring a malformed run spec for {run_id}: {e}")
            continue
        if spec.run_id == run_id:
            published.append(PublishedSpec(spec, owner_fingerprint(subkey), _bound_bootstrap(binding, subkey, run_id)))
    return sorted(published, key=lambda p: p.owner)


def _bound_bootstrap(binding: Any, record_key: bytes, run_id: str) -> str:
    """The peer id that ``binding`` (a spec's ``owner_binding``) binds ``record_key`` to, or ""."""
    if not isinstance(binding, dict):
        return ""
    peer_id, peer_key, signature = binding.get("peer_id"), binding.get("peer_key", b""), binding.get("signature")
    if not (isinstance(peer_id, str) and len(peer_id) <= 128 and isinstance(peer_key, bytes)
            and len(peer_key) <= MAX_PEER_KEY_BYTES and isinstance(signature, bytes)
            and len(signature) <= MAX_SIGNATURE_BYTES):
        return ""
    try:
        verify_binding(peer_id, record_key, run_id, peer_key, signature, OWNER_DOMAIN)
    except BindingError as e:
        RECORD_REFUSALS.refused("spec", f"a run spec for {run_id} claiming bootstrap {peer_id}: {e}")
        return ""
    return peer_id


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
    """Store this peer's heartbeat, bound to this node's peer id; it expires ``ttl`` seconds from now
    unless refreshed. A DHT node not opened by ``dht.node.open_dht`` has no identity key here, and
    its records go out unbound (readers drop them)."""
    await protect_run_keys(dht, run_id)
    expiration = HIVEMIND_CLOCK.dht_time() + ttl
    key = peers_key(run_id)
    identity = identity_of(dht)
    if identity is not None and not record.peer_signature:
        peer_key, signature = identity.bind(run_id, validator.local_public_key)
        record = dataclasses.replace(record, peer_key=peer_key, peer_signature=signature)
    return bool(
        await dht.store(key, record.to_wire(), expiration, subkey=validator.local_public_key, return_future=True)
    )


async def fetch_peers(dht: hivemind.DHT, run_id: str) -> list[PeerRecord]:
    """Live peer records of the run bound to the peer ids they claim, sorted by peer id; malformed or
    unbound ones are logged and dropped."""
    await protect_run_keys(dht, run_id)
    records: dict[str, PeerRecord] = {}
    for subkey, value in await _fetch_dictionary(dht, peers_key(run_id)):
        try:
            record = PeerRecord.from_wire(value)
        except ValueError as e:
            logger.warning(f"ignoring a malformed peer record in run {run_id}: {e}")
            continue
        if not is_bound(record, subkey, run_id):
            continue
        previous = records.get(record.peer_id)  # one peer under two record keys (restarted): the newer one
        if previous is None or record.announced_at >= previous.announced_at:
            records[record.peer_id] = record
    return [records[k] for k in sorted(records)]


def is_bound(record: PeerRecord, record_key: Any, run_id: str) -> bool:
    """Whether ``record``, stored under ``record_key``, is bound to its peer id; logs why not
    (once per distinct record binding: verdicts are cached)."""
    if not isinstance(record_key, bytes):
        RECORD_REFUSALS.refused("peer", f"{record.peer_id[-8:]}'s record is stored under no record key")
        return False
    before = BINDINGS.num_verified
    reason = BINDINGS.check(record.peer_id, record_key, run_id, record.peer_key, record.peer_signature)
    if reason and BINDINGS.num_verified != before:
        RECORD_REFUSALS.refused("peer", f"a record claiming peer id {record.peer_id} in run {run_id}: {reason}")
    return not reason


async def _fetch_dictionary(dht: hivemind.DHT, key: str) -> list[tuple[Any, Any]]:
    found = await dht.get(key, latest=True, return_future=True)
    if found is None or not isinstance(found.value, dict):
        return []
    now = HIVEMIND_CLOCK.dht_time()
    items = [(subkey, item.value) for subkey, item in found.value.items() if item.expiration_time > now]
    return sorted(items, key=lambda kv: repr(kv[0]))
