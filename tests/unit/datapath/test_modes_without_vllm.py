"""The datapath is vLLM-free: in a process where ``import vllm`` fails, the three eviction modes run through
the one call a backend makes (``EvictionStep.after_attention``) on a fake cache-rows object, and each leaves
every head exactly the entries its rule names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import sys
sys.modules["vllm"] = None  # any import of vLLM (or a backend) raises ImportError from here on
sys.path.insert(0, sys.argv[1])
from simulated_engine import HEADS, LAYERS, SimulatedEngine
from vllm_kvevict.settings.config import EvictionConfig

# Whole prompt: computed in one step, compacted to the layer budgets.
engine = SimulatedEngine(EvictionConfig.from_dict({"method": "ada-snapkv", "budget": 64}))
engine.step([("whole", 300, 0, 300, None)])
plan = engine.worker.plan_for(300)
for layer in range(LAYERS):
    held = engine.held("whole", layer)
    assert sum(map(len, held)) == HEADS * plan.layer_budgets[layer], held
    assert all(h == sorted(set(h)) for h in held)

# Per chunk: 300 tokens in 96-token chunks; every head holds a(n) between chunks, its budget at the end.
engine = SimulatedEngine(EvictionConfig.from_dict({"method": "snapkv", "budget": 64, "prefill": "chunked"}))
plan = engine.worker.plan_for(300)
done = 0
while done < 300:
    step = min(96, 300 - done)
    engine.step([("chunked", 300, done, step, None)])
    done += step
    if done < 300 and "chunked" in engine.worker.chunks.positions:
        assert [len(h) for h in engine.held("chunked", 0)] == [plan.kept_length_at(done)] * HEADS
assert [len(h) for h in engine.held("chunked", 0)] == [plan.layer_budgets[0]] * HEADS

# Decode-time cap: H2O keeps 48 per head; after 40 generated tokens each head holds at most its cap + k.
engine = SimulatedEngine(EvictionConfig.from_dict({"method": "h2o", "budget": 48}))
engine.step([("capped", 40, 0, 40, None)])
for t in range(1, 41):
    engine.step([("capped", 40, 40 + t - 1, 1, None)])
record = engine.worker.decode.records["capped"]
assert record.plan.rescores_at(40)
for layer in range(LAYERS):
    held = engine.held("capped", layer)
    assert all(len(h) == 48 and h[-1] == 79 for h in held), held
assert not [n for n, m in sys.modules.items() if m is not None and (n == "vllm" or n.startswith("vllm."))]
print("three modes ok")
"""


def test_whole_prompt_per_chunk_and_decode_cap_run_without_vllm() -> None:
    here = Path(__file__).resolve().parent
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(here)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "three modes ok" in result.stdout
