"""Scheduler side of eviction: the manager of ``EvictingAttentionSpec`` frees a request's blocks that its
compacted cache no longer needs.

The worker compacts each layer's kept entries into the blocks the accounting rule lets the request keep
(``vllm_kvevict.layout.accounting``); this manager frees the others through vLLM's own
``_remove_blocks_in_range`` (``vllm_private.remove_blocks_in_range``; the in-tree RSWAManager frees a middle
gap the same way). Both sides derive the plan from the prompt length and the request's sampling parameters
(per-request ``vllm_xargs``, ``request_settings.py``), so no message crosses between them, except for an
adaptive plan (KVzap's threshold): its worker reports the request's kept bound on the step's output, and
the manager frees the blocks that bound leaves from then on (``note_kept_bounds``).
"""

from __future__ import annotations

from typing import Any

from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from vllm_kvevict import metrics
from vllm_kvevict.layout.accounting import RequestPlan, cdiv, with_kept_bound
from vllm_kvevict.layout.context_reuse import entry_blocks, keeps_entry
from vllm_kvevict.layout.shared_prefix import (
    freed_range,
    publishable_tokens,
    reads_prefix_cache,
    spare_blocks,
)
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.request_settings import RequestSettings, ResolvedSetting
from vllm_kvevict.vllm_adapter.cache_bytes import block_bytes, cache_bytes_clause
from vllm_kvevict.vllm_adapter.kept_contexts import KeptContexts
from vllm_kvevict.vllm_adapter.kv_spec import EvictingAttentionSpec
from vllm_kvevict.vllm_adapter.vllm_private import fill_spec_registry, remove_blocks_in_range

logger = init_logger("vllm.kvevict")

#: prompt length the start-up capacity estimate uses when max_model_len is unknown.
_REFERENCE_PROMPT_LEN = 4096


