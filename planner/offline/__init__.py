"""What only ``bench/`` and the tests run (``bench/planner.py``, ``bench/simulator_check.py``, ``bench/global_plan.py``).

Nothing here runs in a live peer: ``peer/``, ``swarm/``, ``replication/``, ``dht/`` and the
``run_*.py`` scripts import none of these modules (``tests/unit/test_import_rule.py`` checks it).
They may import the live ``planner`` modules (the seed planners, the global plan and the simulator
live there since the peer computes the global plan), never the other way round. docs/planner.md
describes each of them.

* ``exhaustive``: the brute-force optimum for small swarms, the oracle of the tests and the bench;
* ``rebalance``: a join decision and a multi-move rebalance on a full ``Plan`` with seed 000's cost
  model (links, clients, averaging). The live peer decides both with ``planner.stage_choice``
  instead, from measured FLOP/s alone;
* ``scenarios``: synthetic swarms (random regions, seed 000 Case 3) for the bench and tests;
* ``internet`` and ``lifetime``: a stated internet model (regions, home links, GPUs, churn) and an
  event-level simulation of a swarm's life under it with the live join, rebalancing and
  re-planning rules, at up to 10,000 peers (``bench/global_plan.py``);
* ``live_plan``: the live global plan rule in that simulation (mode "live_global": ``plan_global``
  and ``adoption.decide`` every period, peers standing by, the cap of 256 planned peers).
"""
