"""Paged KV kernels: sub-block views, torch references, Triton/CUDA implementations behind one dispatch.

``views`` defines the layouts (sub-blocks, slots, per-(request, KV head) sequences); ``reference`` holds the
plain-torch ops; ``dispatch`` picks CUDA -> Triton -> torch. Import the ops from here.
"""

from vllm_kvevict.layout.kernels.dispatch import (
    BACKEND_ENV,
    BACKENDS,
    choose_backend,
    compact_subblocks,
    paged_window_scores,
    ragged_paged_attention,
)
from vllm_kvevict.layout.kernels.views import (
    from_head_major,
    head_major_rows,
    subblock_tables_from_block_tables,
    subblock_view,
    to_head_major,
)

__all__ = [
    "BACKEND_ENV",
    "BACKENDS",
    "choose_backend",
    "from_head_major",
    "head_major_rows",
    "compact_subblocks",
    "paged_window_scores",
    "ragged_paged_attention",
    "subblock_tables_from_block_tables",
    "subblock_view",
    "to_head_major",
]
