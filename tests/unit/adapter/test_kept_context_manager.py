"""Scheduler side of a kept context (``layout/context_reuse.py``, ``vllm_adapter/kept_contexts.py``) on vLLM's
real ``BlockPool`` with prefix caching on: a creator's context blocks enter the cache under entry hashes once
its prompt is processed, outlive it as ordinary cached blocks, are found only by requests with the same
setting and the same leading tokens, and stop being served the moment the pool reclaims one of them."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pytest
from evicting_manager import evicting_manager
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from vllm_kvevict.layout.accounting import RequestPlan, cdiv
from vllm_kvevict.layout.context_reuse import entry_blocks
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.vllm_adapter.evicting_kv_manager import EvictingAttentionManager

BS = 32
NUM_BLOCKS = 600
PROMPT = 4010  # context: its first 4000 tokens (125 blocks)
KEEP = {"kv_eviction": "snapkv", "kv_budget": 0.25, "kv_context": "keep"}


def manager_with_cache() -> tuple[EvictingAttentionManager, BlockPool]:
    config = EvictionConfig(method="ada-snapkv", budget=0.25, prefill="whole")
    return evicting_manager(config, BS, NUM_BLOCKS, enable_caching=True)


def token_hashes(tokens: list[int], salt: str = "") -> list[bytes]:
    """Chained per-block hashes of full blocks, like vLLM's (only equality matters here)."""
    hashes, parent = [], salt.encode()
    for start in range(0, len(tokens) - BS + 1, BS):
        parent = hashlib.sha256(parent + json.dumps(tokens[start : start + BS]).encode()).digest()
        hashes.append(parent)
    return hashes


def request(name: str, tokens: list[int], extra_args: dict | None, salt: str = "") -> SimpleNamespace:
    return SimpleNamespace(
        request_id=name,
        num_prompt_tokens=len(tokens),
        num_tokens=len(tokens),
        block_hashes=token_hashes(tokens, salt),
        sampling_params=SimpleNamespace(extra_args=extra_args),
    )


def run_creator(manager: EvictingAttentionManager, creator: SimpleNamespace) -> RequestPlan:
    """Admission, the whole prompt's blocks, the prompt processed (compacted); returns its plan."""
    manager.admit_request(creator.request_id, creator.sampling_params, 0, creator)
    plan = manager.request_plan(creator.request_id, PROMPT)
    manager.allocate_new_blocks(creator.request_id, PROMPT, PROMPT)
    manager.remove_skipped_blocks(creator.request_id, PROMPT - 40, PROMPT)  # context not done: nothing
    assert not manager.contexts.entries
    manager.remove_skipped_blocks(creator.request_id, PROMPT, PROMPT)
    return plan


def start_reader(manager: EvictingAttentionManager, reader: SimpleNamespace) -> list:
    """What vLLM does with the hit: the computed blocks, then blocks for the rest of the prompt."""
    blocks, computed = manager.kept_context_hit(reader)
    manager.admit_request(reader.request_id, reader.sampling_params, computed, reader)
    manager.add_local_computed_blocks(reader.request_id, blocks, computed, 0)
    manager.allocate_new_blocks(reader.request_id, reader.num_tokens, reader.num_tokens)
    return blocks


def test_a_creator_leaves_its_context_and_readers_with_the_same_start_find_it():
    manager, pool = manager_with_cache()
    document = list(range(1000, 1000 + PROMPT))
    creator = request("creator", document, KEEP)
    plan = run_creator(manager, creator)
    entry = entry_blocks(plan)
    assert plan.prompt_len == 4000 and plan.kept_bound % BS == 0 and entry.count == plan.kept_bound // BS
    context_blocks = manager.req_to_blocks["creator"][entry.first : entry.first + entry.count]
    assert all(b.block_hash is not None and not b.is_null for b in context_blocks)
    token_keys = {make_block_hash_with_group_id(h, 0) for h in creator.block_hashes}
    assert not any(b.block_hash in token_keys for b in context_blocks)  # no token lookup can reach them
    manager.free("creator")
    free_after = pool.get_num_free_blocks()
    assert free_after == NUM_BLOCKS - 1  # the entry's blocks are free, evictable cached blocks

    question = document + list(range(50, 80))
    reader = request("reader", question, KEEP)
    blocks = start_reader(manager, reader)
    assert blocks[: entry.reader_first] == [pool.null_block] * entry.reader_first
    assert blocks[entry.reader_first :] == context_blocks
    held = manager.req_to_blocks["reader"]
    assert len(held) == cdiv(len(question), BS)
    own = cdiv(len(question), BS) - 125
    assert pool.get_num_free_blocks() == free_after - entry.count - own
    manager.remove_skipped_blocks("reader", len(question), len(question))  # keeps its own tokens whole
    assert manager.req_to_blocks["reader"] == held
    before = dict(manager.num_cached_block)
    manager.cache_blocks(reader, len(question), replay_boundaries=[])  # publishes nothing of its own
    assert manager.num_cached_block == before
    manager.free("reader")
    assert pool.get_num_free_blocks() == free_after
    assert manager.kept_context_hit(request("again", question, KEEP)) is not None  # still cached


