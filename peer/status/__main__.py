"""``python -m peer.status <multiaddr>``: a running peer's status over plain libp2p (:mod:`peer.status.client`)."""

import sys

from peer.status.client import main

sys.exit(main())
