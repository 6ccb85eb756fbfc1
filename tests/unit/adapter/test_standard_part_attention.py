"""A batch mixing compacted and standard-layout requests, through vLLM's real CPU attention op: attending the
standard requests with vLLM's own call and only the compacted ones head-as-sequence (``split_batch``) gives
the outputs of attending the whole batch head-as-sequence (the form every such batch took before)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backends import cpu_attn  # noqa: E402

from vllm_kvevict.datapath.step_inputs import StepInputs  # noqa: E402
from vllm_kvevict.datapath.worker import EvictionWorker  # noqa: E402
from vllm_kvevict.layout.accounting import cdiv  # noqa: E402
from vllm_kvevict.settings.config import EvictionConfig  # noqa: E402
from vllm_kvevict.vllm_adapter import evicting_backend  # noqa: E402
from vllm_kvevict.vllm_adapter.backend_cpu import EvictingCPUAttentionImpl  # noqa: E402

HEADS, GROUP, D, BS, NUM_BLOCKS = 2, 3, 64, 32, 64


@pytest.fixture
def impl(monkeypatch) -> EvictingCPUAttentionImpl:
    model = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: model)
    monkeypatch.setattr(evicting_backend, "get_eviction_config", lambda _: None)
    return EvictingCPUAttentionImpl(
        num_heads=HEADS * GROUP, head_size=D, scale=D**-0.5, num_kv_heads=HEADS, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype="auto",
    )


class Rows:
    def __init__(self) -> None:
        self.rows: dict[str, list[int]] = {}
        self.next = 1

    def table(self, requests: list[tuple[str, int]]) -> torch.Tensor:
        """Block-table rows of (request, tokens after the step), grown by position."""
        for req_id, tokens in requests:
            row = self.rows.setdefault(req_id, [])
            while len(row) < cdiv(tokens, BS):
                row.append(self.next)
                self.next += 1
        table = torch.zeros(len(requests), max(len(self.rows[r]) for r, _ in requests), dtype=torch.int32)
        for i, (req_id, _) in enumerate(requests):
            table[i, : len(self.rows[req_id])] = torch.tensor(self.rows[req_id])
        return table


def run_step(worker, impl, layer, kv_cache, rows, requests):
    """One step over (req_id, prompt_len, computed, scheduled); returns the step and its query."""
    ids = [r[0] for r in requests]
    computed = np.array([r[2] for r in requests])
    q_lens = np.array([r[3] for r in requests])
    table = rows.table([(r[0], r[2] + r[3]) for r in requests])
    positions = [torch.arange(c, c + q) for c, q in zip(computed, q_lens, strict=True)]
    slots = torch.cat(
        [table[i, p // BS].to(torch.int64) * BS + p % BS for i, p in enumerate(positions)]
    )
    worker.begin_step(StepInputs(ids, np.array([r[1] for r in requests]), computed, q_lens))
    step = worker.make_step(len(ids), int(q_lens.sum()), torch.tensor(computed + q_lens), table, slots)
    assert step is not None
    tokens = int(q_lens.sum())
    query = torch.randn(tokens, HEADS * GROUP, D)
    key, value = torch.randn(tokens, HEADS, D), torch.randn(tokens, HEADS, D)
    return step, query, key, value


def test_the_standard_part_through_vllms_call_equals_the_whole_batch_head_as_sequence(impl):
    torch.manual_seed(0)
    config = EvictionConfig.from_dict({"method": "snapkv", "budget": 64, "prefill": "whole"})
    worker = EvictionWorker(config.build_policy(), config, 1, HEADS, BS, max_num_seqs=8)
    isa = cpu_attn._get_attn_isa(torch.float32, BS, D)
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0, layer_name="model.layers.0.attn")
    kv_cache = torch.randn(NUM_BLOCKS, HEADS, BS, 2 * D)
    rows = Rows()
    # A long prompt compacts ...
    step, query, key, value = run_step(worker, impl, layer, kv_cache, rows, [("long", 300, 0, 300)])
    step.after_attention(0, query, key, value, impl.cache_rows(layer, kv_cache, key, value))
    worker.end_step()
    assert "long" in worker.requests
    # ... then decodes between two requests still in the standard layout (a prefill and a later chunk).
    batch = [("a", 100, 0, 100), ("long", 300, 300, 1), ("b", 90, 0, 40)]
    step, query, _, _ = run_step(worker, impl, layer, kv_cache, rows, batch)
    assert step.has_compacted and step.is_mixed
    whole = torch.zeros(query.shape[0] + 3, HEADS * GROUP * D)  # vLLM pads its output past the tokens
    impl._head_sequence_attention(layer, step, step.head_batch(0), query, kv_cache, whole)
    heads_only, standard = step.split_batch(0)
    assert standard is not None and heads_only.tokens.tolist() == [100]
    assert standard.seq_lens.tolist() == [100, 1, 40]  # the compacted request's: a dummy of its query
    split = torch.zeros_like(whole)
    impl._standard_attention(layer, step, standard, query, kv_cache, split)
    impl._head_sequence_attention(layer, step, heads_only, query, kv_cache, split)
    assert split[: query.shape[0]].abs().sum() > 0
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    worker.end_step()
