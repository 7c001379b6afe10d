"""Nothing on the network path can unpickle: our packages, and the hivemind code they put on it.

Unpickling bytes from the network runs code of the sender's choosing. Our wire is msgpack headers
plus raw tensor bytes of allow-listed dtypes (dht/wire.py); DHT records are msgpack through
hivemind's ``MSGPackSerializer``; in-stage averaging uses hivemind's protobuf messages whose
tensors are rebuilt with ``np.frombuffer``. This module checks, by reading the source:

* no module of ours imports a pickle-based loader (pickle, dill, cloudpickle, shelve, marshal,
  joblib, ``torch.serialization``) or calls ``torch.load``/``np.load``, and nothing passes
  ``weights_only=False`` or ``allow_pickle=True`` (checkpoints are safetensors);
* hivemind's msgpack decoder knows only its own ext types (a dictionary value 0x50, a tensor
  descriptor 0x51, a tuple 0x40), whose decoders read msgpack again and nothing else;
* the hivemind modules on our network path (DHT protocol and storage, P2P and its daemon bindings,
  tensor compression, averaging) mention no pickle loader.

hivemind does pickle between a ``hivemind.DHT`` and its own child process (multiprocessing pipes):
that is local IPC between two processes of the same peer, never bytes from another peer.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from tests.unit.parsing import no_collection_while_parsing  # noqa: F401 (autouse here)

REPO = Path(__file__).resolve().parents[2]
OUR_CODE = [*(REPO / name for name in ("dht", "swarm", "replication", "peer", "planner")),
            REPO / "run_peer.py", REPO / "run_bootstrap.py"]
PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib",
                    "torch.serialization", "copyreg"}
LOADERS = {("torch", "load"), ("np", "load"), ("numpy", "load"), ("pickle", "loads"), ("pickle", "load"),
           ("torch.serialization", "load")}
HIVEMIND_NETWORK_PATH = [
    "hivemind.dht.protocol", "hivemind.dht.node", "hivemind.dht.storage", "hivemind.dht.routing",
    "hivemind.dht.crypto", "hivemind.dht.validation", "hivemind.dht.dht", "hivemind.utils.serializer",
    "hivemind.utils.tensor_descr", "hivemind.utils.timed_storage", "hivemind.p2p.p2p_daemon",
    "hivemind.p2p.p2p_daemon_bindings.control", "hivemind.p2p.p2p_daemon_bindings.p2pclient",
    "hivemind.p2p.p2p_daemon_bindings.utils", "hivemind.p2p.p2p_daemon_bindings.datastructures",
    "hivemind.p2p.servicer", "hivemind.compression.base", "hivemind.compression.serialization",
    "hivemind.compression.floating", "hivemind.compression.quantization", "hivemind.averaging.averager",
    "hivemind.averaging.allreduce", "hivemind.averaging.matchmaking", "hivemind.averaging.partition",
    "hivemind.averaging.key_manager", "hivemind.averaging.group_info", "hivemind.averaging.load_balancing",
    "hivemind.utils.streaming", "hivemind.utils.crypto",
]
_PICKLE_TEXT = re.compile(r"\b(pickle|cPickle|dill|cloudpickle|torch\.load|allow_pickle|weights_only)\b")


def our_sources() -> list[Path]:
    files = []
    for path in OUR_CODE:
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def pickle_uses(source: str) -> list[str]:
    """Imports of pickling modules, calls of known pickle loaders, and unsafe loader options."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name in PICKLING_MODULES or a.name.split(".")[0] in PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in PICKLING_MODULES or node.module.split(".")[0] in PICKLING_MODULES:
                found.append(f"from {node.module} import ...")
            found += [f"from {node.module} import {a.name}" for a in node.names if (node.module, a.name) in LOADERS]
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and (func.value.id, func.attr) in LOADERS:
                found.append(f"{func.value.id}.{func.attr}(...)")
            for keyword in node.keywords:
                unsafe = {"weights_only": False, "allow_pickle": True}
                if keyword.arg in unsafe and not (isinstance(keyword.value, ast.Constant) and keyword.value.value != unsafe[keyword.arg]):
                    found.append(f"{keyword.arg}={ast.unparse(keyword.value)}")
    return found


def test_the_scan_finds_what_it_looks_for():
    """The checker itself: each kind of use is caught (so an empty result below means something)."""
    hostile = ("import pickle\nfrom dill import loads\nimport torch\ntorch.load(f)\nnp.load(f, allow_pickle=True)\n"
               "safe = torch.load(f, weights_only=flag)\nfrom torch.serialization import load\n")
    assert sorted(pickle_uses(hostile)) == sorted(["import pickle", "from dill import ...", "torch.load(...)", "np.load(...)",
                                    "allow_pickle=True", "torch.load(...)", "weights_only=flag", "from torch.serialization import ...",
                                            "from torch.serialization import load"])
    assert pickle_uses("import msgpack\nmsgpack.unpackb(b)\nsafetensors.torch.load_file(p)\n") == []


@pytest.mark.parametrize("path", our_sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_our_code_uses_no_pickle(path):
    assert pickle_uses(path.read_text()) == [], f"{path.relative_to(REPO)} can unpickle"


def test_hivemind_msgpack_decoder_knows_only_msgpack_ext_types():
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils.serializer import MSGPackSerializer
    from hivemind.utils.tensor_descr import BatchTensorDescriptor

    importlib.import_module("peer.lifecycle")  # everything a peer imports registers its ext types

    assert MSGPackSerializer._ext_type_codes == {0x50: DictionaryDHTValue, 0x51: BatchTensorDescriptor}
    assert MSGPackSerializer._TUPLE_EXT_TYPE_CODE == 0x40
    for decoder in (DictionaryDHTValue.unpackb, BatchTensorDescriptor.unpackb, MSGPackSerializer.loads):
        source = inspect.getsource(decoder)
        assert "MSGPackSerializer.loads" in source or "msgpack.loads" in source
        assert not _PICKLE_TEXT.search(source)


@pytest.mark.parametrize("module", HIVEMIND_NETWORK_PATH)
def test_hivemind_network_path_mentions_no_pickle_loader(module):
    source = inspect.getsource(importlib.import_module(module))
    assert not _PICKLE_TEXT.search(source), f"{module}: {_PICKLE_TEXT.search(source)}"
    assert pickle_uses(source) == []
