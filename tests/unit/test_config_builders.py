"""The configs a peer builds from its own: the DHT node (``peer.join.dht_node_config``) and each pull's
``TransferConfig.for_state``; one constructor each, so the field mappings and messages cannot drift."""

from __future__ import annotations

import pytest

from peer.config import PeerConfig
from peer.errors import UserError
from peer.join import dht_node_config
from replication.config import MANIFEST_SLACK_BYTES, MANIFEST_SLACK_FACTOR, TransferConfig, piece_bytes_of
from replication.manifest import ManifestLimits

BOOT = ("/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWFhaiMviy3ziS2qv7CchDD159ETRVeu1DJYGVVuJB8t7n",)


def test_a_peer_node_takes_every_field_from_the_peer_config():
    config = PeerConfig(bootstrap=BOOT, host_maddrs=("/ip4/127.0.0.1/tcp/0",), announce_maddrs=("/ip4/192.0.2.1/tcp/4000",),
                        identity_path="/tmp/peer.id", client_mode=True, join_timeout=12.0)
    node = dht_node_config(config)
    assert node.initial_peers == BOOT and node.host_maddrs == ("/ip4/127.0.0.1/tcp/0",)
    assert node.announce_maddrs == ("/ip4/192.0.2.1/tcp/4000",) and node.identity_path == "/tmp/peer.id"
    assert node.client_mode and node.start_timeout == 12.0


def test_a_visitor_node_is_a_client_with_a_fresh_identity():
    node = dht_node_config(PeerConfig(bootstrap=BOOT, identity_path="/tmp/peer.id"), is_visitor=True)
    assert node.client_mode and node.identity_path is None and node.initial_peers == BOOT


@pytest.mark.parametrize("is_visitor", [False, True])
def test_an_address_that_is_not_a_multiaddr_is_one_sentence_for_the_user(is_visitor):
    with pytest.raises(UserError, match="'not-a-multiaddr' is not a multiaddr .*; copy the bootstrap's address"):
        dht_node_config(PeerConfig(bootstrap=("not-a-multiaddr",)), is_visitor=is_visitor)


@pytest.mark.parametrize("state_bytes, piece_bytes", [
    (0, 64 * 1024), (64 * 64 * 1024, 64 * 1024), (64 * 64 * 1024 + 1, 128 * 1024), (10**12, 1024 * 1024),
])
def test_the_piece_size_is_a_sixty_fourth_of_the_state_within_bounds(state_bytes, piece_bytes):
    assert piece_bytes_of(state_bytes) == piece_bytes
    config = TransferConfig.for_state(state_bytes, request_timeout=7.0, min_agreeing_donors=1)
    cap = ManifestLimits(max_total_bytes=MANIFEST_SLACK_FACTOR * state_bytes + MANIFEST_SLACK_BYTES)
    assert config == TransferConfig(piece_bytes=piece_bytes, request_timeout=7.0, min_agreeing_donors=1,
                                    manifest_limits=cap)


def test_for_state_validates_as_the_constructor_does():
    with pytest.raises(ValueError, match="min_agreeing_donors"):
        TransferConfig.for_state(10**6, request_timeout=7.0, min_agreeing_donors=0)
    with pytest.raises(ValueError, match="request_timeout"):
        TransferConfig.for_state(10**6, request_timeout=0.0, min_agreeing_donors=1)
