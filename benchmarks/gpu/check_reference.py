"""(b) Evicted attention on the GPU equals the project's torch reference over the kept entries.

The same check as ``tests/e2e/test_compacted_attention_reference.py`` on the CPU: one request through the
eviction server (``ada-snapkv``, ragged per-head budgets) with ``KVEVICT_DEBUG_DUMP_DIR`` set, so the
worker saves each layer's kept token indices per KV head; HF transformers (float32, on the GPU,
``vllm_kvevict.hf_reference``) runs the same prompt, hides every evicted (layer, head, token) entry and is
fed vLLM's generated tokens (teacher forcing). Every layer's attention feeds the next, so agreement of each
step's log-probability checks the compacted attention of all layers. A full-cache run is the control: where
the two references differ, vLLM must side with the masked one. The tolerances are the CPU test's
(``tests/e2e/reference_checks.py``: vLLM bf16 against float32).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from benchmarks.gpu.completions import complete, random_prompt

REPO = Path(__file__).resolve().parents[2]
#: Read by ``vllm_kvevict/datapath/records.py`` (``DEBUG_DUMP_ENV``) in the worker.
DUMP_ENV = "KVEVICT_DEBUG_DUMP_DIR"
PROMPT_TOKENS = 1100
BUDGET = 64
NEW_TOKENS = 128
FIRST_STEPS = 16


def kept_sets(dump_dir: Path, prompt_len: int, wait_s: float = 30.0):
    """Per layer (indices [H, max], counts [H]) the worker saved for the request of ``prompt_len``."""
    import torch

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for path in dump_dir.glob("*.pt"):
            if path.name.endswith(".decode.pt"):
                continue
            record = torch.load(path)
            if record["prompt_len"] == prompt_len:
                return list(zip(record["indices"], record["counts"], strict=True))
        time.sleep(0.5)
    raise FileNotFoundError(f"no kept-set record for a {prompt_len}-token prompt in {dump_dir}")


def teacher_forced(model, prompt_ids: list[int], tokens, kept):
    """[T, vocab] float32 HF log-probabilities along ``tokens`` with per-layer ``kept`` sets (as the CPU
    test's ``teacher_forced``)."""
    import torch
    from transformers import DynamicCache

    from vllm_kvevict.hf_reference.capture import prefill
    from vllm_kvevict.hf_reference.generation import evicting

    with torch.inference_mode():
        prompt = prefill(model, torch.tensor(prompt_ids), capture=False)
        cache = DynamicCache(config=model.config)
        for layer, (keys, values) in enumerate(zip(prompt.keys, prompt.values, strict=True)):
            cache.update(keys.clone(), values.clone(), layer)
        with evicting(model, [kept], len(prompt_ids)):
            out = model(input_ids=tokens[None, :-1].to(model.device), past_key_values=cache, use_cache=True)
        logits = torch.cat([prompt.last_logits[None], out.logits[0].float()])
        return torch.log_softmax(logits, dim=-1).cpu()


def run(eviction, model_dir: Path, dump_dir: Path, vocab_size: int) -> dict:
    import torch

    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    from reference_checks import logprob_gap, near_tie_margin

    from vllm_kvevict.hf_reference.model import load_reference_model
    from vllm_kvevict.policies.base import KeptTokens

    prompt = random_prompt(PROMPT_TOKENS, vocab_size, seed=7)
    completion = complete(eviction.base_url, eviction.served_model_name, prompt, NEW_TOKENS,
                          xargs={"kv_budget": BUDGET})
    tokens = torch.tensor(completion.tokens)
    vllm_logprobs = torch.tensor(completion.logprobs, dtype=torch.float32)
    kept = [KeptTokens(i, c) for i, c in kept_sets(dump_dir, len(prompt))]
    everything = [KeptTokens.everything(k.counts.shape[0], len(prompt)) for k in kept]
    model, _ = load_reference_model(model_dir, dtype=torch.float32)
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    masked = teacher_forced(model, prompt, tokens, kept)
    full = teacher_forced(model, prompt, tokens, everything)
    to_masked = logprob_gap(vllm_logprobs, tokens, masked)
    to_full = logprob_gap(vllm_logprobs, tokens, full)
    index = torch.arange(len(tokens))
    moved = (masked[index, tokens] - full[index, tokens]).abs() > 0.1
    sides = float((to_masked[moved] < to_full[moved]).float().mean()) if bool(moved.any()) else float("nan")
    result = {
        "prompt_tokens": len(prompt), "budget": BUDGET, "new_tokens": len(tokens),
        "kept_per_layer_max": [int(k.counts.max()) for k in kept],
        "first_steps_max_gap": float(to_masked[:FIRST_STEPS].max()),
        "first_steps_max_near_tie": float(near_tie_margin(tokens, masked)[:FIRST_STEPS].max()),
        "gap_mean": float(to_masked.mean()), "gap_p99": float(to_masked.quantile(0.99)),
        "gap_max": float(to_masked.max()), "full_cache_gap_mean": float(to_full.mean()),
        "steps_moved_by_eviction": int(moved.sum()), "sides_with_masked": sides,
    }
    result["ok"] = (
        result["first_steps_max_gap"] < 0.15 and result["first_steps_max_near_tie"] < 0.1
        and result["gap_mean"] < 0.03 and result["gap_p99"] < 0.25 and result["gap_max"] < 0.6
        and max(result["kept_per_layer_max"]) < len(prompt)
        and (result["steps_moved_by_eviction"] < 10 or sides >= 0.9)
    )
    return result
