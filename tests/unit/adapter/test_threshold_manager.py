"""Scheduler side of KVzap's threshold mode (an adaptive plan): the manager holds the ceiling's blocks until
the worker's report of the request's kept bound arrives, then frees the leading blocks that bound leaves; a
stale or impossible report changes nothing, and a finished request returns every block."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from evicting_manager import evicting_manager

from vllm_kvevict.layout.accounting import cdiv, first_block_for_bound
from vllm_kvevict.settings.config import EvictionConfig

BLOCK_SIZE, NUM_BLOCKS, PROMPT = 32, 400, 4000


def _request(request_id: str, prompt_len: int = PROMPT) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=request_id, num_prompt_tokens=prompt_len, sampling_params=SimpleNamespace(extra_args=None)
    )


@pytest.fixture
def manager_and_pool():
    config = EvictionConfig.from_dict({"method": "kvzap", "budget": 1024, "params": {"threshold": 0.0}})
    return evicting_manager(config, BLOCK_SIZE, NUM_BLOCKS, enable_caching=True)


def _admitted(manager, request_id: str) -> SimpleNamespace:
    request = _request(request_id)
    manager.admit_request(request_id, request.sampling_params, 0, request)
    manager.allocate_new_blocks(request_id, PROMPT, PROMPT)
    return request


def test_the_ceiling_first_then_the_reported_bound(manager_and_pool) -> None:
    manager, pool = manager_and_pool
    free_at_start = pool.get_num_free_blocks()
    request = _admitted(manager, "r")
    ceiling = manager.plan_for(PROMPT)
    assert ceiling.adaptive and manager.skips_prefix_cache(request)  # neither reads nor publishes
    manager.remove_skipped_blocks("r", PROMPT, PROMPT)
    held = cdiv(PROMPT, BLOCK_SIZE)
    assert pool.get_num_free_blocks() == free_at_start - held + ceiling.blocks_to_free

    bound = 288  # (4000 - 288) is a multiple of 32
    manager.note_kept_bounds({"r": bound})
    manager.remove_skipped_blocks("r", PROMPT + 1, PROMPT)
    freed = first_block_for_bound(PROMPT, bound, BLOCK_SIZE)
    assert freed > ceiling.blocks_to_free
    assert pool.get_num_free_blocks() == free_at_start - held + freed
    assert all(b.is_null for b in manager.req_to_blocks["r"][:freed])
    assert manager.saved_blocks["r"] == freed

    manager.allocate_new_blocks("r", PROMPT + 200, PROMPT + 200)  # decode growth per position, as usual
    assert sum(not b.is_null for b in manager.req_to_blocks["r"]) == cdiv(PROMPT + 200, BLOCK_SIZE) - freed
    manager.free("r")
    assert pool.get_num_free_blocks() == free_at_start and "r" not in manager.kept_bounds


def test_stale_and_impossible_reports_change_nothing(manager_and_pool, caplog) -> None:
    manager, pool = manager_and_pool
    _admitted(manager, "r")
    manager.remove_skipped_blocks("r", PROMPT, PROMPT)
    free = pool.get_num_free_blocks()
    with caplog.at_level(logging.WARNING, logger="vllm.kvevict"):
        manager.note_kept_bounds({"gone": 288, "r": 290})  # unknown request; bound not block-aligned
        manager.note_kept_bounds({"r": 2048})  # above the ceiling
    assert manager.kept_bounds == {}
    manager.remove_skipped_blocks("r", PROMPT + 1, PROMPT)
    assert pool.get_num_free_blocks() == free
    assert "kept bound 290" in caplog.text and "kept bound 2048" in caplog.text

    manager.free("r")  # preempted: its report of the step before arrives afterwards and is dropped
    manager.note_kept_bounds({"r": 288})
    assert manager.kept_bounds == {}
