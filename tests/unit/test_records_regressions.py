"""Regression tests for bugs found in dht/records.py by review (all fixed).

1. ``RUN_ID_PATTERN.match`` and the dataset regex use ``$``, which also matches before a trailing
   newline: ``"abc\\n"`` passes as a run id, ``"builtin:pydoc\\n"`` as a dataset. Use ``fullmatch``.
2. ``bool`` passes where an int is expected: ``PeerRecord.stage=True`` and stage layer bounds
   ``[False, True]`` (``isinstance(True, int)``).
3. ``PeerRecord.from_wire`` calls ``tuple(maddrs)`` outside its ``try``: ``maddrs=5`` raises
   ``TypeError`` instead of ``ValueError``; ``maddrs="/ip4/..."`` is silently split into characters.
"""

from __future__ import annotations

import pytest

from dht.records import PeerRecord, RunSpec, check_run_id
from tests.unit.test_records import SHA, record_wire, spec_wire


@pytest.mark.parametrize("run_id", ["abc\n", "demo\n"])
def test_run_id_with_trailing_newline_is_rejected(run_id):
    with pytest.raises(ValueError):
        check_run_id(run_id)
    with pytest.raises(ValueError):
        RunSpec.from_wire(spec_wire(run_id=run_id))


@pytest.mark.parametrize("dataset", ["builtin:pydoc\n", f"files:{SHA}\n"])
def test_dataset_with_trailing_newline_is_rejected(dataset):
    with pytest.raises(ValueError):
        RunSpec.from_wire(spec_wire(dataset=dataset))


def test_bool_stage_is_rejected():
    with pytest.raises(ValueError):
        PeerRecord.from_wire(record_wire(stage=True))


def test_bool_stage_layer_bounds_are_rejected():
    with pytest.raises(ValueError):
        RunSpec.from_wire(spec_wire(stage_layers=[[False, True], [1, 6]]))


@pytest.mark.parametrize("maddrs", [5, "/ip4/x", {"a": 1}])
def test_maddrs_that_are_not_a_list_raise_value_error(maddrs):
    with pytest.raises(ValueError):
        PeerRecord.from_wire(record_wire(maddrs=maddrs))
