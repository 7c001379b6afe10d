"""Pure planning algorithms: cost models, stage choice, backups, re-planning.

Imports no torch, no hivemind, no asyncio, no sockets, no clock and no global RNG (DESIGN §2):
every function takes the snapshot, the config, ``now`` and an ``rng`` it needs as arguments, so
peers that see the same snapshot make the same decision.

The package holds two kinds of planner, one per place:

* ``planner/`` itself: the modules the live peer runs (imported, directly or through each other,
  by ``peer/``, ``swarm/`` and the ``run_*.py`` scripts):

  - ``stage_choice``: the join decision (the stage of largest throughput deficit, concurrent
    joiners placed in announce order) and rebalancing with hysteresis (``choose_move``);
  - ``reachability``: a dial-back check's verdict (direct, relayed, unreachable) and what a relayed
    peer adds to a stage it must be dialled for;
  - ``backup_plan``: who keeps the backup of a lone holder's stage and who rescues a lost stage;
  - ``claims``: bounds on the figures peers claim about themselves (FLOP/s, samples/s, backup
    versions) by the other peers' figures, so one liar cannot steer those decisions;
  - ``link_view``: one estimate per pair of peers from the link figures they publish (the worse of
    both ends' figures; one end's, bounded by the swarm's), for the router's path and the planner's
    link matrices;
  - ``replanning``: re-splitting the layers over the stages left after a stage is lost (seed 001 §3.4);
  - ``layer_split``, ``assembly``, ``costs``, ``plan``, ``snapshot``, ``runtime``: what ``replanning``
    builds on (the cost model that the offline planners and the simulator share, the bottleneck DP
    over layer boundaries, ``Plan``, ``SwarmSnapshot`` and the runtime's settings it carries).

* ``planner/offline/``: the seed planners, the literature's planners and the simulator that
  ``bench/`` and the tests evaluate offline. The live peer imports none of them
  (``tests/unit/test_import_rule.py`` checks it).
"""
