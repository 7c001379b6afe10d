"""Pure planning algorithms: cost models, stage choice, partitioning, schedules, simulator.

Imports no torch, no hivemind, no asyncio, no sockets, no clock and no global RNG (DESIGN §2):
every function takes the snapshot, the config, ``now`` and an ``rng`` it needs as arguments, so
peers that see the same snapshot make the same decision.
"""
