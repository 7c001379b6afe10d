"""A node's libp2p identity, and the proof that binds its signed records to its peer id.

A peer record is signed with the node's RSA *record key* (hivemind's ``RSASignatureValidator``,
whose public key is the record's subkey), but the peer id it names is the hash (or, for Ed25519,
the inlined bytes) of a different key: the libp2p *identity key* the p2p daemon authenticates every
connection with. Without a link between the two, anyone could write a well-signed record under
their own record key that claims somebody else's peer id (keep a dead peer "alive", claim a stage
or a throughput for it). So a record carries a *binding*: the identity key's signature of

    b"murmuration/peer-record/1\\0" + run_id + b"\\0" + record key (the subkey bytes)

and a reader accepts it only if the signature verifies under the identity key that the claimed peer
id commits to (:func:`verify_binding`). Ed25519 peer ids (``12D3KooW...``) inline their public key;
RSA peer ids (``Qm...``, hivemind's persistent identity files) are the SHA-256 multihash of it, so
such a record also carries the public key (``peer_key``) and the reader checks its hash.

The node must therefore hold its identity key itself: :func:`open_identity` creates it (Ed25519 for
a throw-away identity, hivemind's RSA format for a persistent file) and the daemon is started from
that file. Costs: one Ed25519 signature per node and run (cached), one verification per distinct
(peer id, record key) a reader sees (cached in :class:`BindingCache`).
"""

from __future__ import annotations

import collections
import hashlib
import os
import weakref
from dataclasses import dataclass
from typing import Any

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa
from google.protobuf.message import DecodeError
from hivemind.proto import crypto_pb2

BINDING_DOMAIN = b"murmuration/peer-record/1\0"
OWNER_DOMAIN = b"murmuration/run-owner/1\0"  # a bootstrap vouching for the key that owns its run (dht.registry)
MAX_PEER_KEY_BYTES = 1024  # a libp2p RSA-4096 public key is ~550 bytes
MAX_SIGNATURE_BYTES = 1024
_IDENTITY_HASH, _SHA2_256 = 0x00, 0x12


class BindingError(ValueError):
    """A record's binding to its claimed peer id does not check out; the message says why."""


def binding_message(run_id: str, record_key: bytes, domain: bytes = BINDING_DOMAIN) -> bytes:
    return domain + run_id.encode() + b"\0" + record_key


@dataclass(frozen=True)
class PeerIdentity:
    """A libp2p identity key held in this process (the daemon holds the same key)."""

    private_key: ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey

    @classmethod
    def generate(cls) -> PeerIdentity:
        return cls(ed25519.Ed25519PrivateKey.generate())

    @classmethod
    def from_bytes(cls, data: bytes) -> PeerIdentity:
        """Parse an identity file's content (libp2p's ``crypto.pb.PrivateKey``, as the daemon reads it)."""
        message = crypto_pb2.PrivateKey.FromString(data)
        if message.key_type == crypto_pb2.Ed25519 and len(message.data) in (64, 96):
            return cls(ed25519.Ed25519PrivateKey.from_private_bytes(message.data[:32]))
        if message.key_type == crypto_pb2.RSA:
            key = serialization.load_der_private_key(message.data, password=None)
            if isinstance(key, rsa.RSAPrivateKey):
                return cls(key)
        raise ValueError("the identity file holds neither an Ed25519 nor an RSA libp2p private key")

    def to_bytes(self) -> bytes:
        """The identity file's content, as hivemind writes it (RSA) or go-libp2p does (Ed25519)."""
        key = self.private_key
        if isinstance(key, ed25519.Ed25519PrivateKey):
            data = key.private_bytes_raw() + key.public_key().public_bytes_raw()
            return crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=data).SerializeToString()
        data = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                                 serialization.NoEncryption())
        return crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=data).SerializeToString()

    @property
    def is_rsa(self) -> bool:
        return isinstance(self.private_key, rsa.RSAPrivateKey)

    @property
    def public_key_bytes(self) -> bytes:
        """libp2p's ``crypto.pb.PublicKey`` of this identity (what the peer id commits to)."""
        key = self.private_key
        if isinstance(key, ed25519.Ed25519PrivateKey):
            return crypto_pb2.PublicKey(key_type=crypto_pb2.Ed25519,
                                        data=key.public_key().public_bytes_raw()).SerializeToString()
        der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        return crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.public_key_bytes)

    def sign(self, data: bytes) -> bytes:
        key = self.private_key
        if isinstance(key, ed25519.Ed25519PrivateKey):
            return key.sign(data)
        return key.sign(data, padding.PKCS1v15(), hashes.SHA256())  # libp2p's RSA signature scheme

    def bind(self, run_id: str, record_key: bytes, domain: bytes = BINDING_DOMAIN) -> tuple[bytes, bytes]:
        """(``peer_key``, ``peer_signature``) for a record of ``run_id`` under ``record_key``
        (``domain``: what the binding vouches for). ``peer_key`` is empty when the peer id inlines
        the key (Ed25519)."""
        peer_key = self.public_key_bytes if self.is_rsa else b""
        return peer_key, self.sign(binding_message(run_id, record_key, domain))


