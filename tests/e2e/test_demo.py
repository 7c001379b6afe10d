"""The README's first command: the demo swarm starts, trains the Llama-style tiny preset on a BPE
tokenizer the bootstrap trained, reports a falling loss, cleans up, and exports a Hugging Face
folder that transformers loads and generates from."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from peer.harness.local_swarm import REPO_ROOT

pytestmark = [pytest.mark.smoke, pytest.mark.timeout(420)]

# the demo stops once the last stage has computed this many microbatches (the first and the last 20
# are the compared loss windows); --duration only bounds it: a loaded CI host trained 24 in 30 s
MICROBATCHES = 60


def test_demo_trains_and_loss_falls(tmp_path):
    command = [sys.executable, "-m", "peer.harness.demo", "--duration", "240", "--microbatches", str(MICROBATCHES),
               "--workdir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"the last stage computed {MICROBATCHES} microbatches" in result.stdout, result.stdout
    # the peers place themselves (the last stage carries the 4,096-token head, so it may draw more)
    assert re.search(r"stage 0: \d peers?, stage 1: \d peers?", result.stdout), result.stdout + join_lines(tmp_path)
    match = re.search(r"initial loss ([\d.]+) → final loss ([\d.]+) \(nats/token; ln 4096", result.stdout)
    assert match, result.stdout
    initial, final = map(float, match.groups())
    assert final < initial - 0.5
    bootstrap_log = (tmp_path / "bootstrap.log").read_text()
    assert "trained a BPE tokenizer of 4096 tokens" in bootstrap_log, bootstrap_log[-2000:]
    for log in sorted(tmp_path.glob("peer*.log")):  # every peer obtained it from the swarm, checked
        assert "obtained the run's tokenizer" in log.read_text(), log.read_text()[-2000:]
    assert "sample: 'The ' → " in result.stdout, result.stdout
    generated = generate_from_export(tmp_path / "hf")
    assert generated.startswith("The ") and len(generated) > len("The "), generated
    assert sorted(p.name for p in tmp_path.glob("peer*.jsonl")) == [f"peer{i}.jsonl" for i in range(4)]
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", "the demo left processes running"


def join_lines(workdir) -> str:
    """What each peer measured and chose, and every stage move: why a layout came out as it did."""
    lines = [line for path in sorted(workdir.glob("peer*.log")) for line in path.read_text().splitlines()
             if re.search(r"measured .*FLOP/s|chose stage|moving from stage|no holder left", line)]
    return "\n".join(["joins:", *sorted(lines)])


def generate_from_export(folder) -> str:
    """What transformers' LlamaForCausalLM, loaded from the demo's export with its tokenizer, writes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    inputs = tokenizer("The ", return_tensors="pt").input_ids
    output = model.generate(inputs, max_new_tokens=12, do_sample=False)
    assert output.shape[1] > inputs.shape[1]
    return tokenizer.decode(output[0])
