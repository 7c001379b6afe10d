"""The windows onto a peer, for the volunteer: what they show and how they are served.

Every window reads one thing: the :class:`peer.status.snapshot.PeerSnapshot` the peer publishes
about once a second (``snapshot``), turned into plain JSON by ``local``; plus the DHT records of the
swarm. Nothing here imports the peer's core (``peer.lifecycle`` and the modules it composes): the
core imports this package, never the other way round (``tests/unit/test_import_rule.py``).

- ``snapshot``: ``PeerState`` and the frozen ``PeerSnapshot``.
- ``local``: a snapshot as the stable JSON of ``/status.json``; recent rates (``StatusHistory``).
- ``swarm``: the swarm's status from the DHT records.
- ``page``, ``terminal``, ``prometheus``: the health page, the terminal view, ``/metrics``.
- ``http``, ``service``: the status port's HTTP server and the service that runs all windows.
- ``protocol``, ``client``: ``/murmuration/status/1.0.0`` over libp2p, and ``python -m peer.status``.
- ``report``: ``python -m peer.status.report``, plots of the peers' event logs after a run.
"""