def peer_id_of(public_key_bytes: bytes) -> str:
    """The base58 peer id of a libp2p public key: inlined (identity multihash) up to 42 bytes, else SHA-256."""
    if len(public_key_bytes) <= 42:
        digest = bytes([_IDENTITY_HASH, len(public_key_bytes)]) + public_key_bytes
    else:
        digest = bytes([_SHA2_256, 32]) + hashlib.sha256(public_key_bytes).digest()
    return base58.b58encode(digest).decode()


def verify_binding(peer_id: str, record_key: bytes, run_id: str, peer_key: bytes, signature: bytes,
                   domain: bytes = BINDING_DOMAIN) -> None:
    """Checks that the holder of ``peer_id``'s identity key vouched for ``record_key`` in ``run_id``.

    Raises:
        BindingError: with the reason (no binding, a key that is not the peer id's, a bad signature).
    """
    if not signature:
        raise BindingError("it carries no binding to its peer id")
    try:
        multihash = base58.b58decode(peer_id)
    except ValueError:
        raise BindingError("its peer id is not base58") from None
    if len(multihash) < 2 or multihash[1] != len(multihash) - 2:
        raise BindingError("its peer id is not a multihash")
    if multihash[0] == _IDENTITY_HASH:
        key_bytes = multihash[2:]
    elif multihash[0] == _SHA2_256:
        if not peer_key or hashlib.sha256(peer_key).digest() != multihash[2:]:
            raise BindingError("its peer_key is not the key its peer id hashes")
        key_bytes = peer_key
    else:
        raise BindingError(f"its peer id uses an unknown multihash (code {multihash[0]})")
    try:
        message = crypto_pb2.PublicKey.FromString(key_bytes)
    except DecodeError:
        raise BindingError("its peer id holds no libp2p public key") from None
    _verify(message.key_type, message.data, signature, binding_message(run_id, record_key, domain))


def _verify(key_type: int, key_data: bytes, signature: bytes, message: bytes) -> None:
    try:
        if key_type == crypto_pb2.Ed25519:
            ed25519.Ed25519PublicKey.from_public_bytes(key_data).verify(signature, message)
        elif key_type == crypto_pb2.RSA:
            key = serialization.load_der_public_key(key_data)
            if not isinstance(key, rsa.RSAPublicKey):
                raise BindingError("its peer id's RSA key is not an RSA key")
            key.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
        else:
            raise BindingError(f"its peer id uses an unsupported key type ({key_type})")
    except InvalidSignature:
        raise BindingError("its binding signature does not verify under its peer id's key") from None
    except (ValueError, TypeError) as e:  # a malformed key
        raise BindingError(f"its peer id's key is malformed ({str(e)[:80]})") from None


class BindingCache:
    """Verdicts of :func:`verify_binding`, keyed by everything they depend on; bounded (LRU)."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._verdicts: collections.OrderedDict[tuple, str] = collections.OrderedDict()
        self.num_verified = 0

    def check(self, peer_id: str, record_key: bytes, run_id: str, peer_key: bytes, signature: bytes) -> str:
        """"" if the binding holds, else the reason it does not."""
        key = (peer_id, record_key, run_id, peer_key, signature)
        verdict = self._verdicts.get(key)
        if verdict is not None:
            self._verdicts.move_to_end(key)
            return verdict
        try:
            verify_binding(peer_id, record_key, run_id, peer_key, signature)
            verdict = ""
        except BindingError as e:
            verdict = str(e)
        self.num_verified += 1
        self._verdicts[key] = verdict
        if len(self._verdicts) > self.max_entries:
            self._verdicts.popitem(last=False)
        return verdict


# The identity of each DHT node this process opened (dht.node registers it), so that declare_peer
# can bind the records it writes without every caller carrying the key around.
_identities: weakref.WeakKeyDictionary[Any, PeerIdentity] = weakref.WeakKeyDictionary()


def register_identity(dht: Any, identity: PeerIdentity) -> None:
    _identities[dht] = identity


def identity_of(dht: Any) -> PeerIdentity | None:
    return _identities.get(dht)


def open_identity(identity_path: str | None) -> tuple[PeerIdentity, bool]:
    """The identity to start a node with, and whether it is new (so nobody can be using it yet).

    A persistent ``identity_path`` is read if it exists, else created in hivemind's RSA format
    (readable by hivemind's "is this identity taken" check); without one, a fresh Ed25519 key.
    """
    if identity_path is None:
        return PeerIdentity.generate(), True
    if os.path.exists(identity_path):
        with open(identity_path, "rb") as f:
            return PeerIdentity.from_bytes(f.read()), False
    identity = PeerIdentity(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    fd = os.open(identity_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(identity.to_bytes())
    return identity, True
