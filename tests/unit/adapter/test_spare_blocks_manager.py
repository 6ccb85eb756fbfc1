"""Scheduler side of spare blocks (``layout/shared_prefix.py``): a request whose allocation completes its
prompt is given ``k`` blocks beyond it where the pool has room, every private prompt block is freed (and
may stay published) once the prompt is processed, and from then on it holds exactly what compacting in
place would hold. vLLM's real ``BlockPool``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from evicting_manager import evicting_manager
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.layout.shared_prefix import spare_blocks
from vllm_kvevict.settings.config import EvictionConfig

BS = 32
PROMPT = 1000
CONFIG = EvictionConfig(method="ada-snapkv", budget=0.25, prefill="whole")


def request(prompt_len: int = PROMPT, tag: str = "r"):
    return SimpleNamespace(
        request_id=tag, num_prompt_tokens=prompt_len, sampling_params=SimpleNamespace(extra_args=None)
    )


def admitted(num_blocks: int = 400, spare_columns: int = 64, caching: bool = True):
    manager, pool = evicting_manager(
        CONFIG, BS, num_blocks, enable_caching=caching, spare_columns=spare_columns
    )
    req = request()
    manager.admit_request(req.request_id, req.sampling_params, 0, req)
    return manager, pool, req


def allocate(manager, req_id: str, tokens: int) -> int:
    """vLLM's order in ``allocate_slots``: count, then allocate; returns the count."""
    count = manager.get_num_blocks_to_allocate(req_id, tokens, [], 0, 0, tokens)
    manager.allocate_new_blocks(req_id, tokens, tokens)
    return count


def test_the_allocation_completing_a_prompt_adds_spares_and_the_whole_private_prompt_is_freed():
    manager, pool, req = admitted()
    plan = manager.plan_for(PROMPT)
    n, k = cdiv(PROMPT, BS), spare_blocks(plan)
    assert plan.compacts and k == n - plan.blocks_to_free and k > 0
    free_at_start = pool.get_num_free_blocks()
    assert allocate(manager, "r", 512) == cdiv(512, BS)  # a chunk before the prompt's end: no spares
    assert allocate(manager, "r", PROMPT) == n + k - cdiv(512, BS)
    assert manager.spares["r"] == k
    assert pool.get_num_free_blocks() == free_at_start - n - k

    manager.remove_skipped_blocks("r", PROMPT - 1, PROMPT)  # not yet processed: nothing freed
    assert pool.get_num_free_blocks() == free_at_start - n - k
    manager.remove_skipped_blocks("r", PROMPT, PROMPT)
    blocks = manager.req_to_blocks["r"]
    assert all(b.is_null for b in blocks[:n]) and not any(b.is_null for b in blocks[n:])
    assert pool.get_num_free_blocks() == free_at_start - k
    assert k == plan.blocks_held(0)  # what compacting in place holds
    assert manager.saved_blocks["r"] == plan.blocks_to_free  # net: held beyond vLLM's count

    for generated in (1, 40, 300):  # growth: every allocation counts the k spares, as in place
        allocate(manager, "r", PROMPT + generated)
        manager.remove_skipped_blocks("r", PROMPT + generated, PROMPT)
        assert free_at_start - pool.get_num_free_blocks() == plan.blocks_held(generated)
    manager.free("r")
    assert pool.get_num_free_blocks() == free_at_start
    assert "r" not in manager.spares and "r" not in manager.prompt_lens


def test_a_request_with_spares_publishes_its_whole_prompt(monkeypatch):
    published = []
    def cache_blocks(self, r, num_tokens, *args, **kwargs) -> None:
        published.append(num_tokens)

    monkeypatch.setattr(FullAttentionManager, "cache_blocks", cache_blocks)
    manager, _, req = admitted()
    plan = manager.plan_for(PROMPT)
    manager.cache_blocks(req, 512)
    allocate(manager, "r", PROMPT)
    manager.cache_blocks(req, PROMPT)
    manager.cache_blocks(req, PROMPT + 200)  # generated tokens: never (blocks past the prompt are spares)
    assert published == [min(512, plan.blocks_to_free * BS), PROMPT, PROMPT]


@pytest.mark.parametrize(
    ("case", "num_blocks", "spare_columns", "caching", "first_allocation"),
    [
        ("tight pool", cdiv(PROMPT, BS) + 6, 64, True, PROMPT),  # room for the prompt, not for k more twice
        ("no spare columns", 400, 0, True, PROMPT),
        ("prefix caching off", 400, 64, False, PROMPT),
        ("recomputed after preemption", 400, 64, True, PROMPT + 7),  # generated tokens in the same step
    ],
)
def test_otherwise_it_compacts_in_place(case, num_blocks, spare_columns, caching, first_allocation):
    manager, pool, _ = admitted(num_blocks, spare_columns, caching)
    plan = manager.plan_for(PROMPT)
    free_at_start = pool.get_num_free_blocks()
    assert allocate(manager, "r", first_allocation) == cdiv(first_allocation, BS), case
    assert manager.spares["r"] == 0
    manager.remove_skipped_blocks("r", first_allocation, PROMPT)
    held = free_at_start - pool.get_num_free_blocks()
    assert held == cdiv(first_allocation, BS) - plan.blocks_to_free
    manager.free("r")
    assert pool.get_num_free_blocks() == free_at_start


def test_the_spec_widens_the_worker_rows_by_its_spare_columns():
    manager, _, _ = admitted(spare_columns=9)
    spec = manager.kv_cache_spec
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    assert spec.max_num_blocks_per_req(vllm_config, 4096) == cdiv(4096, BS) + 9
    assert type(spec).merge([spec, spec]) == spec
