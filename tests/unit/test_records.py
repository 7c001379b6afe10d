"""DHT records: wire round trips, hostile input rejected with ValueError, even layer split."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.layouts import even_stage_layers
from dht.records import (
    MAX_ADDRS,
    MAX_STAGES,
    ModelSpec,
    PeerRecord,
    RunSpec,
    check_run_id,
    peers_key,
    spec_key,
)

SHA = "ab" * 32


def make_spec(**overrides) -> RunSpec:
    fields = dict(
        run_id="run_1-x",
        model=ModelSpec(d_model=96, num_layers=6, num_heads=3, seq_len=32, vocab_size=256),
        stage_layers=((0, 1), (1, 4), (4, 6)),
        lr=1e-3,
        weight_decay=0.1,
        microbatch_size=4,
        target_batch_size=32,
        averaging_period=7.5,
        dataset=f"files:{SHA}",
        seed=42,
    )
    fields.update(overrides)
    return RunSpec(**fields)


def make_record(**overrides) -> PeerRecord:
    fields = dict(
        peer_id="QmPeer123",
        role="reliable",
        state="training",
        stage=2,
        flops=3.5e12,
        samples_per_s=12.25,
        num_samples=1000,
        version=17,
        loss=4.5,
        announced_at=1.7e9,
        maddrs=("/ip4/127.0.0.1/tcp/4000", "/ip4/10.0.0.2/tcp/4000"),
        params_digest="deadbeef",
        averaged_at=1.7e9 + 30,
    )
    fields.update(overrides)
    return PeerRecord(**fields)


def through_msgpack(wire):
    return msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False)


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [RunSpec(run_id="demo"), make_spec(), make_spec(stage_layers=((0, 6),))])
def test_run_spec_round_trip(spec):
    assert RunSpec.from_wire(spec.to_wire()) == spec
    assert RunSpec.from_wire(through_msgpack(spec.to_wire())) == spec


def test_run_spec_wire_is_plain_msgpackable_data():
    wire = make_spec().to_wire()
    assert isinstance(wire["model"], dict)
    assert wire["stage_layers"] == [[0, 1], [1, 4], [4, 6]]
    assert through_msgpack(wire) == wire


@pytest.mark.parametrize("record", [
    make_record(),
    make_record(role="unreliable", state="joining", stage=-1, flops=0.0, maddrs=()),
    make_record(maddrs=tuple(f"/ip4/1.2.3.4/tcp/{i}" for i in range(MAX_ADDRS))),
])
def test_peer_record_round_trip(record):
    assert PeerRecord.from_wire(record.to_wire()) == record
    assert PeerRecord.from_wire(through_msgpack(record.to_wire())) == record


def test_peer_record_with_nan_loss_round_trips():
    record = make_record(loss=math.nan)
    back = PeerRecord.from_wire(through_msgpack(record.to_wire()))
    assert math.isnan(back.loss)
    assert {k: v for k, v in back.to_wire().items() if k != "loss"} == {
        k: v for k, v in record.to_wire().items() if k != "loss"
    }


def test_peer_record_defaults_fill_missing_optional_fields():
    wire = {"peer_id": "p", "role": "reliable", "state": "joining", "stage": -1, "flops": 1.0}
    record = PeerRecord.from_wire(wire)
    assert record.maddrs == () and record.version == 0 and math.isnan(record.loss)


def test_peer_record_of_an_older_peer_without_status_fields_parses():
    wire = make_record().to_wire()
    for key in ("software_version", "bytes_sent", "bytes_received"):
        del wire[key]
    record = PeerRecord.from_wire(through_msgpack(wire))
    assert (record.software_version, record.bytes_sent, record.bytes_received) == ("", 0, 0)


def test_peer_record_of_a_peer_without_backup_fields_parses_as_keeping_no_backup():
    wire = make_record().to_wire()
    del wire["backup_stage"], wire["backup_version"]
    record = PeerRecord.from_wire(through_msgpack(wire))
    assert (record.backup_stage, record.backup_version) == (-1, 0)


def test_peer_record_backup_fields_round_trip():
    record = make_record(backup_stage=3, backup_version=1_790_000_040)
    assert PeerRecord.from_wire(through_msgpack(record.to_wire())) == record


def test_a_pinned_peer_says_so_and_an_unpinned_record_leaves_the_field_off():
    pinned = make_record(pinned=True)
    assert PeerRecord.from_wire(through_msgpack(pinned.to_wire())).pinned is True
    assert "pinned" not in make_record().to_wire()  # what peers older than the field send
    assert PeerRecord.from_wire(through_msgpack(make_record().to_wire())).pinned is False


def test_peer_record_status_fields_round_trip():
    record = make_record(software_version="0.1.0+dev", bytes_sent=12_345, bytes_received=2**40)
    assert PeerRecord.from_wire(through_msgpack(record.to_wire())) == record


@settings(max_examples=50, deadline=None)
@given(
    num_layers=st.integers(1, 40),
    data=st.data(),
    lr=st.floats(1e-6, 10.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_run_spec_round_trip_property(num_layers, data, lr, seed):
    num_stages = data.draw(st.integers(1, min(num_layers, MAX_STAGES)))
    cuts = sorted(data.draw(st.sets(st.integers(1, num_layers - 1), min_size=num_stages - 1, max_size=num_stages - 1))) \
        if num_stages > 1 else []
    bounds = [0, *cuts, num_layers]
    layers = tuple((bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1))
    spec = RunSpec(run_id="p", model=ModelSpec(num_layers=num_layers), stage_layers=layers, lr=lr, seed=seed)
    assert RunSpec.from_wire(through_msgpack(spec.to_wire())) == spec
    assert spec.num_stages == len(layers)


def test_keys_and_describe():
    spec = make_spec()
    assert spec_key("r") == "r.spec" and peers_key("r") == "r.peers"
    assert "run_1-x" in spec.describe() and "3 stages" in spec.describe()


# --- hostile run specs -------------------------------------------------------------------------


def spec_wire(**changes):
    wire = make_spec().to_wire()
    for key, value in changes.items():
        if value is DELETE:
            del wire[key]
        else:
            wire[key] = value
    return wire


def model_wire(**changes):
    model = make_spec().to_wire()["model"]
    for key, value in changes.items():
        if value is DELETE:
            del model[key]
        else:
            model[key] = value
    return spec_wire(model=model)


DELETE = object()

BAD_SPEC_WIRES = {
    "list": [1, 2],
    "none": None,
    "string": "run",
    "no model": spec_wire(model=DELETE),
    "model not a map": spec_wire(model=[1, 2]),
    "no stage_layers": spec_wire(stage_layers=DELETE),
    "stage_layers not a list": spec_wire(stage_layers="0-6"),
    "no run id": spec_wire(run_id=DELETE),
    "unknown field": spec_wire(extra=1),
    "non-string key": {**spec_wire(), 1: 2},
    "unknown model field": model_wire(dropout=0.1),
    "missing model field is fine but bad value isn't": model_wire(d_model=0),
    "model bool": model_wire(num_layers=True),
    "model float": model_wire(d_model=96.0),
    "model huge": model_wire(seq_len=2**21),
    "heads do not divide": model_wire(num_heads=5),
    "empty run id": spec_wire(run_id=""),
    "run id with space": spec_wire(run_id="a b"),
    "run id with dot": spec_wire(run_id="a.spec"),
    "run id too long": spec_wire(run_id="a" * 65),
    "run id not str": spec_wire(run_id=7),
    "no stages": spec_wire(stage_layers=[]),
    "gap": spec_wire(stage_layers=[[0, 1], [2, 6]]),
    "overlap": spec_wire(stage_layers=[[0, 2], [1, 6]]),
    "not from 0": spec_wire(stage_layers=[[1, 6]]),
    "short": spec_wire(stage_layers=[[0, 1], [1, 5]]),
    "too long": spec_wire(stage_layers=[[0, 1], [1, 7]]),
    "empty range": spec_wire(stage_layers=[[0, 0], [0, 6]]),
    "reversed": spec_wire(stage_layers=[[0, 6], [6, 4]]),
    "three numbers": spec_wire(stage_layers=[[0, 3, 6]]),
    "float bounds": spec_wire(stage_layers=[[0, 3.0], [3.0, 6]]),
    "string bounds": spec_wire(stage_layers=[["0", "6"]]),
    "range is an int": spec_wire(stage_layers=[6]),
    "range is None": spec_wire(stage_layers=[None]),
    "too many stages": spec_wire(stage_layers=[[k, k + 1] for k in range(MAX_STAGES + 1)]),
    "huge list": spec_wire(stage_layers=[[0, 1]] * 100_000),
    "nan lr": spec_wire(lr=math.nan),
    "inf lr": spec_wire(lr=math.inf),
    "zero lr": spec_wire(lr=0.0),
    "negative lr": spec_wire(lr=-1e-3),
    "bool lr": spec_wire(lr=True),
    "string lr": spec_wire(lr="0.1"),
    "nan weight decay": spec_wire(weight_decay=math.nan),
    "negative weight decay": spec_wire(weight_decay=-0.1),
    "inf averaging period": spec_wire(averaging_period=math.inf),
    "tiny averaging period": spec_wire(averaging_period=0.5),
    "negative seed": spec_wire(seed=-1),
    "bool seed": spec_wire(seed=False),
    "float seed": spec_wire(seed=1.0),
    "huge seed": spec_wire(seed=2**31),
    "zero microbatch": spec_wire(microbatch_size=0),
    "bool microbatch": spec_wire(microbatch_size=True),
    "target below microbatch": spec_wire(target_batch_size=2),
    "negative target": spec_wire(target_batch_size=-64),
    "negative protocol": spec_wire(protocol_version=-1),
    "optimizer": spec_wire(optimizer="sgd"),
    "dataset unknown": spec_wire(dataset="http://x"),
    "dataset short hash": spec_wire(dataset="files:abc"),
    "dataset upper hash": spec_wire(dataset=f"files:{SHA.upper()}"),
    "dataset not str": spec_wire(dataset=5),
}


@pytest.mark.parametrize("wire", BAD_SPEC_WIRES.values(), ids=BAD_SPEC_WIRES.keys())
def test_run_spec_from_wire_rejects_malformed_input(wire):
    with pytest.raises(ValueError):
        RunSpec.from_wire(wire)


def test_run_spec_missing_model_fields_take_defaults():
    wire = spec_wire(stage_layers=[[0, 2], [2, 4]])
    wire["model"] = {}
    assert RunSpec.from_wire(wire).model == ModelSpec()


# --- hostile peer records ----------------------------------------------------------------------


def record_wire(**changes):
    wire = make_record().to_wire()
    for key, value in changes.items():
        if value is DELETE:
            del wire[key]
        else:
            wire[key] = value
    return wire


BAD_RECORD_WIRES = {
    "list": [1],
    "none": None,
    "bytes": b"x",
    "missing peer_id": record_wire(peer_id=DELETE),
    "missing role": record_wire(role=DELETE),
    "missing stage": record_wire(stage=DELETE),
    "missing flops": record_wire(flops=DELETE),
    "unknown field": record_wire(colour="red"),
    "non-string key": {**record_wire(), 3: 4},
    "empty peer id": record_wire(peer_id=""),
    "long peer id": record_wire(peer_id="x" * 129),
    "peer id not str": record_wire(peer_id=12),
    "role": record_wire(role="admin"),
    "role None": record_wire(role=None),
    "state": record_wire(state="dead"),
    "stage below -1": record_wire(stage=-2),
    "stage too big": record_wire(stage=MAX_STAGES),
    "stage float": record_wire(stage=1.0),
    "stage str": record_wire(stage="1"),
    "nan flops": record_wire(flops=math.nan),
    "inf flops": record_wire(flops=math.inf),
    "negative flops": record_wire(flops=-1.0),
    "huge flops": record_wire(flops=1e19),
    "bool flops": record_wire(flops=True),
    "nan samples_per_s": record_wire(samples_per_s=math.nan),
    "negative samples_per_s": record_wire(samples_per_s=-1.0),
    "inf announced_at": record_wire(announced_at=math.inf),
    "negative announced_at": record_wire(announced_at=-5.0),
    "nan averaged_at": record_wire(averaged_at=math.nan),
    "negative num_samples": record_wire(num_samples=-1),
    "bool num_samples": record_wire(num_samples=True),
    "float version": record_wire(version=1.5),
    "bool version": record_wire(version=False),
    "huge version": record_wire(version=2**62),
    "loss str": record_wire(loss="low"),
    "loss None": record_wire(loss=None),
    "too many maddrs": record_wire(maddrs=["/ip4/1.1.1.1/tcp/1"] * (MAX_ADDRS + 1)),
    "huge maddrs list": record_wire(maddrs=["/ip4/1.1.1.1/tcp/1"] * 100_000),
    "maddr not str": record_wire(maddrs=[1]),
    "maddr too long": record_wire(maddrs=["x" * 256]),
    "digest not str": record_wire(params_digest=5),
    "digest too long": record_wire(params_digest="a" * 129),
    "software_version not str": record_wire(software_version=1),
    "software_version too long": record_wire(software_version="1" * 33),
    "software_version with a space": record_wire(software_version="1.0 beta"),
    "software_version with a newline": record_wire(software_version="1.0\n"),
    "software_version markup": record_wire(software_version="<script>"),
    "negative bytes_sent": record_wire(bytes_sent=-1),
    "float bytes_received": record_wire(bytes_received=1.5),
    "bool bytes_sent": record_wire(bytes_sent=True),
    "huge bytes_received": record_wire(bytes_received=2**62),
    "backup_stage below -1": record_wire(backup_stage=-2),
    "backup_stage too large": record_wire(backup_stage=64),
    "bool backup_stage": record_wire(backup_stage=True),
    "str backup_stage": record_wire(backup_stage="0"),
    "negative backup_version": record_wire(backup_version=-1),
    "float backup_version": record_wire(backup_version=2.5),
    "pinned not bool": record_wire(pinned=1),
    "pinned str": record_wire(pinned="yes"),
}


@pytest.mark.parametrize("wire", BAD_RECORD_WIRES.values(), ids=BAD_RECORD_WIRES.keys())
def test_peer_record_from_wire_rejects_malformed_input(wire):
    with pytest.raises(ValueError):
        PeerRecord.from_wire(wire)


@pytest.mark.parametrize("run_id", ["a", "A-b_9", "x" * 64])
def test_check_run_id_accepts_valid_ids(run_id):
    assert check_run_id(run_id) == run_id


# --- even_stage_layers -------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(num_layers=st.integers(1, 200), data=st.data())
def test_even_stage_layers_tile_and_balance(num_layers, data):
    num_stages = data.draw(st.integers(1, num_layers))
    layers = even_stage_layers(num_layers, num_stages)
    assert len(layers) == num_stages
    assert layers[0][0] == 0 and layers[-1][1] == num_layers
    assert all(layers[k][1] == layers[k + 1][0] for k in range(num_stages - 1))
    sizes = [end - start for start, end in layers]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sum(sizes) == num_layers
    if num_stages <= MAX_STAGES:  # a valid run spec
        RunSpec(run_id="e", model=ModelSpec(num_layers=num_layers), stage_layers=layers)


def test_even_stage_layers_examples():
    assert even_stage_layers(4, 2) == ((0, 2), (2, 4))
    assert even_stage_layers(3, 3) == ((0, 1), (1, 2), (2, 3))
    assert even_stage_layers(7, 1) == ((0, 7),)


@pytest.mark.parametrize("num_layers, num_stages", [(4, 0), (4, 5), (0, 0), (3, -1)])
def test_even_stage_layers_rejects_impossible_splits(num_layers, num_stages):
    with pytest.raises(ValueError):
        even_stage_layers(num_layers, num_stages)