@pytest.mark.parametrize(
    ("tokens", "args", "salt"),
    [
        (list(range(1000, 1000 + PROMPT)), {**KEEP, "kv_budget": 0.1}, ""),  # another budget
        (list(range(1000, 1000 + PROMPT)), {**KEEP, "kv_eviction": "knorm"}, ""),  # another method
        (list(range(1000, 1000 + PROMPT)), KEEP, "salted"),  # another cache_salt
        (list(range(1000, 1000 + 3000)) + [7] + list(range(4001, 5010)), KEEP, ""),  # another token
        (list(range(1000, 1000 + PROMPT)), None, ""),  # a request that did not ask for it
        (list(range(1000, 1000 + 4000)), KEEP, ""),  # the context alone: vLLM computes the last token
    ],
    ids=["budget", "method", "salt", "tokens", "not-asked", "no-token-left"],
)
def test_only_the_same_setting_and_start_find_an_entry(tokens, args, salt):
    manager, _ = manager_with_cache()
    run_creator(manager, request("creator", list(range(1000, 1000 + PROMPT)), KEEP))
    assert manager.kept_context_hit(request("other", tokens, args, salt)) is None


def test_an_entry_whose_block_the_pool_reclaimed_is_never_served():
    manager, pool = manager_with_cache()
    document = list(range(1000, 1000 + PROMPT))
    run_creator(manager, request("creator", document, KEEP))
    manager.free("creator")
    reader = request("reader", [*document, 1, 2, 3], KEEP)
    assert manager.kept_context_hit(reader) is not None
    taken = pool.get_new_blocks(pool.get_num_free_blocks())  # another request needs the whole pool
    assert manager.kept_context_hit(reader) is None
    assert not manager.contexts.entries  # the broken entry is forgotten
    pool.free_blocks(taken)


def test_a_preempted_creator_publishes_nothing_and_a_recomputed_one_publishes_once():
    manager, _ = manager_with_cache()
    document = list(range(1000, 1000 + PROMPT))
    creator = request("creator", document, KEEP)
    manager.admit_request("creator", creator.sampling_params, 0, creator)
    manager.allocate_new_blocks("creator", 2048, 2048)
    manager.free("creator")  # preempted mid-prompt
    assert not manager.contexts.entries and not manager.pending_contexts
    run_creator(manager, creator)
    assert len(manager.contexts.entries) == 1
    twin = request("twin", document, KEEP)  # a second creator of the same context, before it was found
    manager.admit_request("twin", twin.sampling_params, 0, twin)
    manager.allocate_new_blocks("twin", PROMPT, PROMPT)
    manager.remove_skipped_blocks("twin", PROMPT, PROMPT)
    assert len(manager.contexts.entries) == 1  # the intact entry stays; the twin's blocks stay unhashed
    entry = entry_blocks(manager.request_plan("twin", PROMPT))
    twin_blocks = manager.req_to_blocks["twin"][entry.first : entry.first + entry.count]
    assert all(b.block_hash is None for b in twin_blocks)


@pytest.mark.parametrize(("computed", "kept"), [(PROMPT, True), (4000, True), (3999, False), (2048, False)])
def test_a_creator_that_ends_before_another_allocation_publishes_when_freed(computed, kept):
    """A creator generating one token ends right after its prompt's step: ``KVCacheManager.free`` (wrapped,
    ``runner_hooks.free_request``) publishes its processed context; one aborted before it keeps nothing."""
    manager, _ = manager_with_cache()
    creator = request("creator", list(range(1000, 1000 + PROMPT)), KEEP)
    manager.admit_request("creator", creator.sampling_params, 0, creator)
    manager.allocate_new_blocks("creator", PROMPT, PROMPT)
    finished = SimpleNamespace(**vars(creator), num_computed_tokens=computed, num_in_flight_tokens=0)
    manager.finish_request(finished)
    manager.free("creator")
    assert len(manager.contexts.entries) == int(kept) and not manager.pending_contexts
    reader = request("reader", [*range(1000, 1000 + PROMPT), 5, 6], KEEP)
    assert (manager.kept_context_hit(reader) is not None) == kept
