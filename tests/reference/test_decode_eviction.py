"""The HF reference with decode-time caps, against brute force: plain HF for the full cache, a physically
pruned cache for StreamingLLM, and an independent token-by-token H2O with hand-rolled attention."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from vllm_kvevict.hf_reference import load_reference_model
from vllm_kvevict.hf_reference.decode_eviction import DecodeCap, capped_decode
from vllm_kvevict.hf_reference.model import attention_modules
from vllm_kvevict.policies.decode import DecodeH2O, DecodeStreamingLLM

pytestmark = pytest.mark.model

TEXT = (
    "Mira keeps bees behind the old mill. In May she sold forty jars of honey at the market, and in June "
    "sixty. Her brother Tom counts the hives every week and writes the numbers in a small green book."
)


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    torch.set_num_threads(2)
    return load_reference_model(model_dir)


@pytest.fixture(scope="module")
def text_ids(reference) -> torch.Tensor:
    _, tokenizer = reference
    return torch.tensor(tokenizer(TEXT)["input_ids"])[:33]


def nll_of(logits: torch.Tensor, target: int) -> float:
    return -float(torch.log_softmax(logits.double(), dim=-1)[target])


def test_full_cache_row_equals_plain_forward(reference, text_ids) -> None:
    model, _ = reference
    n = text_ids.shape[0]
    run = capped_decode(model, text_ids[:1], [DecodeCap(None)], steps=n - 1, interval=4, forced=text_ids[1:])
    with torch.inference_mode():
        logits = model(text_ids[None]).logits[0].double()
    expected = -torch.log_softmax(logits, dim=-1)[torch.arange(n - 1), text_ids[1:]]
    torch.testing.assert_close(run.nll[0], expected, atol=1e-4, rtol=1e-5)


def test_full_cache_greedy_equals_hf_generate(reference, text_ids) -> None:
    model, _ = reference
    prompt = text_ids[:12]
    run = capped_decode(model, prompt, [DecodeCap(None)], steps=8, interval=4)
    plain = model.generate(
        prompt[None], attention_mask=torch.ones(1, 12, dtype=torch.int64), max_new_tokens=8, do_sample=False
    )
    assert run.tokens[0].tolist() == plain[0, 12:].tolist()


@torch.inference_mode()
def pruned_streaming_nll(model, ids: torch.Tensor, sinks: int, cap: int, interval: int) -> list[float]:
    """Teacher-forced NLL on a cache that really holds only the sinks and the newest entries after each
    re-score (every head alike), true positions for the new tokens."""
    cache = DynamicCache(config=model.config)
    held = [0]
    logits = model(input_ids=ids[None, :1], past_key_values=cache, use_cache=True).logits[0, -1]
    nll = [nll_of(logits, int(ids[1]))]
    for generated in range(1, ids.shape[0] - 1):
        out = model(
            input_ids=ids[None, generated : generated + 1],
            past_key_values=cache,
            use_cache=True,
            position_ids=torch.tensor([[generated]]),
        )
        nll.append(nll_of(out.logits[0, -1], int(ids[generated + 1])))
        held.append(generated)
        if generated % interval == 0 and len(held) > cap:
            kept = held[:sinks] + held[len(held) - (cap - sinks) :]
            slots = torch.tensor([held.index(p) for p in kept])
            for layer in cache.layers:
                layer.keys = layer.keys[:, :, slots]
                layer.values = layer.values[:, :, slots]
            held = kept
    return nll


def test_streamingllm_equals_a_physically_pruned_cache(reference, text_ids) -> None:
    model, _ = reference
    n = text_ids.shape[0]
    configs = [DecodeCap(DecodeStreamingLLM(sinks=2), cap=8)]
    run = capped_decode(model, text_ids[:1], configs, steps=n - 1, interval=4, forced=text_ids[1:])
    expected = torch.tensor(
        pruned_streaming_nll(model, text_ids, sinks=2, cap=8, interval=4), dtype=torch.float64
    )
    torch.testing.assert_close(run.nll[0], expected, atol=2e-4, rtol=1e-5)
    assert int(run.max_held[0]) == 8 + 4  # the cap plus one interval of slack, reached right before re-scores
    full = capped_decode(model, text_ids[:1], [DecodeCap(None)], steps=n - 1, interval=4, forced=text_ids[1:])
    assert not torch.allclose(run.nll[0], full.nll[0], atol=1e-3)  # the cap really changed something


class QueryLog:
    """Every query of one layer, batch row 0: list of [q_heads, d]."""

    def __init__(self) -> None:
        self.queries: list[torch.Tensor] = []

    def record(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        self.queries.extend(query[0].float().unbind(dim=1))


@torch.inference_mode()
def brute_force_h2o_nll(model, ids: torch.Tensor, window: int, cap: int, interval: int) -> list[float]:
    """Token by token: per (layer, KV head), held positions as sets, accumulated attention as dicts,
    one softmax per (query head, query) over the held entries, selection by sorting."""
    modules = attention_modules(model)
    kv_heads = model.config.num_key_value_heads
    group = model.config.num_attention_heads // kv_heads
    logs = [QueryLog() for _ in modules]
    held = [[{0} for _ in range(kv_heads)] for _ in modules]
    sums = [[{} for _ in range(kv_heads)] for _ in modules]
    cache = DynamicCache(config=model.config)
    nll = []
    try:
        for module, log in zip(modules, logs, strict=True):
            module.kvevict_recorder = log
        for position in range(ids.shape[0] - 1):
            for layer, module in enumerate(modules):
                hidden = torch.ones(1, kv_heads, position, dtype=torch.bool)
                for h in range(kv_heads):
                    for p in held[layer][h]:
                        if p < position:
                            hidden[0, h, p] = False
                module.kvevict_evicted = hidden
            out = model(
                input_ids=ids[None, position : position + 1],
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.tensor([[position]]),
            )
            nll.append(nll_of(out.logits[0, -1], int(ids[position + 1])))
            if position == 0:
                continue  # the statistics come from the generated tokens' queries, not the prompt's
            for layer in range(len(modules)):
                keys = cache.layers[layer].keys[0].float()
                query = logs[layer].queries[position]
                for h in range(kv_heads):
                    held[layer][h].add(position)
                    seen = sorted(held[layer][h])
                    for j in range(h * group, (h + 1) * group):
                        logits = torch.stack([keys[h, p] @ query[j] for p in seen]) / math.sqrt(
                            keys.shape[-1]
                        )
                        for p, prob in zip(seen, torch.softmax(logits, dim=0).tolist(), strict=True):
                            sums[layer][h][p] = sums[layer][h].get(p, 0.0) + prob / group
            if position % interval == 0:  # `position` generated tokens are in the cache
                for layer in range(len(modules)):
                    for h in range(kv_heads):
                        entries = sorted(held[layer][h])
                        recent = set(entries[-window:])
                        rest = sorted(set(entries) - recent, key=lambda p: (-sums[layer][h][p], p))
                        held[layer][h] = recent | set(rest[: cap - len(recent)])
    finally:
        for module in modules:
            del module.kvevict_recorder
            if hasattr(module, "kvevict_evicted"):
                del module.kvevict_evicted
    return nll


def test_h2o_equals_brute_force_accumulated_attention(reference, text_ids) -> None:
    model, _ = reference
    ids = text_ids[:25]
    n = ids.shape[0]
    configs = [DecodeCap(DecodeH2O(window=2), cap=6), DecodeCap(None)]
    run = capped_decode(model, ids[:1], configs, steps=n - 1, interval=4, forced=ids[1:])
    expected = torch.tensor(brute_force_h2o_nll(model, ids, window=2, cap=6, interval=4), dtype=torch.float64)
    torch.testing.assert_close(run.nll[0], expected, atol=2e-4, rtol=1e-5)
    assert not torch.allclose(run.nll[0], run.nll[1], atol=1e-3)