class EvictingAttentionManager(FullAttentionManager):
    """FullAttentionManager that frees the blocks a compacted request no longer needs once its prompt is
    processed: its leading blocks [0, s) (s from ``plan_request``), or the middle range [c, c + s') after the
    c blocks it shares through the prefix cache (``shared_prefix.py``); with a decode-time cap more leading
    blocks as its output grows (``RequestPlan.blocks_freed(t)``, like SlidingWindowManager). Positions, slot
    math and ``num_computed_tokens`` stay untouched; freed blocks return to the pool and are reused by the
    next ``allocate_slots``. With vLLM's prefix cache on, a request whose prompt completes is given spare
    blocks for its kept entries where the pool has room (``shared_prefix.spare_blocks``): every allocation
    of it then counts ``k`` blocks more, and all its private prompt blocks are freed and stay published."""

    def __init__(self, kv_cache_spec: EvictingAttentionSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        config = kv_cache_spec.eviction
        assert config is not None  # evicting_spec_from sets it
        block_size = kv_cache_spec.block_size
        num_layers = kv_cache_spec.num_model_layers

        self.settings = RequestSettings(config, block_size, num_layers)
        self.plan_for = self.settings.plan_for
        # request -> its own setting, for requests with a per-request setting (vllm_xargs)
        self.request_settings: dict[str, ResolvedSetting] = {}
        # request -> prompt tokens it found in the prefix cache when it was admitted (shared blocks)
        self.shared_tokens: dict[str, int] = {}
        self.saved_blocks: dict[str, int] = {}  # request -> blocks freed (metrics)
        # Spare blocks (shared_prefix.py): request -> prompt length (noted at admission); request -> spare
        # blocks it was given (0: compacts in place), decided by its allocation that reaches its prompt's end.
        self.spare_columns = kv_cache_spec.spare_columns if self.enable_caching else 0
        self.prompt_lens: dict[str, int] = {}
        self.spares: dict[str, int] = {}
        self._offered: dict[str, int] = {}  # spare blocks the last get_num_blocks_to_allocate counted
        # Kept contexts (layout/context_reuse.py): request -> identity of its setting, for requests asking
        # kv_context "keep"; creator -> chain hash of its context, until its entry is published.
        self.context_requests: dict[str, str] = {}
        self.pending_contexts: dict[str, bytes] = {}
        self.contexts = KeptContexts(self.block_pool, block_size, self.kv_cache_group_id)
        # Adaptive plans (accounting.py): request -> the kept bound its worker reported after compacting.
        self.kept_bounds: dict[str, int] = {}
        self.num_layers = num_layers
        metrics.start_kept_contexts()
        vllm_config = get_current_vllm_config_or_none()
        max_model_len = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
        plan = self.plan_for(max_model_len or _REFERENCE_PROMPT_LEN)
        self.block_bytes = block_bytes(kv_cache_spec.page_size_bytes, num_layers)  # saved blocks in bytes
        in_bytes = cache_bytes_clause(plan, self.block_bytes, kv_cache_spec.dtype)
        logger.info("%s%s", capacity_summary(config, plan), in_bytes)

    def admit_request(
        self, request_id: str, sampling_params: Any, cached_tokens: int = 0, request: Any = None
    ) -> None:
        """Note a request's own setting (its ``extra_args``) and the prompt tokens it found in the prefix
        cache before its first blocks are counted; called by the ``KVCacheManager.allocate_slots`` wrapper
        (runner_hooks.py) on every allocation, cheap after the first. ``request`` (vLLM's): a creator of a
        kept context notes its context's chain hash from it."""
        if request_id in self.req_to_blocks:
            return
        if request is not None:
            self.prompt_lens[request_id] = request.num_prompt_tokens
        setting = self.settings.resolve(getattr(sampling_params, "extra_args", None))
        if setting is None:
            self.request_settings.pop(request_id, None)
        else:
            self.request_settings[request_id] = setting
        if cached_tokens > 0:
            self.shared_tokens[request_id] = cached_tokens
        else:
            self.shared_tokens.pop(request_id, None)
        self._admit_context(request_id, setting, cached_tokens, request)

    def _admit_context(
        self, request_id: str, setting: ResolvedSetting | None, cached_tokens: int, request: Any
    ) -> None:
        """A kv_context request: a reader (it starts from an entry) or a creator (it may leave one)."""
        self.pending_contexts.pop(request_id, None)
        if setting is None or not setting.keeps_context:
            self.context_requests.pop(request_id, None)
            return
        self.context_requests[request_id] = setting.identity
        if cached_tokens > 0 or request is None:
            return
        plan = self.request_plan(request_id, request.num_prompt_tokens)
        if keeps_entry(plan):
            chain = self.contexts.chain_hash(request.block_hashes, plan.prompt_len)
            if chain is not None:
                self.pending_contexts[request_id] = chain

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Any, *args: Any, **kwargs: Any):
        super().add_local_computed_blocks(request_id, new_computed_blocks, *args, **kwargs)
        if request_id in self.context_requests and self.shared_tokens.get(request_id, 0):
            metrics.record_context_read()  # once: the request now holds the entry's blocks

    def request_plan(self, request_id: str, num_prompt_tokens: int) -> RequestPlan:
        """The plan of one request's private part: its own setting when it has one, else the server's; an
        adaptive plan with the kept bound its worker reported, once it has."""
        shared = self.shared_tokens.get(request_id, 0)
        setting = self.request_settings.get(request_id)
        plan = self.settings.plan(setting, num_prompt_tokens, shared)  # as the worker derives it
        if setting is not None and setting.keeps_context:
            return plan
        bound = self.kept_bounds.get(request_id)
        return plan if bound is None else with_kept_bound(plan, bound)

    def note_kept_bounds(self, bounds: dict[str, int]) -> None:
        """Kept bounds the workers reported for requests of adaptive plans compacted in the step just
        processed (``runner_hooks.update_from_output``): from the next ``remove_skipped_blocks`` the request
        frees the leading blocks its bound leaves. A report for a request that no longer holds its blocks
        (preempted or finished since) is stale and dropped; one its plan cannot take is logged and dropped
        (the request keeps the ceiling's blocks, which always suffice)."""
        for request_id, bound in bounds.items():
            prompt_len = self.prompt_lens.get(request_id)
            if request_id not in self.req_to_blocks or prompt_len is None:
                continue
            self.kept_bounds.pop(request_id, None)  # a recomputed request reports again
            try:
                with_kept_bound(self.request_plan(request_id, prompt_len), bound)
            except ValueError as exc:
                logger.warning("kv-eviction: request %s reported kept bound %s: %s", request_id, bound, exc)
                continue
            self.kept_bounds[request_id] = bound

    def kept_context_hit(self, request: Any) -> tuple[list[Any], int] | None:
        """(blocks, computed tokens) a kv_context request starts from — ``[null] × (C/bs - m)`` and an entry's
        m blocks — or None when no intact entry of its setting starts its prompt (it then computes its
        prompt and may leave one)."""
        setting = self.setting_of(request)
        if setting is None or not setting.keeps_context or not self.block_pool.enable_caching:
            return None
        entry = self.contexts.lookup(setting.identity, request.block_hashes, request.num_tokens - 1)
        if entry is None:
            return None
        where = entry_blocks(setting.plan_for(entry.context_tokens))
        if where.count != len(entry.blocks):  # cannot happen for one identity; never serve a mismatch
            return None
        return [self.block_pool.null_block] * where.reader_first + list(entry.blocks), entry.context_tokens

    def keeps_context(self, request: Any) -> bool:
        """True when ``request`` asked ``kv_context: "keep"`` (its sampling parameters, before admission)."""
        setting = self.setting_of(request)
        return setting is not None and setting.keeps_context

    def skips_prefix_cache(self, request: Any) -> bool:
        """True when ``request``'s plan rewrites its blocks over time (it evicts between chunks or while
        generating): it must neither read cached prefix blocks (other requests share them) nor publish its
        own (an fp8 cache too: its rows are read back through its scales). Resolved from its sampling
        parameters, so it holds before the request is admitted."""
        return not reads_prefix_cache(self.whole_prompt_plan(request))

    def chunk_stride_of(self, request: Any) -> int:
        """S of a request whose prompt is evicted chunk by chunk (its plan's ``chunk_stride``), else 0: the
        scheduler ends its prefill chunks at multiples of S (``runner_hooks.split_prefill_chunk``)."""
        plan = self.whole_prompt_plan(request)
        return plan.chunk_stride if plan.evicts_between_chunks else 0

    def whole_prompt_plan(self, request: Any) -> RequestPlan:
        """The plan of ``request``'s whole prompt (nothing shared), from its sampling parameters: known before
        the request is admitted."""
        setting = self.setting_of(request)
        return (setting.plan_for if setting else self.plan_for)(request.num_prompt_tokens)

    def setting_of(self, request: Any) -> ResolvedSetting | None:
        """``request``'s own setting from its sampling parameters (None: the server's)."""
        return self.settings.resolve(getattr(request.sampling_params, "extra_args", None))

    def cache_blocks(self, request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> None:
        """Publish only blocks no compaction ever writes (``shared_prefix.publishable_tokens``); a reader of a
        kept context publishes nothing (its own tokens were computed against a compacted context)."""
        shared = self.shared_tokens.get(request.request_id, 0)
        if shared and request.request_id in self.context_requests:
            limit: int | None = shared  # a reader: nothing after the entry it started from
        else:
            plan = self.request_plan(request.request_id, request.num_prompt_tokens)
            limit = publishable_tokens(plan, shared, self.spares.get(request.request_id, 0))
        if limit is not None:
            num_tokens = min(num_tokens, limit)
        super().cache_blocks(request, num_tokens, *args, **kwargs)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        if num_prompt_tokens is None:
            return
        # Processed tokens only: the worker compacted in the step that computed them (per chunk, then after
        # the prompt and at decode-time re-scores; accounting.py).
        plan = self.request_plan(request_id, num_prompt_tokens)
        spare = self.spares.get(request_id, 0)
        shared = self.shared_tokens.get(request_id, 0)
        first, last = freed_range(plan, shared, processed_computed_tokens, spare)
        if last > first:
            # Iterates backwards and stops at the first null block, so repeated calls cost O(1).
            remove_blocks_in_range(self, request_id, first, last)
            freed = last - first - spare  # blocks held in addition without eviction
            if self.saved_blocks.get(request_id) != freed and request_id in self.req_to_blocks:
                self.saved_blocks[request_id] = freed
                self._publish_saved_blocks()
            if request_id in self.pending_contexts:
                self._publish_context(request_id, plan)

    # ----- spare blocks (shared_prefix.py) ---------------------------------------------------------------
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        *args: Any,
        **kwargs: Any,
    ) -> int:
        """vLLM's count, plus the request's spare blocks: those it holds, or those offered to it when this
        allocation completes its prompt and the pool keeps room for them beyond the allocation."""

        def count(tokens: int) -> int:
            return super(EvictingAttentionManager, self).get_num_blocks_to_allocate(
                request_id,
                tokens,
                new_computed_blocks,
                total_computed_tokens,
                num_local_computed_tokens,
                num_tokens_main_model,
                *args,
                **kwargs,
            )

        spare = self.spares.get(request_id)
        if spare is not None:
            return count(num_tokens + spare * self.block_size)
        offer = self._spare_offer(request_id, num_tokens_main_model)
        self._offered.pop(request_id, None)
        if offer:
            with_spares = count(num_tokens + offer * self.block_size)
            # Room for the spares and as many blocks again: they never take the pool's last blocks.
            if with_spares + offer <= self.block_pool.get_num_free_blocks():
                self._offered[request_id] = offer
                return with_spares
        return count(num_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[Any]:
        """vLLM's allocation shifted by the request's spare blocks; the allocation that completes its prompt
        decides them (those ``get_num_blocks_to_allocate`` offered, or none)."""
        spare = self.spares.get(request_id)
        if spare is None:
            prompt_len = self.prompt_lens.get(request_id)
            if prompt_len is None or num_tokens_main_model < prompt_len:
                spare = 0
            else:
                spare = self._offered.pop(request_id, 0)
                self.spares[request_id] = spare
        shifted = num_tokens + spare * self.block_size
        return super().allocate_new_blocks(request_id, shifted, num_tokens_main_model)

    def _spare_offer(self, request_id: str, num_tokens_main_model: int) -> int:
        """Spare blocks a request may be given in an allocation of ``num_tokens_main_model`` tokens: its
        plan's ``k`` when the allocation ends exactly at its prompt's end (nothing generated after it: a
        request recomputed after preemption compacts in place), it reads the prefix cache, keeps no kept
        context and ``k`` fits the block-table's spare columns; else 0."""
        prompt_len = self.prompt_lens.get(request_id)
        if (
            not self.spare_columns
            or prompt_len is None
            or num_tokens_main_model != prompt_len
            or request_id in self.context_requests
        ):
            return 0
        spare = spare_blocks(self.request_plan(request_id, prompt_len))
        return spare if spare <= self.spare_columns else 0

    def finish_request(self, request: Any) -> None:
        """Before ``request``'s blocks are freed (finished, aborted or preempted; the ``KVCacheManager.free``
        wrapper): a creator whose context was processed in a step that completed publishes it now, also when
        it never got another allocation (a request generating one token)."""
        request_id = request.request_id
        if request_id not in self.pending_contexts:
            return
        processed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        plan = self.request_plan(request_id, request.num_prompt_tokens)
        if processed >= plan.prompt_len:
            self._publish_context(request_id, plan)
        else:
            self.pending_contexts.pop(request_id)

    def _publish_context(self, request_id: str, plan: RequestPlan) -> None:
        """A creator's context is compacted (its freed range is applied): its m blocks become the entry."""
        chain = self.pending_contexts.pop(request_id)
        where = entry_blocks(plan)
        blocks = self.req_to_blocks.get(request_id, [])[where.first : where.first + where.count]
        if self.block_pool.enable_caching and len(blocks) == where.count:
            identity = self.context_requests[request_id]
            if self.contexts.publish(identity, chain, plan.prompt_len, blocks):
                metrics.record_context_kept()

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.kept_bounds.pop(request_id, None)
        self.request_settings.pop(request_id, None)
        self.shared_tokens.pop(request_id, None)
        self.context_requests.pop(request_id, None)
        self.pending_contexts.pop(request_id, None)
        self.prompt_lens.pop(request_id, None)
        self.spares.pop(request_id, None)
        self._offered.pop(request_id, None)
        if self.saved_blocks.pop(request_id, None) is not None:
            self._publish_saved_blocks()

    def _publish_saved_blocks(self) -> None:
        """Blocks running requests would hold in addition without eviction, for the dashboard."""
        # The pool's usable size, as vLLM's own kv_cache_usage_perc counts it (one null block).
        saved = sum(self.saved_blocks.values())
        metrics.set_kv_cache_saved(saved, self.block_pool.num_gpu_blocks - 1, self.block_bytes)


def capacity_summary(config: EvictionConfig, plan: RequestPlan) -> str:
    """One start-up line: the active setting and the expected capacity gain for a prompt of plan's length."""
    full_blocks = cdiv(plan.prompt_len, plan.block_size)
    kept_blocks = plan.blocks_held(0)
    decode = ""
    if plan.decode_cap:
        peak = plan.decode_cap + max(plan.decode_interval, 2 * plan.block_size)
        decode = (
            f"; while generating each KV head is re-scored every {plan.decode_interval} tokens down to "
            f"{plan.decode_cap} (at most {peak} entries per head), a request then holds <= "
            f"{cdiv(peak, plan.block_size) + 1} blocks"
        )
    return (
        f"kv-eviction active: {config.describe()}, block size {plan.block_size}; a {plan.prompt_len}-token "
        f"prompt keeps <= {plan.kept_bound} tokens per KV head and holds {kept_blocks} of {full_blocks} "
        f"blocks after prefill (about {full_blocks / kept_blocks:.1f}x more such requests in the KV pool)"
        f"{decode}"
    )


def register_evicting_spec() -> None:
    """Register the spec with its manager (every process; idempotent).

    The built-in specs go first: the registry fills itself lazily only while it is empty, so registering
    ours first would hide them."""
    fill_spec_registry()
    KVCacheSpecRegistry.register(
        EvictingAttentionSpec, EvictingAttentionManager, uniform_type_base_spec=FullAttentionSpec
    )
