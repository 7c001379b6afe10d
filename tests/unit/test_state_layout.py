"""Bounded transfers: the state layout a puller derives from the run spec, and manifests refused against it.

A donor's manifest that is not of the layout the run spec implies (a tensor more or less, another
dtype or shape, 200 GiB) is refused where it is received, before anything is sized from it: the
pull tests below run ``pull_state`` and ``pull_copy`` for real over a stand-in for the network
(``replication.client.call_peer``) and fail if the store or the fetcher (what allocates the state
buffer) is ever reached for such a manifest. The same setup without the expected layout does reach
them: the checks are what stops it.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from dht.records import ModelSpec, RunSpec
from dht.reputation import Reputation
from peer.backup import pull_copy
from replication import transfer
from replication.config import TransferConfig
from replication.layout import ExpectedTensor, StateLayout
from replication.manifest import Manifest, ManifestError, build_manifest
from replication.server import padded_bytes
from replication.transfer import REFUSED_MANIFEST_STRIKES, TransferError, pull_state
from swarm.stage import Stage
from swarm.stage_state import served_state_template, state_template
from tests.forged_manifest import HUGE_BYTES, forged_wire, grown

CPU = torch.device("cpu")
SPEC = RunSpec(run_id="layout", model=ModelSpec(d_model=16, num_layers=3, num_heads=2, seq_len=8),
               stage_layers=((0, 1), (1, 2), (2, 3)))
DONOR = "12D3KooWHostileDonor000000000000000000000000000000"
SERVED_LAST = "stage.layers"  # the last name of a served state


def layout_of(spec: RunSpec, stage: int) -> StateLayout:
    return StateLayout.from_tensors(served_state_template(spec, stage))


# --- the layout derived from the spec is what a stage holds and serves ----------------------------

@pytest.mark.parametrize("stage_layers, index", [
    (((0, 1), (1, 2), (2, 3)), 0), (((0, 1), (1, 2), (2, 3)), 1), (((0, 1), (1, 2), (2, 3)), 2), (((0, 3),), 0),
])
def test_the_template_is_exactly_what_a_stage_holds_and_serves_after_a_step(stage_layers, index):
    spec = dataclasses.replace(SPEC, stage_layers=stage_layers)
    stage = Stage(spec, index, device=CPU)
    try:
        for param in stage.model.parameters():
            param.grad = torch.ones_like(param)
        stage.optimizer.step()  # AdamW's own step must keep the layout (its step counters' dtype)
        stage.keep_snapshot(1)
        template = state_template(spec, index)
        assert StateLayout.from_tensors(stage.state_tensors()) == StateLayout.from_tensors(template)
        assert StateLayout.from_tensors(stage.snapshot[1]) == layout_of(spec, index)
        assert all(t.is_meta for t in template.values())  # derived without allocating the stage
    finally:
        stage.shutdown()


def test_the_template_of_a_40_gib_stage_allocates_nothing():
    big = RunSpec(run_id="big", model=ModelSpec(d_model=8192, num_layers=8, num_heads=8, vocab_size=50000),
                  stage_layers=((0, 4), (4, 8)))
    template = served_state_template(big, 0)
    assert all(t.is_meta for t in template.values())
    assert layout_of(big, 0).total_bytes > 40 * 2**30


# --- manifests checked against it -----------------------------------------------------------------

def honest_state(stage: int = 1) -> dict[str, torch.Tensor]:
    st = Stage(SPEC, stage, device=CPU)
    try:
        st.keep_snapshot(0)
        return st.snapshot[1]
    finally:
        st.shutdown()


def tampered(what: str) -> dict[str, torch.Tensor]:
    state = honest_state()
    name = "model.blocks.0.fc.weight"
    if what == "wrong shape":
        state[name] = torch.zeros(state[name].shape[0] + 1, state[name].shape[1])
    elif what == "wrong dtype":
        state[name] = state[name].double()
    elif what == "extra tensor":
        state["model.blocks.9.fc.weight"] = torch.zeros(4)
    elif what == "missing tensor":
        del state[name]
    return state


@pytest.mark.parametrize("what, reason", [
    ("wrong shape", "'model.blocks.0.fc.weight' is float32[65, 16] in it, float32[64, 16]"),
    ("wrong dtype", "'model.blocks.0.fc.weight' is float64[64, 16] in it, float32[64, 16]"),
    ("extra tensor", "it has tensor 'model.blocks.9.fc.weight', which the run spec's stage does not"),
    ("missing tensor", "it lacks tensor 'model.blocks.0.fc.weight'"),
])
def test_a_manifest_of_another_layout_is_refused_naming_the_difference(what, reason):
    expected = layout_of(SPEC, 1)
    expected.check_manifest(build_manifest(honest_state(), run_id="r", stage=1, version=0, shard_bytes=4096)[0])
    manifest, _ = build_manifest(tampered(what), run_id="r", stage=1, version=0, shard_bytes=4096)
    with pytest.raises(ManifestError) as refused:
        expected.check_manifest(manifest)
    message = str(refused.value)
    assert message.startswith("the manifest is not of the state the run spec implies: ") and reason in message, message


def test_a_200_gib_manifest_parses_by_default_and_is_refused_by_the_layout_caps():
    expected = layout_of(SPEC, 1)
    wire = forged_wire(grown(expected), run_id="r", stage=1, min_piece_bytes=65536)
    assert Manifest.from_wire(wire).total_bytes == HUGE_BYTES  # the door: it parses under the old caps
    with pytest.raises(ManifestError, match=f"claims {HUGE_BYTES} bytes of state, more than the "
                                            f"{expected.total_bytes} accepted"):
        Manifest.from_wire(wire, limits=expected.limits(TransferConfig().manifest_limits))


def test_for_state_caps_a_manifest_at_twice_the_stated_state():
    config = TransferConfig.for_state(10**6, request_timeout=5.0, min_agreeing_donors=1)
    wire = forged_wire([ExpectedTensor("x", "uint8", (4 * 10**6,))], run_id="r", stage=0, min_piece_bytes=65536)
    with pytest.raises(ManifestError, match="more than the"):
        Manifest.from_wire(wire, limits=config.manifest_limits)


# --- pulls: refused where received, nothing allocated ---------------------------------------------

class Network:
    """Stands in for ``call_peer``: probes answered, and one donor's manifest ``make_wire(piece_bytes)``."""

    def __init__(self, make_wire) -> None:
        self.make_wire = make_wire
        self.manifest_requests = 0

    async def call_peer(self, p2p, peer_id, handler, header, *, timeout, max_payload_bytes):
        if handler.endswith(".probe"):
            return {"nbytes": header["nbytes"]}, [torch.zeros(padded_bytes(header["nbytes"]) // 8, dtype=torch.int64)]
        assert handler.endswith(".manifest"), handler
        self.manifest_requests += 1
        return {"ok": True, "manifest": self.make_wire(header["shard_bytes"])}, []


@pytest.fixture
def no_allocation(monkeypatch) -> list[str]:
    """Fails the test if a pull opens its store or builds its fetcher (the state-sized buffer)."""
    reached: list[str] = []

    def refuse(what):
        def allocate(*args, **kwargs):
            reached.append(what)
            raise AssertionError(f"{what} reached: the manifest was not refused before allocating")
        return allocate

    monkeypatch.setattr(transfer.ShardStore, "open", refuse("ShardStore.open"))
    monkeypatch.setattr(transfer, "PieceFetcher", refuse("PieceFetcher"))
    return reached


def same_size(layout: StateLayout, change) -> list[ExpectedTensor]:
    """The layout with ``change`` applied to its first float32 matrix that is not square (the byte
    total kept, so that only the table check, not the byte cap, can catch it)."""
    name = next(t.name for t in layout.tensors if t.dtype == "float32" and len(t.shape) == 2 and len(set(t.shape)) == 2)
    return [entry for t in layout.tensors for entry in (change(t) if t.name == name else [t])]


def one_row_less_and_a_tensor_more(t: ExpectedTensor) -> list[ExpectedTensor]:
    shrunk = dataclasses.replace(t, shape=(t.shape[0] - 1, t.shape[1]))
    return [shrunk, ExpectedTensor("model.zz", t.dtype, t.shape[1:])]


HOSTILE = {  # a layout of the right size but the wrong table, or of the wrong size
    "200 GiB": grown,
    "wrong shape": lambda layout: same_size(layout, lambda t: [dataclasses.replace(t, shape=t.shape[::-1])]),
    "wrong dtype": lambda layout: same_size(layout, lambda t: [dataclasses.replace(t, dtype="int32")]),
    "extra tensor": lambda layout: same_size(layout, one_row_less_and_a_tensor_more),
    "renamed tensor": lambda layout: same_size(layout, lambda t: [dataclasses.replace(t, name="model.zz")]),
    "missing tensor": lambda layout: list(layout.tensors[:-1]),
}
REASONS = {"200 GiB": f"claims {HUGE_BYTES} bytes", "wrong shape": "in the run spec's stage", "wrong dtype": "int32",
           "extra tensor": f"lists {len(served_state_template(SPEC, 1)) + 1} tensors, more than the",
           "renamed tensor": "it has tensor 'model.zz'", "missing tensor": f"it lacks tensor '{SERVED_LAST}'"}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_pull_copy_refuses_a_manifest_of_another_layout_before_allocating_and_strikes_its_donor(
        case, monkeypatch, no_allocation):
    layout = layout_of(SPEC, 1)
    network = Network(lambda piece: forged_wire(HOSTILE[case](layout), run_id=SPEC.namespace, stage=1,
                                                min_piece_bytes=piece))
    monkeypatch.setattr("replication.client.call_peer", network.call_peer)
    reputation = Reputation()
    with pytest.raises(TransferError, match="no donor sent a usable manifest") as failed:
        asyncio.run(pull_copy(None, SPEC, 1, [DONOR], request_timeout=5.0, reputation=reputation))
    reason = failed.value.report.failed_donors[DONOR]
    assert reason.startswith("manifest refused: ") and REASONS[case] in reason, reason
    assert reputation.num_strikes_of(DONOR) == REFUSED_MANIFEST_STRIKES
    assert network.manifest_requests == 1 and no_allocation == []


def test_without_the_expected_layout_the_same_200_gib_manifest_reaches_the_allocation(monkeypatch, no_allocation):
    """The control: what the checks above stop does happen without them."""
    layout = layout_of(SPEC, 1)
    network = Network(lambda piece: forged_wire(grown(layout), run_id="r", stage=1, min_piece_bytes=piece))
    monkeypatch.setattr("replication.client.call_peer", network.call_peer)
    with pytest.raises(AssertionError, match="reached"):
        asyncio.run(pull_state(None, [DONOR], run_id="r", stage=1, store_dir=None,
                               config=TransferConfig(min_agreeing_donors=1)))
    assert no_allocation == ["ShardStore.open"]


def test_a_donor_refused_twice_is_banned_and_not_asked_a_third_time(monkeypatch, no_allocation):
    layout = layout_of(SPEC, 1)
    network = Network(lambda piece: forged_wire(grown(layout), run_id="r", stage=1, min_piece_bytes=piece))
    monkeypatch.setattr("replication.client.call_peer", network.call_peer)
    reputation = Reputation(max_strikes=2 * REFUSED_MANIFEST_STRIKES)
    for _ in range(2):
        with pytest.raises(TransferError, match="no donor sent a usable manifest"):
            asyncio.run(pull_state(None, [DONOR], run_id="r", stage=1, store_dir=None,
                                   config=TransferConfig(min_agreeing_donors=1), reputation=reputation,
                                   expected=layout))
    assert reputation.is_banned(DONOR)
    with pytest.raises(TransferError, match="every donor is banned here"):
        asyncio.run(pull_state(None, [DONOR], run_id="r", stage=1, store_dir=None,
                               config=TransferConfig(min_agreeing_donors=1), reputation=reputation, expected=layout))
    assert network.manifest_requests == 2 and no_allocation == []
