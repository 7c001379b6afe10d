"""Local swarms for the demo, the benchmarks and the tests: not part of a running peer.

- ``local_swarm``: ``LocalSwarm`` starts ``run_bootstrap.py`` and ``run_peer.py`` processes on
  127.0.0.1, waits on their event logs, and stops them by PID.
- ``internet``: ``Internet`` builds an emulated internet in network namespaces (root): access links
  shaped with ``tc tbf``, one-way delay and loss from a TUN delay line (``delay_line.c``), home
  routers doing NAT with ``nft``; ``link_probe`` measures its round trips and goodput.
- ``demo``: ``python -m peer.harness.demo`` (the README's first command, ``scripts/demo.sh``).

The peer's runtime never imports this package (``tests/unit/test_import_rule.py``).
"""
