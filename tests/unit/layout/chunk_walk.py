"""A prompt computed in random chunks under a per-chunk plan, with the checks every such plan must pass."""

from __future__ import annotations

import random
from collections.abc import Iterator

from vllm_kvevict.layout.accounting import RequestPlan, cdiv


def walk_chunks(plan: RequestPlan, rng: random.Random) -> Iterator[tuple[int, int]]:
    """Yields (computed tokens, offset) after each random chunk before the prompt completes, having checked
    that the blocks held while the chunk ran hold a(n0) + chunk entries per head, that the offset never
    decreases, stays block-aligned and at most O0, that the kept entries fit the blocks the scheduler keeps,
    and that the worker re-scores exactly when the offset moves; then that the prompt ends at O0 with the
    plan's freed blocks."""
    bs, prompt_len = plan.block_size, plan.prompt_len
    done, offset = 0, 0
    while done < prompt_len:
        step = min(rng.choice([1, bs, 256, 512, rng.randint(1, 2048)]), prompt_len - done)
        held_blocks = cdiv(done + step, bs) - plan.blocks_freed_at(done)
        assert cdiv(plan.kept_length_at(done) + step, bs) <= held_blocks
        done += step
        assert plan.offset_at(done) >= offset and plan.offset_at(done) % bs == 0
        offset = plan.offset_at(done)
        if done < prompt_len:
            assert offset <= plan.offset0
            assert cdiv(plan.kept_length_at(done), bs) <= cdiv(done, bs) - plan.blocks_freed_at(done)
            assert plan.chunk_rescores(done - step, done) == (plan.offset_at(done - step) != offset)
            yield done, offset
    assert offset == plan.offset0 and plan.blocks_freed_at(prompt_len) == plan.blocks_to_free
