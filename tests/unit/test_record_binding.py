"""Binding peer records to their peer ids (dht.identity): what verifies, what does not, and why."""

from __future__ import annotations

import os

import base58
import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.utils.crypto import RSAPrivateKey

from dht.identity import (
    BindingCache,
    BindingError,
    PeerIdentity,
    open_identity,
    peer_id_of,
    verify_binding,
)
from dht.records import PeerRecord

RUN = "run-1"


@pytest.fixture(scope="module")
def record_keys() -> tuple[bytes, bytes]:
    """Two RSA record keys as they appear in a record's subkey."""
    return tuple(RSASignatureValidator(RSAPrivateKey()).local_public_key for _ in range(2))


@pytest.fixture(scope="module")
def rsa_identity() -> PeerIdentity:
    return PeerIdentity(rsa.generate_private_key(public_exponent=65537, key_size=2048))


def test_an_ed25519_identity_has_an_inlined_peer_id_and_round_trips():
    identity = PeerIdentity.generate()
    assert identity.peer_id.startswith("12D3KooW")  # what go-libp2p prints for Ed25519 peers
    again = PeerIdentity.from_bytes(identity.to_bytes())
    assert again.peer_id == identity.peer_id and not again.is_rsa


def test_an_rsa_identity_file_gives_hiveminds_own_peer_id(tmp_path, rsa_identity):
    path = str(tmp_path / "id")
    P2P.generate_identity(path)  # hivemind's persistent identity format
    with open(path, "rb") as f:
        data = f.read()
    identity = PeerIdentity.from_bytes(data)
    assert identity.is_rsa and identity.peer_id == PeerID.from_identity(data).to_base58()
    assert PeerIdentity.from_bytes(rsa_identity.to_bytes()).peer_id == rsa_identity.peer_id


def test_open_identity_creates_a_persistent_rsa_file_once_and_reads_it_back(tmp_path):
    path = str(tmp_path / "peer.id")
    first, is_new = open_identity(path)
    again, is_new_again = open_identity(path)
    assert is_new and not is_new_again and first.is_rsa and first.peer_id == again.peer_id
    assert os.stat(path).st_mode & 0o077 == 0  # nobody else may read the key
    ephemeral, is_new = open_identity(None)
    assert is_new and not ephemeral.is_rsa


@pytest.mark.parametrize("kind", ["ed25519", "rsa"])
def test_a_binding_verifies_only_for_its_peer_id_run_and_record_key(kind, record_keys, rsa_identity):
    identity = PeerIdentity.generate() if kind == "ed25519" else rsa_identity
    own_key, other_key = record_keys
    peer_key, signature = identity.bind(RUN, own_key)
    assert (peer_key == b"") == (kind == "ed25519")  # an Ed25519 peer id carries its key itself
    verify_binding(identity.peer_id, own_key, RUN, peer_key, signature)
    for peer_id, record_key, run_id in [
        (PeerIdentity.generate().peer_id, own_key, RUN),  # someone else's peer id
        (identity.peer_id, other_key, RUN),  # the binding copied into another key's record
        (identity.peer_id, own_key, "run-2"),  # replayed into another run
    ]:
        with pytest.raises(BindingError):
            verify_binding(peer_id, record_key, run_id, peer_key, signature)


def test_a_forger_cannot_bind_its_record_key_to_someone_elses_peer_id(record_keys, rsa_identity):
    victim, forger = PeerIdentity.generate(), PeerIdentity.generate()
    forged_key, forged_signature = forger.bind(RUN, record_keys[1])
    with pytest.raises(BindingError, match="does not verify"):
        verify_binding(victim.peer_id, record_keys[1], RUN, forged_key, forged_signature)
    # an RSA victim: the forger must supply the key its peer id hashes, and cannot sign for it
    with pytest.raises(BindingError, match="not the key its peer id hashes"):
        verify_binding(rsa_identity.peer_id, record_keys[1], RUN, forger.public_key_bytes, forged_signature)
    victim_key, _ = rsa_identity.bind(RUN, record_keys[0])
    with pytest.raises(BindingError, match="does not verify"):
        verify_binding(rsa_identity.peer_id, record_keys[1], RUN, victim_key, forged_signature)


@pytest.mark.parametrize("peer_id, peer_key, signature, reason", [
    ("12D3KooWSat51nqvjB9HV13Cyqw1FMSJRYXAY8nqF5Hh2Wbxkbss", b"", b"", "no binding"),
    ("0OIl not base58", b"", b"x" * 64, "not base58"),
    (base58.b58encode(b"\x12\x05abc").decode(), b"", b"x" * 64, "not a multihash"),
    ("QmPeer123", b"", b"x" * 64, "not a multihash"),
    (base58.b58encode(b"\x13\x02ab").decode(), b"", b"x" * 64, "unknown multihash"),
    (peer_id_of(b"\x08\x02\x12\x01x"), b"", b"x" * 64, "unsupported key type"),
    (peer_id_of(b"\x08\x01\x12\x03abc"), b"", b"x" * 64, "malformed"),
    (peer_id_of(b"garbage"), b"", b"x" * 64, "holds no libp2p public key"),
])
def test_hostile_peer_ids_and_bindings_are_refused_with_a_reason(record_keys, peer_id, peer_key, signature, reason):
    with pytest.raises(BindingError, match=reason):
        verify_binding(peer_id, record_keys[0], RUN, peer_key, signature)


def test_the_cache_verifies_each_binding_once_and_stays_bounded(record_keys):
    identity = PeerIdentity.generate()
    peer_key, signature = identity.bind(RUN, record_keys[0])
    cache = BindingCache(max_entries=3)
    for _ in range(5):
        assert cache.check(identity.peer_id, record_keys[0], RUN, peer_key, signature) == ""
    assert cache.num_verified == 1
    forged = [PeerIdentity.generate().peer_id for _ in range(5)]
    for peer_id in forged:
        assert "does not verify" in cache.check(peer_id, record_keys[0], RUN, peer_key, signature)
    assert cache.num_verified == 6 and len(cache._verdicts) == 3


def test_a_record_carries_its_binding_through_msgpack_and_bounds_its_size(record_keys):
    identity = PeerIdentity.generate()
    peer_key, signature = identity.bind(RUN, record_keys[0])
    record = PeerRecord(peer_id=identity.peer_id, role="reliable", state="training", stage=0, flops=1e9, loss=2.5,
                        peer_key=peer_key, peer_signature=signature)
    wire = msgpack.unpackb(msgpack.packb(record.to_wire(), use_bin_type=True), raw=False)
    assert PeerRecord.from_wire(wire) == record
    assert "peer_signature" not in record.to_wire(with_binding=False)
    for bad in ("a string", b"x" * 1025, 5):
        with pytest.raises(ValueError, match="peer_signature"):
            PeerRecord.from_wire({**wire, "peer_signature": bad})
