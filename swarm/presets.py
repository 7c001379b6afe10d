"""Named models a run can be started with (``run_bootstrap.py --preset``): Llama-style decoders from
one that trains visibly on two CPU cores to about a billion parameters.

Tokens are bytes (vocabulary 256) until the run spec carries a tokenizer. A preset is only a
``ModelSpec``: the run spec holds the model it names, so peers need not know the preset's name.
"""

from __future__ import annotations

from dht.records import ModelSpec

PRESETS: dict[str, ModelSpec] = {
    # about 0.8 M parameters: the demo's scale, trains visibly on 2 CPU cores in minutes
    "tiny": ModelSpec(family="llama", d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=64),
    # about 24 M
    "small": ModelSpec(family="llama", d_model=512, num_layers=8, num_heads=8, num_kv_heads=4, seq_len=256),
    # about 178 M
    "medium": ModelSpec(family="llama", d_model=1024, num_layers=16, num_heads=16, num_kv_heads=4, seq_len=512),
    # about 0.93 B
    "large": ModelSpec(family="llama", d_model=2048, num_layers=20, num_heads=16, num_kv_heads=8, seq_len=1024),
}


def preset(name: str) -> ModelSpec:
    """The model ``name`` names; ``ValueError`` naming the presets if there is none."""
    if name not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {name!r}")
    return PRESETS[name]
