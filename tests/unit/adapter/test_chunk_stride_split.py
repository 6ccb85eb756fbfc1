"""The scheduler side of load-independent per-chunk eviction: a prompt evicted chunk by chunk never gets a
prefill chunk past a multiple of its chunk stride (``runner_hooks.split_prefill_chunk``, routed through
vLLM's Mamba split hook), so the worker evicts it at the same positions alone or under load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from evicting_manager import evicting_manager

from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.vllm_adapter import runner_hooks

BLOCK_SIZE = 32


def scheduler_with(config: EvictionConfig) -> SimpleNamespace:
    manager, _ = evicting_manager(config, BLOCK_SIZE, 400)
    coordinator = SimpleNamespace(single_type_managers=[manager])
    return SimpleNamespace(has_mamba_layers=False, kv_cache_manager=SimpleNamespace(coordinator=coordinator))


def request(prompt_len: int, computed: int, extra_args: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id="r",
        num_prompt_tokens=prompt_len,
        num_computed_tokens=computed,
        sampling_params=SimpleNamespace(extra_args=extra_args),
    )


def split(scheduler, req, new_tokens: int, hits: int = 0) -> int:
    def unexpected(*args):
        raise AssertionError("vLLM's Mamba split must not run for a model without Mamba layers")

    return runner_hooks.split_prefill_chunk(unexpected, scheduler, req, new_tokens, hits)


@pytest.mark.parametrize(
    ("computed", "new_tokens", "expected"),
    [
        (0, 2048, 512),  # the first chunk stops at the first multiple
        (0, 300, 300),  # a chunk the token budget cut stays as it is
        (300, 2048, 212),  # the next one completes the stride
        (512, 512, 512),
        (3700, 512, 396),  # stops at 4096 < prompt end
        (4096, 512, 512),  # from 4096 on the prompt ends before the next multiple: vLLM's chunk
    ],
)
def test_chunks_of_a_per_chunk_prompt_stop_at_multiples_of_the_stride(computed, new_tokens, expected):
    config = EvictionConfig(method="snapkv", budget=256, prefill="chunked", chunk_stride=512)
    scheduler = scheduler_with(config)
    assert split(scheduler, request(4200, computed), new_tokens) == expected


def test_whole_prompt_requests_and_decoding_requests_keep_vllms_chunk():
    scheduler = scheduler_with(EvictionConfig(method="snapkv", budget=256, prefill="whole", chunk_stride=512))
    assert split(scheduler, request(4000, 0), 2048) == 2048
    chunked = scheduler_with(EvictionConfig(method="snapkv", budget=256, prefill="chunked", chunk_stride=512))
    assert split(chunked, request(4000, 0, {"kv_eviction": "none"}), 2048) == 2048
    assert split(chunked, request(4000, 4000), 1) == 1  # generating
    assert split(chunked, request(4000, 0), 2048, hits=300) == 212  # counted from the computed tokens


def test_the_scheduler_routes_prefill_chunks_through_the_split_only_with_a_stride_to_keep():
    config = EvictionConfig(method="snapkv", budget=256, prefill="chunked", chunk_stride=512)
    scheduler = scheduler_with(config)
    scheduler.need_mamba_block_aligned_split = False
    runner_hooks.scheduler_init(lambda s, *a, **k: None, scheduler)
    assert scheduler.need_mamba_block_aligned_split is True
    plain = SimpleNamespace(
        has_mamba_layers=False,
        need_mamba_block_aligned_split=False,
        kv_cache_manager=SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=[object()])),
    )
    runner_hooks.scheduler_init(lambda s, *a, **k: None, plain)
    assert plain.need_mamba_block_aligned_split is False
