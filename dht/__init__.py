"""dht: everything that talks to hivemind — the DHT (node, records, signed declare/fetch) and the
P2P transport our RPCs ride on (message framing in ``wire``, request/response calls in ``rpc``).
"""
